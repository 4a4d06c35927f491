"""The sparse models released with arXiv 2512.05865 as a model source (``format: circuitlab_gpt2``).

A synthetic checkpoint is laid out as CircuitLab's loader reads the released ones (circuits-research/
CircuitLab at dcf4cc8: ``final.pth`` is a TransformerLens state dict, the vocabulary padded to a
multiple of 64, the dimensions and ``use_sparse_attn`` in config.json; docs/sparsify.md). Prepared and
loaded by attnlab, it gives the logits of a float64 forward written here from the checkpoint alone
(LayerNorm, attention under the causal mask and the mask ``scores > 0`` on the unrenormalised softmax,
a gelu_new MLP, the unembedding), over the tokenizer's ids only. Each bad layout or padding is refused
before any job, naming the key or the shapes and the file."""

import json
import math
from collections import OrderedDict

import pytest
import torch
import yaml
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from attnlab.config import released
from attnlab.config.checks import ConfigError
from attnlab.config.sources import check_model_source, source_config
from conftest import REPO, refusal

LAYERS, HEADS, D, D_HEAD, MLP, CTX, TOKENS = 2, 2, 16, 8, 64, 32, 100
PADDED = 128  # 100 tokens padded to a multiple of 64, as 50,257 -> 50,304


def make_tokenizer(folder, tokens=TOKENS):
    vocab = {f"w{i}": i for i in range(tokens)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")),
                                        eos_token="w1")
    tokenizer.save_pretrained(folder)
    return folder


def make_state(tied=True, padded=PADDED, seed=0) -> OrderedDict:
    """A HookedTransformer-style state dict of a tiny GPT-2: q and k large enough that about half the
    causal edges have a positive score; the padding rows far from the others, so that keeping them,
    or cutting other rows, moves every logit."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=0.3):
        return torch.randn(*shape, generator=generator) * scale

    state = OrderedDict()
    state["embed.W_E"] = draw(padded, D, scale=1.0)
    state["embed.W_E"][TOKENS:] += 5.0
    state["pos_embed.W_pos"] = draw(CTX, D)
    for layer in range(LAYERS):
        block = f"blocks.{layer}."
        state.update({block + "ln1.w": 1 + draw(D, scale=0.1), block + "ln1.b": draw(D, scale=0.1)})
        state.update({f"{block}attn.W_{x}": draw(HEADS, D, D_HEAD, scale=0.8) for x in "QKV"})
        state.update({block + "attn.W_O": draw(HEADS, D_HEAD, D), block + "attn.b_O": draw(D, scale=0.1)})
        state.update({f"{block}attn.b_{x}": draw(HEADS, D_HEAD, scale=0.1) for x in "QKV"})
        state[block + "attn.mask"] = torch.tril(torch.ones(CTX, CTX, dtype=torch.bool))  # a HookedTransformer's buffers
        state[block + "attn.IGNORE"] = torch.tensor(-math.inf)
        state.update({block + "ln2.w": 1 + draw(D, scale=0.1), block + "ln2.b": draw(D, scale=0.1),
                      block + "mlp.W_in": draw(D, MLP), block + "mlp.b_in": draw(MLP, scale=0.1),
                      block + "mlp.W_out": draw(MLP, D), block + "mlp.b_out": draw(D, scale=0.1)})
    state.update({"ln_final.w": 1 + draw(D, scale=0.1), "ln_final.b": draw(D, scale=0.1)})
    state["unembed.W_U"] = state["embed.W_E"].t().clone() if tied else draw(D, padded, scale=1.0)
    if not tied:
        state["unembed.W_U"][:, TOKENS:] += 5.0
    state["unembed.b_U"] = torch.zeros(padded)
    return state


def loader_config(**changes) -> dict:
    """config.json with the fields CircuitLab's branch for these models reads."""
    config = {"d_model": D, "d_head": D_HEAD, "d_vocab": PADDED, "d_mlp": MLP, "n_layers": LAYERS, "n_ctx": CTX,
              "act_fn": "gelu_new", "tokenizer_name": "gpt2", "use_sparse_attn": True}
    config.update(changes)
    return config


def write_release(folder, state, config=None) -> dict:
    """final.pth and config.json in ``folder`` and a local tokenizer beside them; the source."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / "final.pth")
    (folder / "config.json").write_text(json.dumps(config or loader_config()))
    tokenizer = folder.parent / f"{folder.name}-tokenizer"
    if not tokenizer.exists():
        make_tokenizer(tokenizer)
    return {"local": str(folder), "format": "circuitlab_gpt2", "tokenizer": str(tokenizer)}


def hand_logits(state: dict, ids: torch.Tensor, gated: bool = True) -> tuple[torch.Tensor, float]:
    """(logits over the tokenizer's ids, share of causal edges open), in float64 from the checkpoint's
    tensors, as TransformerLens computes a GPT-2 with CircuitLab's sparse mask."""
    s = {key: value.double() for key, value in state.items() if value.is_floating_point()}
    positions = ids.shape[1]
    causal = torch.tril(torch.ones(positions, positions, dtype=torch.bool))

    def norm(x, key):
        centred = x - x.mean(-1, keepdim=True)
        return centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5) * s[key + ".w"] + s[key + ".b"]

    x = s["embed.W_E"][ids] + s["pos_embed.W_pos"][:positions]
    opened = allowed = 0
    for layer in range(LAYERS):
        block = f"blocks.{layer}."
        h = norm(x, block + "ln1")
        q, k, v = (torch.einsum("btd,hde->bhte", h, s[f"{block}attn.W_{x_}"]) + s[f"{block}attn.b_{x_}"][None, :, None]
                   for x_ in "QKV")
        scores = (q @ k.transpose(-1, -2) / math.sqrt(D_HEAD)).masked_fill(~causal, -math.inf)
        pattern = torch.softmax(scores, dim=-1)
        if gated:
            pattern = pattern * (scores > 0)
        opened, allowed = opened + int((scores > 0).sum()), allowed + int(causal.sum()) * q.shape[0] * HEADS
        x = x + torch.einsum("bhte,hed->btd", pattern @ v, s[block + "attn.W_O"]) + s[block + "attn.b_O"]
        pre = norm(x, block + "ln2") @ s[block + "mlp.W_in"] + s[block + "mlp.b_in"]
        act = 0.5 * pre * (1 + torch.tanh(math.sqrt(2 / math.pi) * (pre + 0.044715 * pre.pow(3))))
        x = x + act @ s[block + "mlp.W_out"] + s[block + "mlp.b_out"]
    logits = norm(x, "ln_final") @ s["unembed.W_U"] + s["unembed.b_U"]
    return logits[..., :TOKENS], opened / allowed


@pytest.mark.parametrize("tied, gated", [(True, True), (False, True), (True, False)],
                         ids=["tied", "untied", "dense"])
def test_the_prepared_model_gives_the_hand_written_forwards_logits(tmp_path, tied, gated):
    from attnlab.models import load_model, prepare_model

    state = make_state(tied=tied)
    source = write_release(tmp_path / "release", state, loader_config(use_sparse_attn=gated))
    prepare_model("released", source, tmp_path / "prepared")
    config = json.loads((tmp_path / "prepared" / "config.json").read_text())
    assert config["vocab_size"] == TOKENS and config["tie_word_embeddings"] == tied
    assert (config.get("attnlab_sparse", {}).get("gate_bias") == 0.0) == gated
    model = load_model(tmp_path / "prepared", torch.device("cpu"), torch.float64)
    ids = torch.randint(0, TOKENS, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    expected, open_share = hand_logits(state, ids, gated)
    assert logits.shape == expected.shape == (3, 24, TOKENS)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-10)
    assert 0.2 < open_share < 0.8  # the gate decides: the forward without it is another model
    assert (expected - hand_logits(state, ids, not gated)[0]).abs().max() > 1e-2


def test_the_shapes_read_without_torch_are_torchs(tmp_path):
    source = write_release(tmp_path / "release", make_state())
    shapes = released.checkpoint_shapes(tmp_path / "release" / "final.pth")
    loaded = torch.load(tmp_path / "release" / "final.pth", weights_only=True)
    assert shapes == {key: tuple(value.shape) for key, value in loaded.items()}
    assert source_config(source) == {"model_type": "gpt2", "n_layer": LAYERS, "n_head": HEADS, "n_embd": D}


def _prefixed(state):
    return OrderedDict((f"_orig_mod.{key}", value) for key, value in state.items())


LAYOUTS = {  # a change to the checkpoint -> what the refusal must say
    "missing key": (lambda s: s.pop("blocks.1.attn.W_K"),
                    ["key 'blocks.1.attn.W_K' is missing", "expected shape [2, 16, 8]"]),
    "unexpected key": (lambda s: s.update({"blocks.0.attn.W_gate": torch.zeros(HEADS, D_HEAD)}),
                       ["unexpected key 'blocks.0.attn.W_gate'", "shape [2, 8]"]),
    "wrong shape": (lambda s: s.update({"blocks.1.mlp.W_out": torch.zeros(MLP, D + 1)}),
                    ["key 'blocks.1.mlp.W_out' has shape [64, 17], expected [64, 16]"]),
    "compiled prefix": (lambda s: None, ["key 'embed.W_E' is missing", "'_orig_mod.' prefix"]),
    "training checkpoint": (lambda s: None, ["key 'embed.W_E' is missing", "training checkpoint"]),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_a_checkpoint_of_another_layout_is_refused_naming_the_key_and_shapes(tmp_path, case):
    change, said = LAYOUTS[case]
    state = make_state()
    change(state)
    if case == "compiled prefix":
        state = _prefixed(state)
    elif case == "training checkpoint":
        state = {"model": state, "model_args": {"n_layer": LAYERS}}
    source = write_release(tmp_path / "release", state)
    with pytest.raises(ConfigError) as refused:
        check_model_source("released", source)
    message = str(refused.value)
    assert all(part in message for part in said), message
    assert "models.released.source" in message and str(tmp_path / "release" / "final.pth") in message


PADDINGS = {  # (embedding rows, tokenizer size, config.json's d_vocab) -> what the refusal must say
    "fewer rows than tokens": (PADDED, 200, PADDED, "embed.W_E has 128 rows, fewer than the 200 tokens"),
    "not the padded size": (120, TOKENS, 120, "embed.W_E has 120 rows; the tokenizer"),
    "config vocabulary": (PADDED, TOKENS, 127, "config.json's d_vocab is 127, neither the checkpoint's 128"),
}


@pytest.mark.parametrize("case", list(PADDINGS))
def test_a_padding_that_does_not_match_the_tokenizer_is_refused(tmp_path, case):
    rows, tokens, config_vocab, said = PADDINGS[case]
    source = write_release(tmp_path / "release", make_state(padded=rows), loader_config(d_vocab=config_vocab))
    source["tokenizer"] = str(make_tokenizer(tmp_path / "tokenizer", tokens))
    with pytest.raises(ConfigError, match="models.released.source") as refused:
        check_model_source("released", source)
    assert said in str(refused.value), str(refused.value)
    if case == "not the padded size":
        assert "128 rows" in str(refused.value)


def test_preparation_refuses_what_the_config_check_could_not_read_and_writes_nothing(tmp_path, monkeypatch):
    """A checkpoint the torch-free reader cannot read (a hub file not downloaded yet, the legacy
    format) and a tokenizer not at hand are checked when the model is prepared, before any file."""
    from attnlab.models import prepare_model

    monkeypatch.setattr(released, "checkpoint_shapes", lambda path: None)
    monkeypatch.setattr(released, "tokenizer_rows_at_hand", lambda location: None)
    state = make_state()
    state.pop("blocks.1.attn.W_K")
    source = write_release(tmp_path / "missing", state)
    check_model_source("released", source)  # nothing at hand to refuse
    with pytest.raises(ConfigError, match=r"key 'blocks\.1\.attn\.W_K' is missing \(expected shape \[2, 16, 8\]"):
        prepare_model("released", source, tmp_path / "prepared")
    source = write_release(tmp_path / "padded", make_state(padded=120), loader_config(d_vocab=120))
    with pytest.raises(ConfigError, match="embed.W_E has 120 rows; the tokenizer"):
        prepare_model("released", source, tmp_path / "prepared")
    state = make_state()
    state["unembed.b_U"][:TOKENS] = torch.linspace(-1, 1, TOKENS)  # GPT-2 has no output bias to carry it
    source = write_release(tmp_path / "biased", state)
    with pytest.raises(ConfigError, match=r"unembed.b_U is not zero \(largest \|b_U\| 1\)"):
        prepare_model("released", source, tmp_path / "prepared")
    assert not (tmp_path / "prepared").exists()


def test_the_config_check_before_any_job_refuses_a_bad_checkpoint(tmp_path):
    config = yaml.safe_load((REPO / "tests/configs/tiny.yaml").read_text())
    source = write_release(tmp_path / "release", make_state())
    config["models"]["released"] = {"source": source, "prompt_format": "raw", "datasets": []}
    assert refusal(config, tmp_path) is None
    state = make_state()
    state["blocks.0.attn.W_Q"] = torch.zeros(HEADS, D, D_HEAD + 1)
    write_release(tmp_path / "release", state)
    message = refusal(config, tmp_path)
    assert "key 'blocks.0.attn.W_Q' has shape [2, 16, 9]: 2 heads x d_head 9 = 18, not d_model 16" in message, message


def test_the_llama_format_and_misplaced_keys_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="format circuitlab_llama is not supported.*no public code"):
        check_model_source("llama", {"hub": "ansonisl/ShortSparseLlama1B", "format": "circuitlab_llama"})
    config = yaml.safe_load((REPO / "tests/configs/tiny.yaml").read_text())
    config["models"]["x"] = {"source": {"gguf_path": "x.gguf", "format": "circuitlab_gpt2"}, "prompt_format": "raw"}
    assert "dependentSchemas.format" in refusal(config, tmp_path)  # a format reads a hub or local checkpoint
    config["models"]["x"]["source"] = {"hub": "openai-community/gpt2", "tokenizer": "gpt2"}
    assert "'format' is a required property" in refusal(config, tmp_path)


def test_paper_yaml_switches_to_the_released_gpt2_with_its_one_commented_line(tmp_path):
    """config/paper.yaml carries the released copy as one commented line under gpt2-sparse; put in
    place of the post-training source, the config passes the check that runs before any job."""
    text = (REPO / "config/paper.yaml").read_text()
    lines = [line for line in text.splitlines() if "format: circuitlab_gpt2" in line]
    assert len(lines) == 1 and lines[0].lstrip().startswith("# source:"), lines
    config = yaml.safe_load(text)
    switched = yaml.safe_load(lines[0].split("#", 1)[1])
    assert switched["source"] == {"hub": "ansonisl/SparseGPT2", "format": "circuitlab_gpt2"}
    config["models"]["gpt2-sparse"]["source"] = switched["source"]
    assert refusal(config, tmp_path) is None
