"""The attention function of attnlab, registered with transformers' attention interface under
``IMPLEMENTATION`` ("attnlab") when this module is imported: every loader of the library
(``models.load_model``) and ``attnlab.interventions`` import it, so a sparse copy never needs an
import of its own before it loads.

Per block of queries it takes the scores, applies a sparse model's edge gates and reduces the
weights; what it does comes from the model's config (a sparse model always gates) and from one
context variable (``Inside``), which ``interventions.intervened`` sets on entry and resets on
exit. On GPUs it hands each layer to the fused Triton kernels (``attnlab.attention.fused``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import repeat_kv

from attnlab.attention import fused, sparse
from attnlab.attention.reduction import BatchReduction, LayerStats

IMPLEMENTATION = sparse.IMPLEMENTATION  # the name this module registers its attention function under


@dataclasses.dataclass(frozen=True, eq=False)
class Inside:
    """What the attention function does besides attending, for the block under way."""

    gates: sparse.GateTracker | None = None
    gate_bias: sparse.GateBias | None = None
    reduce: BatchReduction | None = None

    def bias(self, module: nn.Module) -> float | None:
        """The gate bias of this module's layer: the block's, else the model's own (None: dense)."""
        if self.gate_bias is not None:
            return sparse.layer_bias(self.gate_bias, module.layer_idx)
        return sparse.gate_bias(module)


_inside: contextvars.ContextVar[Inside] = contextvars.ContextVar("attnlab_intervention", default=Inside())


def current() -> Inside:
    return _inside.get()


def recompute_context():
    """``context_fn`` for activation checkpointing (torch.utils.checkpoint, non-reentrant): the
    recomputation of a layer in the backward pass, which runs on an autograd worker thread on
    GPUs where the caller's context variables are not visible, sees its forward pass's parts."""
    forward = _inside.get()

    @contextlib.contextmanager
    def as_in_forward():
        token = _inside.set(forward)
        try:
            yield
        finally:
            _inside.reset(token)

    return contextlib.nullcontext(), as_in_forward()


# Attention arguments that change the result and that this function does not implement:
# attention sinks (gpt-oss: s_aux, sinks) and additive position biases. A call that sets one fails.
UNIMPLEMENTED_KWARGS = ("s_aux", "sinks", "position_bias")


def refuse_unimplemented(dropout: float, kwargs: dict) -> None:
    """Fail, naming the argument, rather than compute attention the model does not use."""
    given = [name for name in UNIMPLEMENTED_KWARGS if kwargs.get(name) is not None]
    if given:
        raise NotImplementedError(
            f"{IMPLEMENTATION} attention does not implement {given} (attention sinks or position "
            "biases), which this model uses; its attention cannot be reduced or gated here")
    if dropout:
        raise NotImplementedError(f"{IMPLEMENTATION} attention does not implement attention dropout "
                                  f"({dropout}); set the model config's attention dropout field to 0 "
                                  "(attention_dropout; GPT-2: attn_pdrop), or call model.eval()")


def attend(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
           softcap: float | None = None, **kwargs):
    """Eager attention (grouped-query heads repeated as eager does), with a sparse model's edge
    gates (``sparse``) and, inside ``intervened(reduce=...)``, the reduction (``attention``).

    Without a reduction, one block: every query at once, with or without a KV cache. With one,
    query rows [q0, q1) only see keys [0, q1) (causal), so each block skips the masked upper
    triangle and stays small enough to remain in cache while it is softmaxed, multiplied with
    the values and reduced; the result equals the one-block computation.
    """
    inside = _inside.get()
    refuse_unimplemented(dropout, kwargs)
    bias = inside.bias(module)
    if inside.reduce is not None:
        _check_reducible(query, key, attention_mask)
    elif bias is None:
        raise RuntimeError(f"{IMPLEMENTATION} attention on a dense model outside intervened(reduce=...): "
                           "load sparse models with attnlab.models.load_model")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    output = fused.attend(module, query, key, value, attention_mask, scaling, softcap, bias, inside.gates,
                          inside.reduce, kwargs.get("sliding_window"))
    if output is not None:  # the kernels took the layer (on GPUs: attnlab.attention.fused)
        return output, None
    groups = query.shape[1] // key.shape[1]  # grouped-query attention: query heads per key/value head
    key = repeat_kv(key, groups)
    value = repeat_kv(value, groups)
    batch, heads, length, _ = query.shape
    stats = None
    if inside.reduce is not None:
        stats = LayerStats(inside.reduce, module.layer_idx, batch, heads, length, query.device,
                           gated=bias is not None)
    block = _Block(module.layer_idx, scaling, softcap, bias, inside.gates, key.shape[-2] - length)
    rows = _rows_per_block(query, key.shape[-2]) if stats is not None else length
    if rows >= length:
        output, weights = block(query, key, value, attention_mask, 0, length, stats)
    else:
        output, weights = torch.empty_like(query), None
        for q0 in range(0, length, rows):
            q1 = min(q0 + rows, length)
            output[:, :, q0:q1], _ = block(query, key, value, attention_mask, q0, q1, stats)
    if stats is not None:
        stats.finish()
    return output.transpose(1, 2).contiguous(), weights


def _check_reducible(query, key, attention_mask) -> None:
    if query.shape[-2] != key.shape[-2]:
        raise RuntimeError(f"the attention reduction needs the whole sequence at once (queries "
                           f"{query.shape[-2]}, keys {key.shape[-2]}): call the model with use_cache=False")
    if attention_mask is None:
        # The blocks take causality (and any sliding window) from the mask alone.
        raise RuntimeError("the attention reduction needs the model's attention mask (causal, sliding "
                           "window, padding); the model passed none")


# Score block size: small enough to stay in cache on CPUs; on GPUs large, so that a long
# prompt is a few big launches rather than many tiny ones.
BLOCK_BYTES = {"cpu": 4 * 2**20, "cuda": 256 * 2**20}


def _rows_per_block(query: torch.Tensor, keys: int) -> int:
    block_bytes = BLOCK_BYTES.get(query.device.type, BLOCK_BYTES["cpu"])
    batch, heads = query.shape[:2]
    return max(16, block_bytes // (4 * batch * heads * keys))


@dataclasses.dataclass
class _Block:
    """Attention of query rows [q0, q1) of one layer; ``offset``: the cached keys before the queries."""

    layer: int
    scaling: float
    softcap: float | None
    bias: float | None
    tracker: sparse.GateTracker | None
    offset: int

    def __call__(self, query, key, value, attention_mask, q0: int, q1: int, stats: LayerStats | None):
        keys = self.offset + q1  # later keys are causally masked for every query of the block
        logits = torch.matmul(query[:, :, q0:q1], key[:, :, :keys].transpose(2, 3)) * self.scaling
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        mask = None if attention_mask is None else attention_mask[:, :, q0:q1, :keys]
        allowed = None  # [batch or 1, 1, q, k] bool, computed only where it is needed
        if mask is None or self.tracker is not None:
            allowed = sparse.allowed_edges(mask, q1 - q0, keys, query.device)
        if mask is None:  # no mask given: causal
            scores = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
        else:
            scores = logits + mask
        # float32 at least (as eager attention), float64 kept: a float64 mask's minimum becomes
        # -inf in float32, a fully masked (padding) row NaN, and 0 · NaN reaches real tokens
        weights = nn.functional.softmax(scores, dim=-1, dtype=torch.promote_types(query.dtype, torch.float32))
        weights = weights.to(query.dtype)
        if self.bias is not None:
            weights = weights * self._gate(logits, allowed)
        if stats is not None:
            stats.add_block(weights, q0, q1)
        return torch.matmul(weights, value[:, :, :keys]), weights

    def _gate(self, logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        tracker = self.tracker
        if tracker is not None and tracker.training:
            return sparse.training_gate(tracker, self.layer, logits, self.bias, allowed)
        gate = sparse.deterministic_gate(logits, self.bias)
        if tracker is not None:
            near = logits.float() + self.bias if tracker.near_threshold is not None else None  # a diagnostic's
            sparse.count_open_edges(tracker, self.layer, gate, allowed, near)
        return gate


AttentionInterface.register(IMPLEMENTATION, attend)
AttentionMaskInterface.register(IMPLEMENTATION, eager_mask)
