"""The structure of a model's attention mask, as the fused kernels take it.

The kernels never read a queries × keys mask. They take its structure instead: causal (queries
are the last positions of the keys), an optional sliding window, and which keys are real
(padding). ``layout_of`` derives that structure from the mask transformers built and accepts it
only when rebuilding the mask from the structure gives the same mask, element for element; any
other mask (chunked or bidirectional attention, additive biases) is ``None``: the caller then
keeps the eager path.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class MaskLayout:
    key_real: torch.Tensor | None  # [B, N] bool: False on padding keys; None: every key is real
    offset: int  # N - M: the queries are the last M of N positions
    window: int | None  # sliding window: key j allowed for the query at position p iff p - j < window
    # what the launchers derive from it once (the keys' int8 flags): every layer of a forward pass
    # reads the same layout (``layout_of`` keeps one per mask)
    derived: dict = field(default_factory=dict, compare=False, repr=False)


def allowed_by(layout: MaskLayout, batch: int, queries: int, keys: int, device) -> torch.Tensor:
    """[B, 1, M, N] bool: the mask the structure stands for (tests and the equality check)."""
    position = torch.arange(queries, device=device)[:, None] + layout.offset
    key = torch.arange(keys, device=device)[None, :]
    allowed = key <= position
    if layout.window is not None:
        allowed = allowed & (position - key < layout.window)
    allowed = allowed[None, None].expand(batch, 1, queries, keys)
    if layout.key_real is not None:
        allowed = allowed & layout.key_real[:, None, None, :keys]
    return allowed


# The same mask object serves every layer of a forward pass (one per attention kind): it is
# checked once. Entries hold a weak reference, so a freed mask's id can never match.
_checked: dict[int, tuple[weakref.ref, int | None, MaskLayout | None]] = {}


def layout_of(mask: torch.Tensor | None, queries: int, keys: int,
              window: int | None) -> MaskLayout | None:
    """The structure of ``mask`` ([B or 1, 1, M, ≥N], additive or boolean; None means causal),
    or None where the mask is not causal ∧ window ∧ key padding."""
    if mask is None:
        return MaskLayout(None, keys - queries, None)
    cached = _checked.get(id(mask))
    if cached is not None and cached[0]() is mask and cached[1] == window:
        return cached[2]
    layout = _derive(mask, queries, keys, window)
    for stale in [k for k, (ref, _, _) in _checked.items() if ref() is None]:
        del _checked[stale]
    _checked[id(mask)] = (weakref.ref(mask), window, layout)
    return layout


def _derive(mask: torch.Tensor, queries: int, keys: int, window: int | None) -> MaskLayout | None:
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-2] != queries or mask.shape[-1] < keys:
        return None
    mask = mask[..., :keys]
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask == 0
        if not bool((allowed | (mask == torch.finfo(mask.dtype).min)).all()):
            return None  # an additive bias, not a mask
    layout = MaskLayout(allowed.any(dim=-2)[:, 0], keys - queries, window)
    if not torch.equal(allowed_by(layout, mask.shape[0], queries, keys, mask.device), allowed):
        return None
    return layout
