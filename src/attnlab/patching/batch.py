"""A task's clean and corrupted prompts as token ids for the model, and the metric on its logits
(``TaskBatch``, ``build_batch``): what head patching (``pruning``), edge circuits and mediation
run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from attnlab.models import left_pad
from attnlab.patching.tasks import TaskError, TaskPrompts, year_continuations

LOGITS_KEPT = 2  # what a TaskBatch reads unless it says: the last 2 positions, every token


@dataclass
class TaskBatch:
    """Token ids of every clean/corrupted prompt (left padded) and the task metric."""

    clean: torch.Tensor
    corrupted: torch.Tensor
    mask: torch.Tensor
    templates: list[int]
    # (logits at the last read_positions positions, the prompts they belong to) -> metric per prompt
    metric: Callable[[torch.Tensor, slice], torch.Tensor]
    rows_per_prompt: int = 1  # Greater-Than on digit tokenizers: 10 (one per first digit)
    # What the metric reads: the last positions (1, or 2 for Greater-Than on digit tokenizers),
    # and the token ids (None: every one, for a softmax). Logits elsewhere may be left uncomputed.
    read_positions: int = LOGITS_KEPT
    read_tokens: torch.Tensor | None = None

    @property
    def n_prompts(self) -> int:
        return len(self.clean) // self.rows_per_prompt

    @property
    def positions(self) -> torch.Tensor:
        """Each token's position, counted from the row's first real token (left padding)."""
        return (self.mask.cumsum(-1) - 1).clamp(min=0)

    def whole_prompts(self, batch_size: int) -> int:
        """``batch_size`` rows rounded down to whole prompts (at least one): a prompt's rows never
        straddle two mini-batches."""
        return max(1, batch_size // self.rows_per_prompt) * self.rows_per_prompt

    def chunks(self, batch_size: int) -> list[slice]:
        """The rows of each mini-batch of at most ``whole_prompts(batch_size)`` rows."""
        size, n = self.whole_prompts(batch_size), len(self.clean)
        return [slice(i, min(i + size, n)) for i in range(0, n, size)]

    def differing_points(self, rows: slice) -> torch.Tensor:
        """The tokens of ``rows`` at and after each row's first difference between its clean and
        corrupted ids, as flat indices (row × tokens + position): before it, a causal model
        computes the same on both."""
        differs = (self.clean[rows] != self.corrupted[rows]).int().cummax(dim=1).values.bool()
        return differs.flatten().nonzero()[:, 0]

    def prompts_of(self, rows: slice) -> slice:
        """The prompts whose rows are ``rows``."""
        return slice(rows.start // self.rows_per_prompt, rows.stop // self.rows_per_prompt)


def build_batch(prompts: TaskPrompts, tokenizer) -> TaskBatch:
    clean = [tokenizer(p).input_ids for p in prompts.clean]
    corrupted = [tokenizer(p).input_ids for p in prompts.corrupted]
    templates = list(prompts.templates)
    if prompts.task == "greater_than":
        metric, clean, corrupted, templates = _greater_than_metric(prompts, tokenizer, clean, corrupted, templates)
        read = {"read_positions": 2 if prompts.info["formulation"] == "digits" else 1}
    else:
        answers = torch.tensor(prompts.answers)
        distractors = torch.tensor(prompts.distractors)
        read = {"read_positions": 1, "read_tokens": torch.cat([answers, distractors.flatten()]).unique()}

        def metric(logits: torch.Tensor, prompts: slice) -> torch.Tensor:
            last = logits[:, -1].float()
            right = last.gather(1, answers[prompts, None].to(last.device))[:, 0]
            wrong = last.gather(1, distractors[prompts].to(last.device)).max(dim=1).values
            return right - wrong
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    clean_ids, mask, _ = left_pad(clean, pad)
    corrupted_ids, corrupted_mask, _ = left_pad(corrupted, pad)
    if not torch.equal(mask, corrupted_mask):
        raise TaskError(f"{prompts.task}: clean and corrupted prompts differ in token length")
    rows_per_prompt = len(clean) // len(prompts.clean)
    return TaskBatch(clean_ids, corrupted_ids, mask, templates, metric, rows_per_prompt, **read)


def _greater_than_metric(prompts, tokenizer, clean, corrupted, templates):
    """Σ p(y > YY) − Σ p(y ≤ YY) over the 100 two-digit continuations."""
    # The ids each continuation "YY" is made of after "... the year XX", as checked
    # for every century: the metric sums exactly the splits the model sees.
    formulation, pieces = year_continuations(tokenizer)
    if formulation != prompts.info["formulation"]:
        raise TaskError(f"greater_than prompts were made for the {prompts.info['formulation']} formulation, "
                        f"but tokenizer {tokenizer.name_or_path} needs {formulation}")
    years = torch.tensor(prompts.years)
    later = torch.arange(100)[None, :] > years[:, None]  # [n, 100]
    sign = later.float() * 2 - 1
    if formulation == "two_digit":
        year_ids = torch.tensor([ids[0] for ids in pieces])

        def metric(logits, prompts):
            probs = logits[:, -1].float().softmax(-1)[:, year_ids.to(logits.device)]
            return (probs * sign[prompts].to(logits.device)).sum(-1)
        return metric, clean, corrupted, templates
    # Digit-level tokenizers: p(d1 d2) = p(d1) * p(d2 | d1). Each prompt is
    # extended by each first digit, so one forward gives both factors.
    digit_ids = [pieces[10 * d][0] for d in range(10)]
    digits = torch.tensor(digit_ids)

    def metric(logits, prompts):
        n = logits.shape[0] // 10
        first = logits[::10, -2].float().softmax(-1)[:, digits.to(logits.device)]  # [n, 10]
        second = logits[:, -1].float().softmax(-1)[:, digits.to(logits.device)].view(n, 10, 10)
        probs = (first[:, :, None] * second).reshape(n, 100)
        return (probs * sign[prompts].to(logits.device)).sum(-1)

    extend = lambda rows: [row + [d] for row in rows for d in digit_ids]  # noqa: E731
    return metric, extend(clean), extend(corrupted), [t for t in templates for _ in range(10)]
