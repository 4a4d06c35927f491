"""The count to the threshold by search (``crossing_search``) against a sweep of every n and
against the rounds of the log grid's refinement (``counting.count_heads``), on synthetic curves
of known per-prompt metrics: monotone, and not."""

import dataclasses

import numpy as np
import pytest

from attnlab.circuits.counting import Bootstrap, count_heads
from attnlab.circuits.crossing_search import search_points, searched_count
from attnlab.circuits.curves import count_interval, crossing, interval_gaps, k_grid, refined_sweep

N = 3000  # components
PROMPTS = 40
THRESHOLD = 0.9


class CurvePatcher:
    """A stand-in for edge_circuits.EdgeCircuits over per-prompt metrics given as a function of
    n: ``metric(n)`` -> [prompts]."""

    def __init__(self, metric):
        self.metric, self.measured = metric, []

    def kept(self, order, n):
        return n

    def per_prompt(self, n):
        self.measured.append(n)
        values = np.asarray(self.metric(n), dtype=float)
        return float(values.mean()), values

    def sweep(self, order, ks, threshold=None):
        per_prompt = {}

        def metric_at(n):
            mean, per_prompt[n] = self.per_prompt(n)
            return mean
        return refined_sweep(metric_at, len(order), ks, threshold, refine_points=12), per_prompt


def _climbing(seed: int = 0):
    """Each prompt climbs monotonically, on a log scale, from 0 (n = 0) to its own height (all n)
    around its own n (between 100 and 800)."""
    rng = np.random.default_rng(seed)
    centres, widths = rng.uniform(np.log(100), np.log(800), PROMPTS), rng.uniform(0.1, 0.4, PROMPTS)
    heights = rng.uniform(0.5, 1.5, PROMPTS)

    def rise(n):
        return 1 / (1 + np.exp(-(np.log(n) - centres) / widths))

    def metric(n):
        return heights * rise(n) / rise(N) if n else np.zeros(PROMPTS)
    return metric


def _dense(patcher_metric, draws):
    """Every n measured: the first crossing and the interval a sweep of every n gives."""
    ks = np.arange(N + 1)
    metrics = np.stack([np.asarray(patcher_metric(n), dtype=float) for n in ks])
    means = metrics.mean(1)
    effects = (means - means[0]) / (means[-1] - means[0])
    reached = np.flatnonzero(effects >= THRESHOLD)
    interval = count_interval(ks, metrics, THRESHOLD, draws, 0.95)
    return int(ks[reached[0]]), (interval["low"], interval["high"])


def _grid():
    return k_grid(N, 0, 16)


FINE = k_grid(N, 0, 40)  # the rounds' grid


BOOTSTRAP = Bootstrap(1000, 0.95, seed=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_on_monotone_curves_the_search_finds_the_dense_count_and_interval_in_few_points(seed):
    metric = _climbing(seed)
    patcher = CurvePatcher(metric)
    counted = searched_count(patcher, None, _grid(), FINE, THRESHOLD, BOOTSTRAP, list(range(PROMPTS)), 40)
    summary, measured = counted.summary, set(counted.curve["heads_kept"])
    count, interval = _dense(metric, BOOTSTRAP.draws(PROMPTS))
    assert summary["heads_to_reach_threshold"] == count
    assert summary["heads_interval"] == list(interval)
    assert summary["interval_to_the_head"] and interval_gaps(measured, *interval) == []
    for end in (count, *interval):  # every one a measured n, its predecessor measured too
        assert {end - 1, end} <= measured
    assert not summary["heads_to_reach_exact"]  # off a grid: an upper bound, printed ≤N
    assert len(patcher.measured) == len(measured) < 16 + 3 * 13  # the grid, then about log2 per bracket
    # the rounds of the refined log grid (counting.count_heads) find the same crossing, with more points
    rounds_patcher = CurvePatcher(metric)
    rounds = count_heads(rounds_patcher, list(range(N)), k_grid(N, 0, 40), THRESHOLD, BOOTSTRAP,
                         list(range(PROMPTS)), 12)
    assert rounds.summary["heads_to_reach_threshold"] == count
    assert len(rounds_patcher.measured) > len(patcher.measured)


def _bumpy(seed: int = 0):
    """Not monotone: a bump to about 0.6 at n ≈ 20 that falls back to 0.2 by n ≈ 60 (Gemma-3's
    IOI curve does that), the climb of ``_climbing``, an overshoot to about 1.1 and a fall back
    below the threshold near n ≈ 2,000 before all edges give 1."""
    climbing = _climbing(seed)
    rng = np.random.default_rng(seed + 10)
    bump = rng.uniform(0.4, 0.8, PROMPTS)

    def metric(n):
        base = np.asarray(climbing(n))
        if n == N:
            return base
        early = bump * np.exp(-((np.log(max(n, 1)) - np.log(20)) / 0.5) ** 2) * (n > 0)
        late = -0.25 * np.exp(-((np.log(max(n, 1)) - np.log(2000)) / 0.15) ** 2) * base
        return base + early + late
    return metric


@pytest.mark.parametrize("seed", [0, 1])
def test_on_curves_that_rise_and_fall_away_from_the_crossing_the_search_finds_the_dense_count(seed):
    metric = _bumpy(seed)
    patcher = CurvePatcher(metric)
    counted = searched_count(patcher, None, _grid(), FINE, THRESHOLD, BOOTSTRAP, list(range(PROMPTS)), 40)
    count, interval = _dense(metric, BOOTSTRAP.draws(PROMPTS))
    curve = counted.curve
    assert counted.summary["heads_to_reach_threshold"] == count
    assert counted.summary["heads_interval"] == list(interval)
    assert {count - 1, count} <= set(curve["heads_kept"])
    # the early bump is on the curve (the grid sees it): the figure shows what was measured
    assert curve[curve["heads_kept"] < 100]["explained_effect"].max() > 0.3
    rounds = count_heads(CurvePatcher(metric), list(range(N)), k_grid(N, 0, 40), THRESHOLD, BOOTSTRAP,
                         list(range(PROMPTS)), 12)
    assert rounds.summary["heads_to_reach_threshold"] == count


def _grazing():
    """Gemma-3's IOI curve in shape: just below the threshold (0.895) at a point of the coarse grid
    (605), above it (0.95) between that point and the next (1,032), back down to 0.84 at 1,032 and
    over 0.9 again only past 1,400. Each prompt wanders around the mean curve (which is exactly
    the shape), so the bootstrap band is about ±0.1 wide."""
    knots_n = np.log([1, 355, 605, 650, 800, 1032, 1400, 2000, N])
    knots_effect = [0.0, 0.3, 0.895, 0.95, 0.95, 0.84, 0.9, 0.97, 1.0]
    rng = np.random.default_rng(5)
    amplitude, frequency, phase = rng.uniform(0.2, 0.6, PROMPTS), rng.uniform(1, 4, PROMPTS), rng.uniform(0, 6, PROMPTS)

    def metric(n):
        if n == 0:
            return np.zeros(PROMPTS)
        wander = amplitude * np.cos(frequency * np.log(n) + phase)
        return np.interp(np.log(n), knots_n, knots_effect) + wander - wander.mean()
    return metric


def test_a_curve_that_grazes_the_threshold_on_the_coarse_grid_is_measured_finely_there():
    """The coarse grid alone would put the first crossing past the dip (its points 605 and 1,032
    are both below 0.9): the fine grid, measured where the band holds the threshold, finds the
    crossing the dense grid finds, and the fall back after it."""
    metric = _grazing()
    patcher = CurvePatcher(metric)
    counted = searched_count(patcher, None, _grid(), FINE, THRESHOLD, BOOTSTRAP, list(range(PROMPTS)), 40)
    count, interval = _dense(metric, BOOTSTRAP.draws(PROMPTS))
    assert 605 < count < 650
    assert counted.summary["heads_to_reach_threshold"] == count
    assert counted.summary["crosses_back_below"] and counted.summary["fragile"]
    assert counted.summary["fine_points_added"] > 0
    rounds = count_heads(CurvePatcher(metric), list(range(N)), FINE, THRESHOLD, BOOTSTRAP, list(range(PROMPTS)), 12)
    assert rounds.summary["heads_to_reach_threshold"] == count
    low, high = counted.summary["heads_interval"]
    assert {low - 1, low, high - 1, high} <= set(counted.curve["heads_kept"])
    # the low end is the dense one; near the high end the prompts' curves wander (not monotone),
    # so there the end is the first crossing on the measured n, at or above the dense one
    assert low == interval[0] and high >= interval[1]


def test_where_the_curve_crosses_inside_a_bracket_more_than_once_the_count_is_a_measured_crossing():
    """A brief touch of the threshold inside the grid's bracket, then a fall and a later climb:
    the search finds one of the crossings, an upper bound on the dense one, and says so (≤N)."""
    def metric(n):
        effect = min(1.0, n / 1000) * 0.95 if n < N else 1.0
        if 500 <= n <= 505:
            effect = 0.92  # a spike the bisection need not land on
        return np.full(PROMPTS, effect) + np.linspace(-0.01, 0.01, PROMPTS)
    patcher = CurvePatcher(metric)
    counted = searched_count(patcher, None, _grid(), FINE, THRESHOLD, BOOTSTRAP, list(range(PROMPTS)), 40)
    count, _ = _dense(metric, BOOTSTRAP.draws(PROMPTS))
    found = counted.summary["heads_to_reach_threshold"]
    curve = counted.curve.set_index("heads_kept")["explained_effect"]
    assert count == 500 and found >= count
    assert curve[found] >= THRESHOLD and curve[found - 1] < THRESHOLD  # a crossing, both sides measured
    assert (curve[curve.index < found] < THRESHOLD).all()  # the first among the measured n
    assert crossing(counted.curve, THRESHOLD)["heads_to_reach_exact"] is False


def test_without_points_for_the_interval_its_ends_are_measured_n_and_marked_as_not_found():
    metric = _climbing(0)
    counted = searched_count(CurvePatcher(metric), None, _grid(), FINE, THRESHOLD, BOOTSTRAP, list(range(PROMPTS)), 0)
    low, high = counted.summary["heads_interval"]
    measured = set(counted.curve["heads_kept"])
    assert low in measured and high in measured
    assert counted.summary["interval_points_added"] == 0
    assert counted.summary["interval_to_the_head"] == (interval_gaps(measured, low, high) == [])
    _, (dense_low, dense_high) = _dense(metric, BOOTSTRAP.draws(PROMPTS))
    assert low >= dense_low and high >= dense_high  # each resample's count is an upper bound


def test_the_search_never_measures_an_n_twice_and_keeps_the_grid():
    patcher = CurvePatcher(_bumpy(0))
    grid = _grid()
    means, metrics, added = search_points(lambda n: patcher.per_prompt(n), grid, FINE, THRESHOLD,
                                          BOOTSTRAP.draws(PROMPTS), 0.95, 40)
    assert len(patcher.measured) == len(set(patcher.measured)) == len(means)
    assert set(grid) <= set(means) and set(means) == set(metrics)
    assert not (set(added["crossing"]) | set(added["interval"]) | set(added["fine"])) & set(grid)
    assert set(added["fine"]) <= set(FINE)


def test_a_curve_without_an_effect_is_refused():
    with pytest.raises(ValueError, match="explained effect is undefined"):
        searched_count(CurvePatcher(lambda n: np.ones(PROMPTS)), None, _grid(), FINE, THRESHOLD, BOOTSTRAP,
                       list(range(PROMPTS)), 4)


def test_head_sweeps_search_the_configured_ranking_and_take_the_coarse_grid_for_the_other():
    """sweep_heads' choice of points (steps.circuits._head_count): with search bisection the
    configured ranking is searched from the coarse grid with the rounds' grid as the fine one,
    to its first crossing and interval; the other ranking is measured on the coarse grid only.
    With rounds, as before: the grid, refined for the configured ranking only."""
    from attnlab.config.settings import Sweep
    from attnlab.steps.circuits import _head_count

    order = list(range(N))
    settings = Sweep(seed=0, ablation="corrupted", ranking="exact", batch_size=8, device="cpu", all_k_up_to=0,
                     log_points=40, search="bisection", coarse_points=16, threshold=THRESHOLD,
                     sweep_other_ranking=True, mean_pool=64, bootstrap={"n_resamples": 200, "confidence": 0.95},
                     mib_sizes=False)  # MIB's sizes on top: test_areas
    bootstrap = Bootstrap(200, 0.95, 0)
    prompt_ids = list(range(PROMPTS))
    coarse, fine = k_grid(N, 0, 16), k_grid(N, 0, 40)

    searched = CurvePatcher(_climbing())
    counted = _head_count(searched, order, settings, bootstrap, prompt_ids, configured=True)
    reference = searched_count(CurvePatcher(_climbing()), order, coarse, fine, THRESHOLD, bootstrap,
                               prompt_ids, 40)
    assert counted.summary == reference.summary and counted.summary["search"] == "bisection"
    assert set(coarse) <= set(searched.measured)

    other = CurvePatcher(_climbing())
    _head_count(other, order, settings, bootstrap, prompt_ids, configured=False)
    assert sorted(set(other.measured)) == coarse

    rounds = dataclasses.replace(settings, search="rounds")
    for configured in (True, False):
        swept = CurvePatcher(_climbing())
        _head_count(swept, order, rounds, bootstrap, prompt_ids, configured=configured)
        assert set(fine) <= set(swept.measured)
        assert (len(set(swept.measured)) > len(fine)) == configured  # refined only when configured
