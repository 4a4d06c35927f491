"""The items of one model × dataset × condition as the model runs them: both conditions' sequences
(prompt, then the continuation) left-padded into task batches whose metric is the continuation's
log-probability, and, per direction, where each recipient token's counterpart sits in the source
run (``Direction``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attnlab.mechanism.mediation.alignment import Item
from attnlab.models import left_pad
from attnlab.patching.batch import TaskBatch


def continuation_metric(items: list[Item], keep: int):
    """The metric of a task batch of ``items``' sequences: each row's summed log-probability of its
    continuation (the logits of the last ``keep`` positions, float64)."""
    targets = torch.full((len(items), keep), -1, dtype=torch.long)
    for row, item in enumerate(items):
        m = len(item.continuation)
        # continuation token t (0-based) sits at position n − m + t, predicted at n − m + t − 1
        targets[row, keep - m - 1:keep - 1] = torch.tensor(item.continuation)

    def metric(logits: torch.Tensor, prompts: slice) -> torch.Tensor:
        wanted = targets[prompts].to(logits.device)
        logp = torch.log_softmax(logits.double(), dim=-1)
        picked = logp.gather(-1, wanted.clamp(min=0)[..., None])[..., 0]
        return torch.where(wanted >= 0, picked, torch.zeros_like(picked)).sum(-1)
    return metric


def sequences_batch(items: list[Item], treated: bool) -> TaskBatch:
    """One condition's sequences as a task batch (``clean``; ``corrupted`` the same, unused)."""
    rows = [(item.treated if treated else item.baseline) + item.continuation for item in items]
    ids, mask, _ = left_pad(rows)
    keep = max(len(item.continuation) for item in items) + 1
    return TaskBatch(ids, ids.clone(), mask, [0] * len(items), continuation_metric(items, keep),
                     read_positions=keep)


@dataclass(frozen=True)
class Direction:
    """A recipient run given a source run's activations: ``denoising`` (the baseline given the
    treated run's) or ``noising`` (the treated run given the baseline's). ``source_column``
    [rows, recipient width]: each recipient column's column in the source batch, −1 where the
    token has no counterpart (padding; the inserted span when noising)."""

    name: str
    recipient: TaskBatch
    source: TaskBatch
    source_column: torch.Tensor

    @property
    def aligned(self) -> torch.Tensor:
        return self.source_column >= 0

    def transfer(self, source: torch.Tensor, recipient: torch.Tensor) -> torch.Tensor:
        """The recipient's tensor [rows, width, features] with the source's values at every
        aligned token (its own elsewhere)."""
        index = self.source_column.clamp(min=0).to(source.device)[..., None].expand(-1, -1, source.shape[-1])
        moved = source.gather(1, index)
        return torch.where(self.aligned.to(source.device)[..., None], moved, recipient.to(source.device))

    def gathered(self, source: torch.Tensor) -> torch.Tensor:
        """The source's values at each recipient token's counterpart (arbitrary where none)."""
        index = self.source_column.clamp(min=0).to(source.device)[..., None].expand(-1, -1, source.shape[-1])
        return source.gather(1, index)


def directions(items: list[Item]) -> tuple[Direction, Direction]:
    """(denoising, noising) for ``items``, their columns from the recorded alignment."""
    baseline, treated = sequences_batch(items, treated=False), sequences_batch(items, treated=True)
    width_b, width_t = baseline.clean.shape[1], treated.clean.shape[1]
    to_treated = torch.full((len(items), width_b), -1, dtype=torch.long)
    to_baseline = torch.full((len(items), width_t), -1, dtype=torch.long)
    for row, item in enumerate(items):
        b_columns = width_b - item.baseline_length + np.arange(item.baseline_length)
        t_columns = width_t - item.treated_length + item.treated_position()
        to_treated[row, b_columns] = torch.from_numpy(t_columns)
        to_baseline[row, t_columns] = torch.from_numpy(b_columns)
    return (Direction("denoising", baseline, treated, to_treated),
            Direction("noising", treated, baseline, to_baseline))
