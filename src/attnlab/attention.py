"""Per-head attention statistics, reduced inside the attention computation.

For every layer and head and every prompt we keep, without ever holding more
than one layer's attention matrix:

- ``received[j]``: the attention key position ``j`` receives from later
  tokens, ``mean over i > j of A[i, j]`` (A = post-softmax attention of that
  head; causal and sliding-window masks applied as the model applies them;
  the mean is over all later positions, so a key outside a query's window
  contributes a zero). Undefined (NaN) at the last position.
- ``lam[i]`` (λ): the attention mass query ``i`` puts on the original,
  non-inserted keys (``1 - sum over inserted j of A[i, j]`` for a dense model);
  exactly 1 when nothing is inserted into a dense model.

The reduction runs in an attention function registered through transformers'
attention interface, so it works for every architecture that dispatches
through it (Llama/SmolLM2, Qwen2, Gemma-3 with its sliding windows) and
handles grouped-query attention by repeating key/value heads as eager does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import repeat_kv

from attnlab.sparse import deterministic_gate, gate_bias, refuse_unimplemented

IMPLEMENTATION = "attnlab_reduce"
METRIC_DEFINITION = (
    "received[layer][head, prompt, j] = mean over i > j of A[i, j], A = post-softmax attention "
    "(causal and sliding-window masks applied), NaN at the last position and on padding; "
    "lam[layer][head, prompt, i] = sum over original (non-inserted) keys j of A[i, j] "
    "(= 1 - inserted mass for dense models); for a sparse model A is its gated weights "
    "softmax(s)_ij * 1[s_ij + b > 0], not renormalised"
)


@dataclass
class BatchReduction:
    """Where the attention function leaves its per-layer results for one batch."""

    real_tokens: torch.Tensor  # [batch, positions] bool: False on left padding
    inserted_keys: torch.Tensor  # [batch, positions] bool: the inserted span
    received: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [batch, heads, keys]
    lam: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [batch, heads, queries]
    map_layers: tuple[int, ...] = ()  # layers whose full maps are kept
    maps: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [batch, heads, q, k]


_active: BatchReduction | None = None


# Score block size: small enough to stay in cache on CPUs; on GPUs large, so that a long
# prompt is a few big launches rather than many tiny ones.
BLOCK_BYTES = {"cpu": 4 * 2**20, "cuda": 256 * 2**20}


def reducing_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask: torch.Tensor | None,
                       scaling: float | None = None, dropout: float = 0.0,
                       softcap: float | None = None, **kwargs):
    """Eager attention computed in blocks of queries, reducing as it goes.

    Query rows [q0, q1) only see keys [0, q1) (causal), so each block skips
    the masked upper triangle and stays small enough to remain in cache while
    it is softmaxed, multiplied with the values and reduced. The result equals
    eager attention; with ``_active`` set, this layer's statistics are kept.
    A sparse model's edge gates (``attnlab.sparse``) are applied to the
    weights, so its statistics come from the gated maps.
    """
    if query.shape[-2] != key.shape[-2]:
        raise RuntimeError(f"{IMPLEMENTATION} needs the whole sequence at once (queries "
                           f"{query.shape[-2]}, keys {key.shape[-2]}): call it with use_cache=False")
    if attention_mask is None:
        # The blocks take causality (and any sliding window) from the mask alone.
        raise RuntimeError(f"{IMPLEMENTATION} needs the model's attention mask (causal, sliding "
                           "window, padding); the model passed none")
    refuse_unimplemented(IMPLEMENTATION, dropout, kwargs)
    bias = gate_bias(module)
    if scaling is None:
        scaling = module.head_dim ** -0.5
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    batch, heads, length, _ = query.shape
    stats = None if _active is None else _LayerStats(_active, module.layer_idx, batch, heads, length,
                                                     query.device, gated=bias is not None)
    block_bytes = BLOCK_BYTES.get(query.device.type, BLOCK_BYTES["cpu"])
    rows_per_block = max(16, block_bytes // (4 * batch * heads * length))
    output = torch.empty_like(query)
    for q0 in range(0, length, rows_per_block):
        q1 = min(q0 + rows_per_block, length)
        # Keys from q1 on are causally masked for every query of this block.
        scores = torch.matmul(query[:, :, q0:q1], key[:, :, :q1].transpose(2, 3)) * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        gate = None if bias is None else deterministic_gate(scores, bias)
        scores += attention_mask[:, :, q0:q1, :q1]
        weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        if gate is not None:
            weights *= gate
        output[:, :, q0:q1] = torch.matmul(weights, value[:, :, :q1])
        if stats is not None:
            stats.add_block(weights, q0, q1)
    if stats is not None:
        stats.finish()
    return output.transpose(1, 2).contiguous(), None


class _LayerStats:
    """One layer's reductions, accumulated block by block with two small matmuls each."""

    def __init__(self, into: BatchReduction, layer: int, batch: int, heads: int, length: int, device,
                 gated: bool = False):
        self.into, self.layer, self.gated = into, layer, gated
        self.real_rows = into.real_tokens[:, None, None, :].float()
        self.inserted = into.inserted_keys[:, None, :, None].float()
        self.column_sums = torch.zeros(batch, heads, length, device=device)
        self.diagonal = torch.zeros(batch, heads, length, device=device)
        self.lam = torch.empty(batch, heads, length, device=device)
        self.map = (torch.zeros(batch, heads, length, length, device=device)
                    if layer in into.map_layers else None)

    def add_block(self, weights: torch.Tensor, q0: int, q1: int) -> None:
        weights = weights.float()
        # For a real query i, A[i, j] = 0 when j > i, so summing real rows gives
        # the diagonal plus everything strictly below it. Padding rows are left out.
        self.column_sums[..., :q1] += torch.matmul(self.real_rows[..., q0:q1], weights)[:, :, 0]
        self.diagonal[..., q0:q1] = weights.diagonal(offset=q0, dim1=-2, dim2=-1)
        # Mass on the original keys: 1 − inserted mass for a dense model (exactly 1 with
        # nothing inserted); a sparse model's gated rows need not sum to 1: take the row sum.
        total = weights.sum(-1) if self.gated else 1.0
        self.lam[..., q0:q1] = total - torch.matmul(weights, self.inserted[:, :, :q1])[..., 0]
        if self.map is not None:
            self.map[:, :, q0:q1, :q1] = weights

    def finish(self) -> None:
        length = self.column_sums.shape[-1]
        later = torch.arange(length - 1, -1, -1, device=self.column_sums.device, dtype=torch.float32)
        received = (self.column_sums - self.diagonal) / later
        received[..., -1] = float("nan")
        self.into.received[self.layer] = received.cpu()
        self.into.lam[self.layer] = self.lam.cpu()
        if self.map is not None:
            self.into.maps[self.layer] = self.map.half().cpu()


AttentionInterface.register(IMPLEMENTATION, reducing_attention)
AttentionMaskInterface.register(IMPLEMENTATION, eager_mask)


@contextlib.contextmanager
def reducing(model, real_tokens: torch.Tensor, inserted_keys: torch.Tensor,
             map_layers: list[int] = ()):
    """Run ``model`` with the reducing attention; yield the batch's results."""
    global _active
    previous = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATION)
    _active = BatchReduction(real_tokens, inserted_keys, map_layers=tuple(map_layers))
    try:
        yield _active
    finally:
        _active = None
        model.set_attn_implementation(previous)
