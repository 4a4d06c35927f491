"""One item under two prompt conditions, token by token: which token of the baseline prompt is
which token of the treated one, read from the recorded spans and checked, never assumed.

The treated prompt is the baseline's with a span inserted (``cut_start``..``cut_end`` in the
treated prompt's tokens: the inserted tokens and any separator the placement adds; removing it
gives the baseline's tokens exactly, which ``Item.of`` checks). Baseline token p is treated token p
before the span and p + (cut_end − cut_start) after it; the continuation both are scored on follows
each prompt. The inserted tokens have no counterpart.

The continuation is the model's own greedy answer under the treated condition, cut right after
its answer (the last occurrence of the extracted prediction in the response): the metric is then
the log-probability of that answer as the treated run gave it, whatever its format, so the effect
measured is how much more the treated prompt makes the model say this answer. Where nothing was
extracted, the whole generation is the continuation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class AlignmentError(ValueError):
    """A treated prompt that is not its baseline with one span inserted (the message says where)."""


@dataclass(frozen=True)
class Item:
    """One item: its prompts under both conditions, the span the treated one inserts, and the
    continuation both are scored on."""

    id: str
    baseline: list[int]
    treated: list[int]
    cut: tuple[int, int]
    continuation: list[int]

    @classmethod
    def of(cls, id_: str, baseline: list[int], treated: list[int], cut: tuple[int, int],
           continuation: list[int]) -> "Item":
        start, end = int(cut[0]), int(cut[1])
        if not 0 <= start <= end <= len(treated) or treated[:start] + treated[end:] != list(baseline):
            raise AlignmentError(f"item {id_}: the treated prompt without its recorded span {start}..{end} "
                                 f"is not the baseline prompt ({len(treated)} − {end - start} tokens against "
                                 f"{len(baseline)}): the two prompt files are not of the same item and prompt")
        if not continuation:
            raise AlignmentError(f"item {id_}: an empty continuation has nothing to score")
        return cls(str(id_), list(baseline), list(treated), (start, end), list(continuation))

    @property
    def baseline_length(self) -> int:
        return len(self.baseline) + len(self.continuation)

    @property
    def treated_length(self) -> int:
        return len(self.treated) + len(self.continuation)

    def treated_position(self) -> np.ndarray:
        """For each token of the baseline sequence (prompt, then continuation), its position in the
        treated sequence."""
        positions = np.arange(self.baseline_length)
        return np.where(positions < self.cut[0], positions, positions + (self.cut[1] - self.cut[0]))

    def inserted(self) -> np.ndarray:
        """[treated_length] bool: the treated tokens without a counterpart (the inserted span)."""
        mask = np.zeros(self.treated_length, bool)
        mask[self.cut[0]:self.cut[1]] = True
        return mask


def answer_continuation(tokens: list[int], response: str, prediction, decode) -> list[int]:
    """The generated ``tokens`` up to and including the one that completes the last occurrence of
    ``prediction`` in ``response`` (``decode``: token ids -> text); all of them where there is no
    prediction or it is not found."""
    if prediction is None or (isinstance(prediction, float) and np.isnan(prediction)) or str(prediction) == "":
        return list(tokens)
    where = response.rfind(str(prediction))
    if where < 0:
        return list(tokens)
    end = where + len(str(prediction))
    for k in range(1, len(tokens) + 1):
        if len(decode(tokens[:k])) >= end:
            return list(tokens[:k])
    return list(tokens)
