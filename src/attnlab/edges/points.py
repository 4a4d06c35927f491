"""Tensors at points: the flat (row × tokens + position) indices of the tokens a pass patches,
records or keeps gradients at, and the dtype the RMS norms compute in."""

from __future__ import annotations

import torch


def select_points(x: torch.Tensor, points: torch.Tensor | None) -> torch.Tensor:
    """``x`` [..., rows, tokens, hidden] at ``points`` (flat token indices; None: every token):
    [..., points, hidden]."""
    flat = x.flatten(-3, -2)
    return flat if points is None else flat.index_select(-2, points.to(x.device))


def at_least_float32(x: torch.Tensor) -> torch.dtype:
    """The dtype RMS norms compute in: float32, or the input's if wider."""
    return torch.promote_types(x.dtype, torch.float32)


def contiguous(indices: list[int]) -> list[int] | slice:
    """``indices`` as a slice where they are a run (indexing with it is a view, not a copy)."""
    if indices and indices == list(range(indices[0], indices[-1] + 1)):
        return slice(indices[0], indices[-1] + 1)
    return indices
