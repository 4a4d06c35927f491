"""A released sparse model (arXiv 2512.05865's checkpoints, ``format: circuitlab_gpt2``) converted
into a transformers GPT-2 that carries attnlab's edge gate at the released models' evaluation rule.

The checkpoint is a TransformerLens state dict as CircuitLab's loader reads it
(``attnlab.config.released`` holds the layout, its checks and where the code was read). Each of its
weights goes to the GPT-2 parameter that computes the same thing; the embedding and unembedding
lose their padded rows (50,304 -> the tokenizer's 50,257), and only those: the rows kept are
compared with the checkpoint's first rows, and every tokenizer id must fall among them. The model
is then marked sparse with gate bias 0 (or the source's ``gate_bias``): the gated attention keeps an
edge exactly when q·k/√d_head + b > 0, the loader's ``scores > 0`` at b = 0, on the softmax over every
causal key, not renormalised. ``models.prepare_model`` saves it like any shared sparse copy, so
every later stage loads it gated.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel
from transformers.initialization import no_init_weights

import attnlab.attention.function  # noqa: F401 -- registers the gated attention make_sparse selects
from attnlab import anatomy
from attnlab.attention import sparse
from attnlab.config import released as layout
from attnlab.config.released import Dims, ReleasedModelError, Settings

log = logging.getLogger(__name__)


def fetch_files(name: str, source: dict) -> tuple[Path, Path]:
    """(checkpoint, config.json): a local source's, or downloaded from the hub as the loader does
    (the repository's one file ending in final.pth, and its config.json)."""
    if "local" in source:
        return layout.files_at_hand(name, source)
    from huggingface_hub import HfApi, hf_hub_download

    repo, revision = source["hub"], source.get("revision")
    found = [f for f in HfApi().list_repo_files(repo, revision=revision) if f.endswith(layout.CHECKPOINT)]
    if len(found) != 1:
        raise ReleasedModelError(f"models.{name}.source: the hub repository {repo} holds {found or 'no file'} ending "
                                 f"in {layout.CHECKPOINT}, not one: download the one you mean and give it as "
                                 "`local:` (with its config.json beside it)")
    checkpoint = hf_hub_download(repo, found[0], revision=revision)
    return Path(checkpoint), Path(hf_hub_download(repo, layout.CONFIG, revision=revision))


def load_state(path: Path, where: str) -> dict[str, torch.Tensor]:
    """The checkpoint's mapping, loaded without running any of its code (weights only)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 -- any unreadable file: say which and what torch said
        raise ReleasedModelError(f"{where}: torch.load (weights only) cannot read it ({type(error).__name__}: "
                                 f"{error}). {layout.LAYOUT_FIX}") from error
    if not isinstance(state, dict):
        raise ReleasedModelError(f"{where}: holds a {type(state).__name__}, not a state dict. {layout.LAYOUT_FIX}")
    return state


def load_released(name: str, source: dict):
    """(model, tokenizer) of a released model's source, every check of ``config.released`` made on
    the loaded tensors and the tokenizer before anything is written."""
    checkpoint, config_file = fetch_files(name, source)
    where = layout.where(name, checkpoint)
    state = load_state(checkpoint, where)
    dims = layout.check_layout({key: tuple(value.shape) if torch.is_tensor(value) else None
                                for key, value in state.items()}, where)
    settings = layout.read_settings(json.loads(config_file.read_text()), dims, layout.where(name, config_file))
    location = layout.tokenizer_location(source, settings)
    tokenizer = AutoTokenizer.from_pretrained(location)
    vocab = layout.tokenizer_rows(tokenizer.get_vocab().values())
    layout.check_padding(dims, vocab, settings, where, location)
    _check_no_unembedding_bias(state["unembed.b_U"], vocab, where)
    model = gpt2(dims, settings, vocab, tokenizer, state)
    verify_cut(model, state, vocab, where)
    if settings.gated:
        gate_bias = float(source.get("gate_bias", 0.0))
        sparse.make_sparse(model, gate_bias, released=source.get("hub") or str(checkpoint), format=source["format"],
                           evaluation_rule="edge open when q·k/sqrt(d_head) + gate_bias > 0 (CircuitLab: scores > 0)")
    log.info("%s: %d layers x %d heads, %d embedding rows cut to the tokenizer's %d, %s", name, dims.n_layers,
             dims.heads, dims.padded_vocab, vocab, "gated" if settings.gated else "dense (use_sparse_attn: false)")
    return model, tokenizer


def _check_no_unembedding_bias(bias: torch.Tensor, vocab: int, where: str) -> None:
    """transformers' GPT-2 has no output bias: a nonzero unembed.b_U cannot be carried over."""
    largest = float(bias[:vocab].abs().max())
    if largest != 0.0:
        raise ReleasedModelError(f"{where}: unembed.b_U is not zero (largest |b_U| {largest:.3g}); transformers' "
                                 "GPT-2 has no output bias, so the converted model would give other logits. "
                                 "Not supported: docs/sparsify.md, 'The released sparse models'")


def gpt2(dims: Dims, settings: Settings, vocab: int, tokenizer, state: dict) -> GPT2LMHeadModel:
    """A GPT-2 of the checkpoint's dimensions (dropout off: the checkpoint has none) holding its
    weights; the output embedding tied where the checkpoint's equals the input one."""
    kept = gpt2_state(state, dims, vocab)
    tied = torch.equal(kept["lm_head.weight"], kept["transformer.wte.weight"])
    config = GPT2Config(vocab_size=vocab, n_positions=dims.n_ctx, n_embd=dims.d_model, n_layer=dims.n_layers,
                        n_head=dims.heads, n_inner=dims.d_mlp, activation_function=settings.activation,
                        layer_norm_epsilon=settings.eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        tie_word_embeddings=tied)
    with no_init_weights():  # every weight is overwritten (strict) below: none drawn at random first
        model = GPT2LMHeadModel(config).to(state["embed.W_E"].dtype)
    model.tie_weights()
    model.load_state_dict(kept, strict=True)
    return model.eval()


def kept_rows(rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """The rows of a [padded vocabulary, ...] tensor that the tokenizer's ids address: the padding
    rows come after them."""
    return rows[:vocab]


def gpt2_state(state: dict, dims: Dims, vocab: int) -> dict[str, torch.Tensor]:
    """The checkpoint's weights under transformers' GPT-2 parameter names (its saved layout, as the
    compiled programs' conversion writes it: groundtruth/convert.py). GPT-2's Conv1D stores
    [in, out]; its fused c_attn holds every query head, then every key head, then every value head."""
    d = dims.d_model
    out = {"transformer.wte.weight": kept_rows(state["embed.W_E"], vocab),
           "transformer.wpe.weight": state["pos_embed.W_pos"],
           "transformer.ln_f.weight": state["ln_final.w"], "transformer.ln_f.bias": state["ln_final.b"],
           "lm_head.weight": kept_rows(state["unembed.W_U"].t(), vocab)}
    for layer in range(dims.n_layers):
        tl, hf = f"blocks.{layer}.", f"transformer.h.{layer}."
        # [heads, d_model, d_head] -> [d_model, heads · d_head], head h in columns h·d_head ...
        columns = [state[f"{tl}attn.W_{x}"].permute(1, 0, 2).reshape(d, -1) for x in "QKV"]
        out.update({
            hf + "ln_1.weight": state[tl + "ln1.w"], hf + "ln_1.bias": state[tl + "ln1.b"],
            hf + "attn.c_attn.weight": torch.cat(columns, dim=1),
            hf + "attn.c_attn.bias": torch.cat([state[f"{tl}attn.b_{x}"].reshape(-1) for x in "QKV"]),
            hf + "attn.c_proj.weight": state[tl + "attn.W_O"].reshape(-1, d), hf + "attn.c_proj.bias": state[tl + "attn.b_O"],
            hf + "ln_2.weight": state[tl + "ln2.w"], hf + "ln_2.bias": state[tl + "ln2.b"],
            hf + "mlp.c_fc.weight": state[tl + "mlp.W_in"], hf + "mlp.c_fc.bias": state[tl + "mlp.b_in"],
            hf + "mlp.c_proj.weight": state[tl + "mlp.W_out"], hf + "mlp.c_proj.bias": state[tl + "mlp.b_out"]})
    return {key: value.contiguous() for key, value in out.items()}


def verify_cut(model, state: dict, vocab: int, where: str) -> None:
    """Only padding was cut: every token id of the tokenizer has a row (ids 0 .. vocab − 1), and the
    model's embedding and unembedding rows are the checkpoint's rows of those ids, by index."""
    ids = torch.arange(vocab)
    parts = anatomy.of(model)
    pairs = ((parts.input_embeddings.weight, state["embed.W_E"].index_select(0, ids), "embed.W_E"),
             (parts.output_embeddings.weight, state["unembed.W_U"].index_select(1, ids).t(), "unembed.W_U"))
    for kept, expected, key in pairs:
        if kept.shape != expected.shape or not torch.equal(kept, expected):
            raise ReleasedModelError(f"{where}: the converted {key} is not the checkpoint's rows 0..{vocab - 1}: "
                                     "the conversion cut other rows than the padding (a bug: please report it)")
