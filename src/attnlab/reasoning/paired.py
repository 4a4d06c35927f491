"""Accuracy as proportions: a cell's interval, and a condition against the plain prompt on the same
items (the paired question 2510.01032 asks: does inserting tokens change accuracy?).

- **One cell**: the Wilson score interval of k correct of n (``scipy.stats.binomtest``'s
  ``proportion_ci(method="wilson")``). Chosen over Clopper-Pearson's "exact" interval, which
  guarantees at least the nominal coverage by being wider than needed (at n = 32 its average
  coverage is near 98%), and over the percentile bootstrap this project used before, which gives
  0 of 6 the interval [0, 0]. Wilson's coverage stays near 95% down to small n and it is never
  empty at 0 or n correct (0 of 6: [0, 39.0%]; Brown, Cai & DasGupta 2001 recommend it there).
- **Paired difference** treated − baseline on the items both conditions graded, from the 2 × 2
  table of (treated correct, baseline correct): Newcombe's hybrid score interval for paired data,
  his method 10 (Newcombe 1998, Statistics in Medicine 17:2635): the Wilson intervals of the two
  marginal proportions combined with the correlation φ of the pairs.
- **McNemar's exact test**: a two-sided binomial test of the discordant pairs (treated-only
  correct against baseline-only correct) at 1/2.
- **Holm's correction** across the conditions compared with one baseline (one family per model,
  dataset and grader): it controls the chance of any false "changes accuracy" among them without
  assuming the tests independent (they share the baseline's items).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

INTERVAL = "Wilson score"
PAIRED_INTERVAL = "Newcombe's hybrid score interval for paired data (method 10)"
TEST = "McNemar's exact test (two-sided binomial test of the discordant pairs), Holm-adjusted across conditions"


def wilson(correct: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of ``correct`` of ``n`` (a proportion; NaN without items)."""
    if n == 0:
        return float("nan"), float("nan")
    interval = stats.binomtest(int(correct), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(interval.low), float(interval.high)


@dataclass(frozen=True)
class PairedTable:
    """The 2 × 2 table of one condition against the baseline on the same items."""

    both: int  # correct under both
    treated_only: int  # correct under the treated condition only
    baseline_only: int  # correct under the baseline only
    neither: int

    @property
    def n(self) -> int:
        return self.both + self.treated_only + self.baseline_only + self.neither

    @classmethod
    def of(cls, treated: np.ndarray, baseline: np.ndarray) -> "PairedTable":
        treated, baseline = np.asarray(treated, bool), np.asarray(baseline, bool)
        return cls(int((treated & baseline).sum()), int((treated & ~baseline).sum()),
                   int((~treated & baseline).sum()), int((~treated & ~baseline).sum()))


def _phi(table: PairedTable) -> float:
    """The correlation of the pairs (0 where a margin is empty, as Newcombe sets it)."""
    a, b, c, d = table.both, table.treated_only, table.baseline_only, table.neither
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    return 0.0 if margins == 0 else (a * d - b * c) / math.sqrt(margins)


def newcombe_paired(table: PairedTable, confidence: float = 0.95) -> tuple[float, float, float]:
    """(difference, low, high) of the proportions correct, treated − baseline, with Newcombe's
    method 10 interval; NaN without items."""
    n = table.n
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    p1, p2 = (table.both + table.treated_only) / n, (table.both + table.baseline_only) / n
    l1, u1 = wilson(table.both + table.treated_only, n, confidence)
    l2, u2 = wilson(table.both + table.baseline_only, n, confidence)
    phi = _phi(table)
    below = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    above = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    difference = p1 - p2
    return difference, max(-1.0, difference - below), min(1.0, difference + above)


def mcnemar_exact(table: PairedTable) -> float:
    """Two-sided p-value of McNemar's exact test (1 without discordant pairs)."""
    discordant = table.treated_only + table.baseline_only
    if discordant == 0:
        return 1.0
    return float(stats.binomtest(table.treated_only, discordant, 0.5).pvalue)


def holm(pvalues) -> np.ndarray:
    """Holm's step-down adjusted p-values, in the given order."""
    pvalues = np.asarray(pvalues, float)
    order = np.argsort(pvalues, kind="stable")
    m = len(pvalues)
    adjusted = np.empty(m)
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[index]))
        adjusted[index] = running
    return adjusted


def paired_rows(items: dict[str, pd.DataFrame], baseline: str, graders: tuple[str, ...],
                confidence: float = 0.95) -> pd.DataFrame:
    """Every condition of ``items`` (condition -> its graded items: ``id`` and one 0/1 column per
    grader) against ``baseline`` on the items both hold, per grader: the 2 × 2 table, the
    difference in points with its interval, McNemar's p and Holm's across the conditions."""
    reference = items[baseline].set_index("id")
    rows = []
    for condition, frame in items.items():
        if condition == baseline:
            continue
        frame = frame.set_index("id")
        shared = frame.index.intersection(reference.index)
        for grader in graders:
            table = PairedTable.of(frame.loc[shared, grader].to_numpy(), reference.loc[shared, grader].to_numpy())
            difference, low, high = newcombe_paired(table, confidence)
            rows.append({"condition": condition, "baseline": baseline, "grader": grader, "n_paired": table.n,
                         "both_correct": table.both, "treated_only": table.treated_only,
                         "baseline_only": table.baseline_only, "neither": table.neither,
                         "difference_pts": 100 * difference, "ci_low_pts": 100 * low, "ci_high_pts": 100 * high,
                         "mcnemar_p": mcnemar_exact(table)})
    out = pd.DataFrame(rows)
    if len(out):
        out["holm_p"] = out.groupby("grader")["mcnemar_p"].transform(lambda p: holm(p.to_numpy()))
    return out
