"""Tensors at points: the flat (row × tokens + position) indices of the tokens a pass patches,
records or keeps gradients at, and the dtype the norms compute in."""

from __future__ import annotations

import torch

from attnlab.anatomy.norms import at_least_float32

__all__ = ["at_least_float32", "contiguous", "select_points"]


def select_points(x: torch.Tensor, points: torch.Tensor | None) -> torch.Tensor:
    """``x`` [..., rows, tokens, hidden] at ``points`` (flat token indices; None: every token):
    [..., points, hidden]."""
    flat = x.flatten(-3, -2)
    return flat if points is None else flat.index_select(-2, points.to(x.device))


def contiguous(indices: list[int]) -> list[int] | slice:
    """``indices`` as a slice where they are a run (indexing with it is a view, not a copy)."""
    if indices and indices == list(range(indices[0], indices[-1] + 1)):
        return slice(indices[0], indices[-1] + 1)
    return indices
