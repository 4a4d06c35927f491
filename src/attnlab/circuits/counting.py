"""Heads to the threshold, counted on prompts the heads were not ranked on, with intervals.

Heads are ranked on one share of a task's prompts (``tasks.split_for_ranking``) and swept on the
others, so a count is not flattered by ranking and counting on the same prompts. Each prompt's
metric is kept at every k of the sweep; resampling the swept prompts (``curves.resample_draws``)
gives a bootstrap interval on the count and a band around the curve, and, with the same draws
for two models measured on the same prompts (a model and its own sparse copy), a paired
interval on their N×. Every ranking scored is swept (exact patching and attribution), so the
gap between them stays visible; the configured one is the count the figures show.

No torch here: the sweep runs through a patching engine handed in (``patching.heads.Patcher``, ``patching.edges.EdgeCircuits``), and the figures and tables
call the interval arithmetic without a model.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass

import numpy as np
import pandas as pd

from attnlab.circuits.sweeps import sweep
from attnlab.circuits.curves import (count_interval, crossing, extend_sweep, first_reaching, fragility,
                                     interval_gaps, per_prompt_matrix, ratio_interval, resample_draws,
                                     resampled_effects)

log = logging.getLogger(__name__)

# Below this many counted prompts a percentile interval on a first crossing is a rough spread
# at best: the sweep says so in its log.
FEW_COUNTED_PROMPTS = 20


@dataclass(frozen=True)
class Bootstrap:
    """Resamples of the swept prompts: how many, the interval's confidence, the seed."""

    n_resamples: int
    confidence: float
    seed: int

    def draws(self, n_prompts: int, stream: int = 0) -> np.ndarray:
        """The resamples' prompt indices; ``stream`` > 0 gives draws independent of stream 0's."""
        return resample_draws(n_prompts, self.n_resamples, self.seed + stream)


@dataclass
class Counted:
    """One ranking's sweep: its curve (with the bootstrap band), each prompt's metric at every
    k measured (long rows: heads_kept, prompt, metric) and what it says of the threshold."""

    curve: pd.DataFrame
    per_prompt: pd.DataFrame
    summary: dict


def prompts_digest(clean: list[str], corrupted: list[str]) -> str:
    """Identifies a set of prompt pairs: two sweeps with the same digest were measured on the same
    prompts, in the same order, and their resamples can be paired."""
    return hashlib.sha256(json.dumps([clean, corrupted]).encode()).hexdigest()[:16]


def count_heads(patcher, order: list[tuple[int, int]], ks: list[int], threshold: float,
                bootstrap: Bootstrap, prompt_ids: list[int], interval_points: int = 0,
                refine: bool = True) -> Counted:
    """Sweep ``order`` on the patcher's prompts (``prompt_ids``: their indices in the task's
    prompts), refined around the first crossing unless ``refine`` is false (the count is then
    the grid's, an upper bound), and bootstrap the count; then measure up to ``interval_points``
    more k so that the interval's ends are found to the head (``curves.interval_gaps``), and
    bootstrap again (the ends may move: ``interval_to_the_head`` says whether they still are).
    ``prompt_ids`` ascend: the figures rebuild the same draws from the per-prompt rows, whose
    prompts they order by id (``per_prompt_matrix``)."""
    if list(prompt_ids) != sorted(prompt_ids):
        raise ValueError("count_heads needs the counted prompts in ascending order of their ids")
    if len(prompt_ids) < FEW_COUNTED_PROMPTS:
        log.warning("the count's interval rests on %d counted prompts (fewer than %d): read it as a "
                    "rough spread; raise the task's n", len(prompt_ids), FEW_COUNTED_PROMPTS)
    curve, metrics = sweep(patcher, order, ks, threshold if refine else None)
    draws = bootstrap.draws(len(prompt_ids))
    interval = _interval(curve, metrics, threshold, draws, bootstrap.confidence)
    gaps = interval_gaps(curve["heads_kept"], interval["low"], interval["high"])
    added = gaps[:interval_points]
    if added:
        means = {}
        for k in added:
            means[k], metrics[k] = patcher.per_prompt(patcher.kept(order, k))
        curve = extend_sweep(curve, means)
        interval = _interval(curve, metrics, threshold, draws, bootstrap.confidence)
        gaps = interval_gaps(curve["heads_kept"], interval["low"], interval["high"])
    curve = curve.assign(effect_low=interval["band_low"], effect_high=interval["band_high"])
    summary = {**crossing(curve, threshold), **fragility(curve, threshold),
               "heads_interval": [interval["low"], interval["high"]],
               "interval_to_the_head": not gaps, "interval_points_added": len(added),
               "never_reached_share": interval["never_share"],
               "undefined_resamples": interval["undefined_resamples"]}
    if interval["undefined_resamples"]:
        log.info("%d of %d resamples skipped: their m(all) equals their m(0) (no explained effect)",
                 interval["undefined_resamples"], bootstrap.n_resamples)
    return Counted(curve, _long(metrics, prompt_ids), summary)


def _interval(curve: pd.DataFrame, metrics: dict, threshold: float, draws, confidence: float) -> dict:
    ks = np.array(sorted(metrics))
    if not np.array_equal(ks, curve["heads_kept"].to_numpy()):
        raise ValueError("every k of the sweep needs each prompt's metric")
    return count_interval(ks, np.stack([metrics[k] for k in ks]), threshold, draws, confidence)


def _long(metrics: dict[int, np.ndarray], prompt_ids: list[int]) -> pd.DataFrame:
    ks = sorted(metrics)
    return pd.DataFrame({"heads_kept": np.repeat(ks, len(prompt_ids)),
                         "prompt": np.tile(prompt_ids, len(ks)),
                         "metric": np.concatenate([metrics[k] for k in ks])})


def resampled_counts(per_prompt: pd.DataFrame, threshold: float, draws: np.ndarray) -> np.ndarray:
    """Each resample's count to ``threshold`` from a sweep's per-prompt metrics (one ranking)."""
    ks, metrics = per_prompt_matrix(per_prompt)
    return first_reaching(ks, resampled_effects(metrics, draws), threshold)


def ratio_between(first: pd.DataFrame, second: pd.DataFrame, paired: bool, threshold: float,
                  bootstrap: Bootstrap) -> dict:
    """The bootstrap interval of N× = first's count / second's, from the two sweeps' per-prompt
    metrics: the same resamples for both when ``paired`` (the same prompts), else independent."""
    n_first, n_second = first["prompt"].nunique(), second["prompt"].nunique()
    if paired and n_first != n_second:
        raise ValueError(f"paired sweeps need the same prompts; they have {n_first} and {n_second}")
    draws_first = bootstrap.draws(n_first)
    draws_second = draws_first if paired else bootstrap.draws(n_second, stream=1)
    return {**ratio_interval(resampled_counts(first, threshold, draws_first),
                             resampled_counts(second, threshold, draws_second), bootstrap.confidence),
            "paired": paired}
