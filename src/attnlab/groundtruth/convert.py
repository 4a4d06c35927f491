"""Compiled programs, side by side, as an unmodified ``GPT2LMHeadModel`` folder.

tracr's models have no LayerNorm; GPT-2 has one before every reader of the residual. With
``layer_norm_epsilon = 2**40`` and LayerNorm weight ``2**20``, bias 0, float32 LayerNorm computes
exactly x − mean(x) (var + 2**40 rounds to 2**40 for var < 2**16; the square root is 2**20). Every
reader (``c_attn``, ``c_fc``, ``lm_head``) gets one more input row, on a residual unit nothing
writes, equal to minus the sum of its other rows: that unit holds −mean after the LayerNorm, so
the mean drops out and each reader sees x. GPT-2 divides attention scores by √head_dim where tracr
divides by √key_size: W_Q (and its bias) is scaled by √(head_dim / key_size). Conv1D's
[in, out] layout is haiku's, so nothing is transposed.

Several programs share one model block-diagonally: each keeps its own residual directions (its
token and position embeddings included), program p's heads of a layer follow program p − 1's,
the MLPs' hidden units are concatenated, and a program with fewer layers leaves the later ones
empty. ``lm_head`` reads one program's output (``readout``): another readout, the same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

LAYER_NORM_EPSILON = 2.0 ** 40
LAYER_NORM_WEIGHT = 2.0 ** 20
VALUE_WORD, ZERO_WORD = "<value>", "<zero>"  # a numerical output's readout, and a row of zeros
PAD, UNKNOWN = "<pad>", "<unk>"


@dataclass
class Layout:
    """Where each program sits in the stacked model."""

    offsets: list[int]  # first residual unit of each program
    head_offsets: list[int]  # first head of each program in every layer
    mlp_offsets: list[int]
    hidden: int  # n_embd: every program's units, the mean unit, padding to whole heads
    head_dim: int
    mean_unit: int
    n_heads: int
    n_layers: int
    n_inner: int

    @classmethod
    def of(cls, programs: list) -> "Layout":
        sizes = [len(p.labels) for p in programs]
        offsets = [int(x) for x in np.cumsum([0] + sizes[:-1])]
        head_offsets = [int(x) for x in np.cumsum([0] + [p.heads for p in programs][:-1])]
        mlp_offsets = [int(x) for x in np.cumsum([0] + [p.mlp_hidden for p in programs][:-1])]
        n_heads, needed = sum(p.heads for p in programs), sum(sizes) + 1
        head_dim = max(max(p.key_size for p in programs), math.ceil(needed / n_heads))
        return cls(offsets, head_offsets, mlp_offsets, n_heads * head_dim, head_dim, sum(sizes), n_heads,
                   max(p.n_layers for p in programs), sum(p.mlp_hidden for p in programs))


def vocabulary(programs: list, bos: str) -> list[str]:
    """BOS, the input tokens, every program's output words, the numerical readout and zero
    words, padding and unknown: one vocabulary for every readout of a stack."""
    inputs = sorted(t for t in programs[0].token_ids if t not in (bos, "compiler_pad"))
    outputs = sorted({str(v) for p in programs for v in p.output_values if v is not None} - set(inputs))
    return [bos, *inputs, *outputs, VALUE_WORD, ZERO_WORD, PAD, UNKNOWN]


def output_words(program) -> list[str]:
    """The word each output direction of ``program`` is read as."""
    return [VALUE_WORD] if program.output_values == [None] else [str(v) for v in program.output_values]


def _mean_free(weight: np.ndarray, layout: Layout) -> np.ndarray:
    """A reader's [hidden, out] weight with the mean unit's row = −(sum of the others)."""
    weight = weight.copy()
    weight[layout.mean_unit] = -weight.sum(axis=0)
    return weight


def state_dict(programs: list, readout: int, words: list[str], bos: str) -> tuple[dict, Layout]:
    """GPT2LMHeadModel's weights (float64 numpy) for ``programs`` side by side, reading program
    ``readout``'s output."""
    layout = Layout.of(programs)
    hidden, weights = layout.hidden, {}
    word_ids = {word: i for i, word in enumerate(words)}
    wte, wpe = np.zeros((len(words), hidden)), np.zeros((programs[0].params["pos_embed"].shape[0], hidden))
    for p, program in enumerate(programs):
        units = slice(layout.offsets[p], layout.offsets[p] + len(program.labels))
        for token, tracr_id in program.token_ids.items():
            if token in word_ids:
                wte[word_ids[token], units] = program.params["token_embed"][tracr_id]
        wpe[:, units] = program.params["pos_embed"]
    weights["transformer.wte.weight"], weights["transformer.wpe.weight"] = wte, wpe
    for layer in range(layout.n_layers):
        weights.update(_layer(programs, layout, layer))
    weights["transformer.ln_f.weight"], weights["transformer.ln_f.bias"] = _norm(hidden)
    weights["lm_head.weight"] = _unembedding(programs[readout], layout.offsets[readout], layout, word_ids)
    return weights, layout


def _norm(hidden: int) -> tuple[np.ndarray, np.ndarray]:
    return np.full(hidden, LAYER_NORM_WEIGHT), np.zeros(hidden)


def _layer(programs: list, layout: Layout, layer: int) -> dict:
    hidden, dim, prefix = layout.hidden, layout.head_dim, f"transformer.h.{layer}."
    attn, attn_bias = np.zeros((hidden, 3 * hidden)), np.zeros(3 * hidden)
    proj, proj_bias = np.zeros((hidden, hidden)), np.zeros(hidden)
    fc, fc_bias = np.zeros((hidden, layout.n_inner)), np.zeros(layout.n_inner)
    out, out_bias = np.zeros((layout.n_inner, hidden)), np.zeros(hidden)
    for p, program in enumerate(programs):
        if layer >= program.n_layers:
            continue  # this program's model ends earlier: its part of the layer stays empty
        units = slice(layout.offsets[p], layout.offsets[p] + len(program.labels))
        size, scale = program.key_size, math.sqrt(dim / program.key_size)
        for head in range(program.heads):
            slot = (layout.head_offsets[p] + head) * dim
            within = slice(head * size, (head + 1) * size)
            for part, (name, factor) in enumerate((("query", scale), ("key", 1.0), ("value", 1.0))):
                columns = slice(part * hidden + slot, part * hidden + slot + size)
                attn[units, columns] = program.params[f"layer_{layer}/attn/{name}/w"][:, within] * factor
                attn_bias[columns] = program.params[f"layer_{layer}/attn/{name}/b"][within] * factor
            proj[slot:slot + size, units] = program.params[f"layer_{layer}/attn/linear/w"][within]
        proj_bias[units] += program.params[f"layer_{layer}/attn/linear/b"]
        inner = slice(layout.mlp_offsets[p], layout.mlp_offsets[p] + program.mlp_hidden)
        fc[units, inner] = program.params[f"layer_{layer}/mlp/linear_1/w"]
        fc_bias[inner] = program.params[f"layer_{layer}/mlp/linear_1/b"]
        out[inner, units] = program.params[f"layer_{layer}/mlp/linear_2/w"]
        out_bias[units] += program.params[f"layer_{layer}/mlp/linear_2/b"]
    (ln1, ln1_bias), (ln2, ln2_bias) = _norm(hidden), _norm(hidden)
    return {prefix + "ln_1.weight": ln1, prefix + "ln_1.bias": ln1_bias,
            prefix + "attn.c_attn.weight": _mean_free(attn, layout), prefix + "attn.c_attn.bias": attn_bias,
            prefix + "attn.c_proj.weight": proj, prefix + "attn.c_proj.bias": proj_bias,
            prefix + "ln_2.weight": ln2, prefix + "ln_2.bias": ln2_bias,
            prefix + "mlp.c_fc.weight": _mean_free(fc, layout), prefix + "mlp.c_fc.bias": fc_bias,
            prefix + "mlp.c_proj.weight": out, prefix + "mlp.c_proj.bias": out_bias}


def _unembedding(program, offset: int, layout: Layout, word_ids: dict[str, int]) -> np.ndarray:
    """lm_head's [vocab, hidden] weight: each output word reads its output direction."""
    reads = np.zeros((layout.hidden, len(word_ids)))
    for label, word in zip(program.output_labels, output_words(program)):
        reads[offset + program.labels.index(label), word_ids[word]] = 1.0
    return _mean_free(reads, layout).T


def gpt2_config(layout: Layout, words: list[str], positions: int, bos: str) -> dict:
    """GPT2Config's fields for the stacked model (dropout off, ReLU as tracr's MLPs, untied)."""
    return {"vocab_size": len(words), "n_positions": positions, "n_embd": layout.hidden,
            "n_layer": layout.n_layers, "n_head": layout.n_heads, "n_inner": layout.n_inner,
            "activation_function": "relu", "layer_norm_epsilon": LAYER_NORM_EPSILON,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": False,
            "bos_token_id": words.index(bos), "eos_token_id": words.index(bos),
            "pad_token_id": words.index(PAD)}


def word_tokenizer(words: list[str], bos: str):
    """A word-level fast tokenizer over ``words``: whitespace-split words, BOS first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token=UNKNOWN))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, words.index(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=bos, pad_token=PAD,
                                   unk_token=UNKNOWN)
