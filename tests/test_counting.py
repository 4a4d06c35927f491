"""Counting heads on prompts they were not ranked on, with bootstrap intervals of known answer."""

import numpy as np
import pandas as pd
import pytest
from scipy.stats import binom

from attnlab.circuits.counting import Bootstrap, count_heads, ratio_between
from attnlab.circuits.curves import interval_gaps, interval_text, order_interval, refined_sweep
from attnlab.patching.tasks import TaskError, split_for_ranking


def test_split_is_seeded_disjoint_and_complete():
    ranked, counted = split_for_ranking(24, 0.5, seed=3)
    assert len(ranked) == len(counted) == 12 and not set(ranked) & set(counted)
    assert sorted(ranked + counted) == list(range(24)) and ranked == sorted(ranked)
    assert split_for_ranking(24, 0.5, seed=3) == (ranked, counted)
    assert split_for_ranking(24, 0.5, seed=4) != (ranked, counted)
    assert split_for_ranking(10, 0.25, seed=0)[0].__len__() == 2  # round(2.5): banker's rounding
    everything = list(range(7))
    assert split_for_ranking(7, 0, seed=0) == (everything, everything)  # 0: today's behaviour
    with pytest.raises(TaskError, match="at least 2 prompts"):
        split_for_ranking(1, 0.5, seed=0)


def _steps(thresholds: np.ndarray, ks: list[int]) -> np.ndarray:
    """Per-prompt metric 1[k ≥ c_i]: the explained effect at k is the share of prompts whose
    c_i ≤ k, so the heads to 0.9 are the 90th percentile of the c_i."""
    return (np.asarray(ks)[:, None] >= thresholds[None, :]).astype(float)


def _expected_interval(n: int, heads: int, confidence: float = 0.95) -> tuple[int, int]:
    """With c_i spread evenly over 1..heads, a resample's count is ≤ k exactly when at least
    90% of its n prompts have c_i ≤ k: P = P(Binomial(n, k / heads) ≥ 0.9 n). The interval's ends
    are the k where that probability first reaches 2.5% and 97.5%."""
    tail = (1 - confidence) / 2
    probability = [1 - binom.cdf(np.ceil(0.9 * n) - 1, n, k / heads) for k in range(heads + 1)]
    return (next(k for k, p in enumerate(probability) if p >= tail),
            next(k for k, p in enumerate(probability) if p >= 1 - tail))


class StepPatcher:
    """A stand-in for pruning.Patcher over a curve of known per-prompt metrics."""

    def __init__(self, thresholds: np.ndarray):
        self.thresholds, self.measured = thresholds, []

    def kept(self, order, k):
        return k

    def per_prompt(self, k):
        self.measured.append(k)
        values = _steps(self.thresholds, [k])[0]
        return float(values.mean()), values

    def sweep(self, order, ks, threshold=None):
        per_prompt = {}

        def metric_at(k):
            mean, per_prompt[k] = self.per_prompt(k)
            return mean
        return refined_sweep(metric_at, len(order), ks, threshold), per_prompt


def test_the_bootstrap_interval_of_a_count_matches_its_binomial_answer():
    heads, n = 100, 1000
    thresholds = np.tile(np.arange(1, heads + 1), n // heads)  # c_i: 10 prompts at each k
    patcher = StepPatcher(thresholds)
    counted = count_heads(patcher, list(range(heads)), list(range(heads + 1)), 0.9,
                          Bootstrap(2000, 0.95, seed=0), list(range(n)))
    assert counted.summary["heads_to_reach_threshold"] == 90
    low, high = counted.summary["heads_interval"]
    want_low, want_high = _expected_interval(n, heads)
    assert (want_low, want_high) == (88, 92)
    assert abs(low - want_low) <= 1 and abs(high - want_high) <= 1
    assert counted.summary["interval_to_the_head"] and counted.summary["never_reached_share"] == 0
    # The band holds the curve; the per-prompt rows hold every prompt at every k.
    curve = counted.curve
    assert (curve["effect_low"] <= curve["explained_effect"] + 1e-12).all()
    assert (curve["effect_high"] >= curve["explained_effect"] - 1e-12).all()
    assert len(counted.per_prompt) == (heads + 1) * n


class CurvedPatcher(StepPatcher):
    """Prompt i's metric at k kept of ``heads``: (k / heads) ** power_i, so the explained effect of
    a resample of prompts is the mean of its powers of k / heads and varies from one to the next."""

    def __init__(self, powers: np.ndarray, heads: int):
        self.powers, self.heads, self.measured = powers, heads, []

    def per_prompt(self, k):
        self.measured.append(k)
        values = (k / self.heads) ** self.powers
        return float(values.mean()), values


def test_the_curves_band_is_the_2_5th_and_97_5th_percentile_of_resampled_effects():
    """At the 95% level the band at each measured k is np.percentile at 2.5 and 97.5 of the
    resamples' explained effects, the resamples drawn here (numpy's generator, the bootstrap's
    seed: n_resamples rows of n prompt indices) and their effects computed here from each
    prompt's metric (m(k) − m(0)) / (m(all) − m(0)), every resample's mean over its prompts."""
    heads, n, seed = 20, 30, 4
    powers = np.random.default_rng(1).uniform(0.3, 3.0, n)
    counted = count_heads(CurvedPatcher(powers, heads), list(range(heads)), [0, 2, 5, 10, 15, 20], 0.9,
                          Bootstrap(500, 0.95, seed), list(range(n)))
    curve = counted.curve
    ks = curve["heads_kept"].to_numpy()
    draws = np.random.default_rng(seed).integers(0, n, size=(500, n))
    means = ((ks[:, None, None] / heads) ** powers[draws][None]).mean(-1).T  # [resamples, k]
    effects = (means - means[:, :1]) / (means[:, -1:] - means[:, :1])
    assert np.all(np.isfinite(effects))
    assert curve["effect_low"].to_numpy() == pytest.approx(np.percentile(effects, 2.5, axis=0), abs=1e-12)
    assert curve["effect_high"].to_numpy() == pytest.approx(np.percentile(effects, 97.5, axis=0), abs=1e-12)
    inner = (curve["heads_kept"] > 0) & (curve["heads_kept"] < heads)
    assert ((curve["effect_high"] - curve["effect_low"])[inner] > 0.02).all()  # a band, not a line


def test_a_grid_sweep_measures_every_k_just_below_each_end_of_the_interval():
    heads, n = 200, 400
    thresholds = np.repeat(np.arange(1, heads + 1), n // heads)
    patcher = StepPatcher(thresholds)
    grid = [0, 1, 2, 4, 8, 16, 32, 64, 128, 150, 175, 200]
    counted = count_heads(patcher, list(range(heads)), grid, 0.9, Bootstrap(1000, 0.95, 0), list(range(n)),
                          interval_points=100)
    low, high = counted.summary["heads_interval"]
    measured = set(counted.curve["heads_kept"])
    assert counted.summary["heads_to_reach_threshold"] == 180
    assert counted.summary["interval_to_the_head"] and counted.summary["interval_points_added"] > 0
    for end in (low, high):  # every k from the measured point before each end to the end
        before = max(k for k in measured if k < end)
        assert set(range(before, end + 1)) <= measured
    assert interval_gaps(measured, low, high) == []
    assert len(patcher.measured) == len(set(patcher.measured))  # no k measured twice


def test_a_paired_ratio_of_a_model_with_itself_is_exactly_one():
    rng = np.random.default_rng(0)
    thresholds = rng.integers(1, 50, 60)
    ks = list(range(51))
    rows = pd.DataFrame({"heads_kept": np.repeat(ks, 60), "prompt": np.tile(np.arange(60), 51),
                         "metric": _steps(thresholds, ks).ravel()})
    paired = ratio_between(rows, rows, True, 0.9, Bootstrap(500, 0.95, 0))
    assert (paired["low"], paired["high"], paired["paired"]) == (1.0, 1.0, True)
    independent = ratio_between(rows, rows, False, 0.9, Bootstrap(500, 0.95, 0))
    assert independent["low"] < 1 < independent["high"] and not independent["paired"]
    with pytest.raises(ValueError, match="same prompts"):
        ratio_between(rows, rows[rows["prompt"] < 30], True, 0.9, Bootstrap(500, 0.95, 0))


def test_intervals_print_never_and_keep_whole_numbers():
    assert order_interval(np.array([3] * 5 + [4] * 30 + [5] * 5, dtype=float), 0.5) == (4.0, 4.0)
    assert order_interval(np.array([3, 5, 4, np.inf] * 10, dtype=float), 0.5) == (3.0, np.inf)
    assert order_interval(np.array([3.0, np.inf, np.inf]), 0.95)[1] == np.inf
    assert interval_text(12, 25) == "[12, 25]" and interval_text(12, None) == "[12, never]"
    assert interval_text(0.5, float("inf"), 2) == "[0.50, ∞]"
