"""attnlab.groundtruth.convert without tracr: two made-up compiled programs (random weights of
tracr's shapes, one categorical, one numerical, of different depths, head counts and key sizes),
side by side in one GPT2LMHeadModel, read at each program's output in turn, against tracr's
forward pass written here in float64 numpy (no LayerNorm, attention scaled by √key_size, causal,
ReLU MLPs, residual adds)."""

import numpy as np
import pytest
import torch

from attnlab.groundtruth.compiled import Compiled
from attnlab.groundtruth.convert import gpt2_config, output_words, state_dict, vocabulary, word_tokenizer

BOS = "BOS"
TOKEN_IDS = {BOS: 0, "a": 1, "b": 2, "c": 3, "compiler_pad": 4}
POSITIONS = 6  # BOS and five tokens


def _program(name: str, rng, labels: list[str], n_layers: int, heads: int, key_size: int, mlp_hidden: int,
             output_labels: list[str], output_values: list) -> Compiled:
    width, inner = len(labels), heads * key_size
    params = {"token_embed": rng.normal(0, 0.5, (len(TOKEN_IDS), width)),
              "pos_embed": rng.normal(0, 0.5, (POSITIONS, width))}
    for layer in range(n_layers):
        for part in ("query", "key", "value"):
            params[f"layer_{layer}/attn/{part}/w"] = rng.normal(0, 0.5, (width, inner))
            params[f"layer_{layer}/attn/{part}/b"] = rng.normal(0, 0.1, inner)
        params[f"layer_{layer}/attn/linear/w"] = rng.normal(0, 0.5, (inner, width))
        params[f"layer_{layer}/attn/linear/b"] = rng.normal(0, 0.1, width)
        params[f"layer_{layer}/mlp/linear_1/w"] = rng.normal(0, 0.5, (width, mlp_hidden))
        params[f"layer_{layer}/mlp/linear_1/b"] = rng.normal(0, 0.1, mlp_hidden)
        params[f"layer_{layer}/mlp/linear_2/w"] = rng.normal(0, 0.5, (mlp_hidden, width))
        params[f"layer_{layer}/mlp/linear_2/b"] = rng.normal(0, 0.1, width)
    return Compiled(name, params, labels, n_layers, heads, key_size, mlp_hidden, TOKEN_IDS, output_labels,
                    output_values, program={}, blocks={}, reference={})


def _tracr_forward(program: Compiled, ids: np.ndarray) -> np.ndarray:
    """[batch, positions, outputs]: the residual at the output directions after every layer."""
    p, length = program.params, ids.shape[1]
    x = p["token_embed"][ids] + p["pos_embed"][:length]
    causal = np.tril(np.ones((length, length), dtype=bool))
    size = program.key_size
    for layer in range(program.n_layers):
        q, k, v = (x @ p[f"layer_{layer}/attn/{part}/w"] + p[f"layer_{layer}/attn/{part}/b"]
                   for part in ("query", "key", "value"))
        heads = []
        for head in range(program.heads):
            cut = slice(head * size, (head + 1) * size)
            scores = q[..., cut] @ k[..., cut].transpose(0, 2, 1) / np.sqrt(size)
            scores = np.where(causal, scores, -np.inf)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            heads.append((weights / weights.sum(-1, keepdims=True)) @ v[..., cut])
        x = x + np.concatenate(heads, -1) @ p[f"layer_{layer}/attn/linear/w"] + p[f"layer_{layer}/attn/linear/b"]
        hidden = np.maximum(x @ p[f"layer_{layer}/mlp/linear_1/w"] + p[f"layer_{layer}/mlp/linear_1/b"], 0)
        x = x + hidden @ p[f"layer_{layer}/mlp/linear_2/w"] + p[f"layer_{layer}/mlp/linear_2/b"]
    return x[..., [program.labels.index(label) for label in program.output_labels]]


def _programs() -> list[Compiled]:
    rng = np.random.default_rng(0)
    categorical = _program("two_layers", rng, ["one", "tokens:a", "tokens:b", "tokens:c", "out:x", "out:y"],
                           n_layers=2, heads=1, key_size=3, mlp_hidden=4, output_labels=["out:x", "out:y"],
                           output_values=["x", "y"])
    numerical = _program("one_layer", rng, ["one", "tokens:a", "tokens:b", "count", "frac"], n_layers=1, heads=2,
                         key_size=2, mlp_hidden=3, output_labels=["frac"], output_values=[None])
    return [categorical, numerical]


@pytest.mark.parametrize("readout", [0, 1])
def test_the_stacked_model_computes_each_programs_tracr_forward(readout):
    from transformers import GPT2Config, GPT2LMHeadModel

    programs = _programs()
    words = vocabulary(programs, BOS)
    weights, layout = state_dict(programs, readout, words, BOS)
    assert layout.head_dim == 4 > max(p.key_size for p in programs)  # the √(head_dim/key_size) rescaling is used
    model = GPT2LMHeadModel(GPT2Config(**gpt2_config(layout, words, POSITIONS, BOS)))
    model.load_state_dict({key: torch.tensor(value, dtype=torch.float32) for key, value in weights.items()},
                          strict=False)
    model.eval()
    rng = np.random.default_rng(1)
    inputs = [[str(t) for t in rng.choice(["a", "b", "c"], POSITIONS - 1)] for _ in range(8)]
    ids = word_tokenizer(words, BOS)([" ".join(tokens) for tokens in inputs], return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits.double().numpy()
    read = programs[readout]
    tracr_ids = np.array([[TOKEN_IDS[BOS]] + [TOKEN_IDS[t] for t in tokens] for tokens in inputs])
    want = _tracr_forward(read, tracr_ids)
    got = logits[:, :, [words.index(word) for word in output_words(read)]]
    assert np.abs(want).max() > 1.0  # outputs large enough that a dropped term shows
    assert got == pytest.approx(want, abs=1e-4)
