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

The reduction runs inside the attention function of ``attnlab.interventions``
(``with intervened(model, reduce=BatchReduction(...))``), registered through
transformers' attention interface, so it works for every architecture that
dispatches through it (Llama/SmolLM2, Qwen2, Gemma-3 with its sliding windows)
and handles grouped-query attention by repeating key/value heads as eager does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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

    def on_host(self) -> None:
        """Every layer's results on the host, in one copy per kind: they stay on the model's
        device while the forward runs, since on a GPU each copy waits for the queued work and
        one per layer would stall the card at every layer."""
        for layers in (self.received, self.lam, self.maps):
            if layers and next(iter(layers.values())).device.type != "cpu":
                keys = sorted(layers)
                layers.update(zip(keys, torch.stack([layers[k] for k in keys]).cpu().unbind(0)))


class LayerStats:
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
        store(self.into, self.layer, self.column_sums - self.diagonal, self.lam)
        if self.map is not None:
            self.into.maps[self.layer] = self.map.half()


def store(into: BatchReduction, layer: int, later_sums: torch.Tensor, lam: torch.Tensor) -> None:
    """Leave one layer's results in ``into``: ``later_sums`` [batch, heads, keys] holds, per key j,
    the attention of the real queries i > j; received is its mean over the later positions."""
    length = later_sums.shape[-1]
    later = torch.arange(length - 1, -1, -1, device=later_sums.device, dtype=torch.float32)
    received = later_sums / later
    received[..., -1] = float("nan")
    into.received[layer] = received
    into.lam[layer] = lam.float()
