"""Per-head attention statistics, reduced inside the attention computation.

For every layer and head and every prompt we keep, without ever holding more
than one layer's attention matrix:

- ``received[j]``: the attention key position ``j`` receives from later
  tokens, ``mean over i > j of A[i, j]`` (A = post-softmax attention of that
  head; causal and sliding-window masks applied as the model applies them;
  the mean is over all later positions, so a key outside a query's window
  contributes a zero). Undefined (NaN) at the last position.
- ``lam[i]`` (λ): the attention mass query ``i`` puts on the original,
  non-inserted keys, ``1 - sum over inserted j of A[i, j]``; exactly 1 when
  nothing is inserted.

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

IMPLEMENTATION = "attnlab_reduce"
METRIC_DEFINITION = (
    "received[layer][head, prompt, j] = mean over i > j of A[i, j], A = post-softmax attention "
    "(causal and sliding-window masks applied), NaN at the last position and on padding; "
    "lam[layer][head, prompt, i] = 1 - sum over inserted keys j of A[i, j]"
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


def _repeat_kv(states: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return states
    batch, kv_heads, length, dim = states.shape
    return states[:, :, None].expand(batch, kv_heads, groups, length, dim).reshape(
        batch, kv_heads * groups, length, dim)


def reducing_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask: torch.Tensor | None,
                       scaling: float | None = None, dropout: float = 0.0,
                       softcap: float | None = None, **kwargs):
    """Eager attention that also records this layer's reductions in ``_active``."""
    if scaling is None:
        scaling = module.head_dim ** -0.5
    key = _repeat_kv(key, module.num_key_value_groups)
    value = _repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()
    if _active is not None:
        _reduce(module.layer_idx, weights, _active)
    return output, None


def _reduce(layer: int, weights: torch.Tensor, into: BatchReduction) -> None:
    """Two batched vector-matrix products; no second copy of the weights."""
    weights = weights.float()
    length = weights.shape[-1]
    # For a real query i, A[i, j] = 0 when j > i, so summing real rows gives
    # the diagonal plus everything strictly below it. Padding rows are left out.
    real_rows = into.real_tokens[:, None, None, :].float()
    column_sums = torch.matmul(real_rows, weights)[:, :, 0, :]
    later = torch.arange(length - 1, -1, -1, device=weights.device, dtype=torch.float32)
    received = (column_sums - weights.diagonal(dim1=-2, dim2=-1)) / later
    received[..., -1] = float("nan")
    inserted = into.inserted_keys[:, None, :, None].float()
    lam = 1.0 - torch.matmul(weights, inserted)[..., 0]
    into.received[layer] = received.cpu()
    into.lam[layer] = lam.cpu()
    if layer in into.map_layers:
        into.maps[layer] = weights.half().cpu()


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
