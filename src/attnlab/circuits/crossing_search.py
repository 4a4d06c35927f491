"""A count to the threshold found by search rather than by a dense grid, with its bootstrap
interval: for sweeps whose every point is costly (an edge circuit: one patched forward over the
counted prompts per n, and thousands of n).

``counting.count_heads`` measures a log grid, refines the bracket of its first crossing in
rounds of log-spaced points and then measures a fixed number of points below the interval's
ends. Here a coarse log grid is measured first, and then every further point is chosen one at a
time, after the last one's result, taking the curve and its bootstrap band again each time:

1. **The fine grid where the curve is near the threshold.** Between two adjacent measured n,
   either of which has the threshold inside its bootstrap band (the pointwise interval of the
   resampled curves: some resamples cross nearby), the point of a fine log grid (the rounds'
   grid) nearest their geometric midpoint is measured, until no such pair has a fine-grid point
   between them. The curve is so measured as finely as the dense grid wherever it comes near the
   threshold (a first crossing, a curve that falls back, a bump that almost reaches it) and
   coarsely elsewhere.
2. **The count.** The first measured n whose explained effect reaches the threshold, with the
   measured n just below it; while they are not adjacent, the midpoint between them is measured
   (bisection). Every measured n above the final count reaches the threshold and every one
   below it that the search measured does not, so the count is the first crossing among the
   measured n, and n − 1 is measured and below. Where the curve climbs monotonically inside the
   bracket that is the first crossing a sweep of every n finds (and the one the rounds of
   ``curves.refined_sweep`` find); where it does not, it is one crossing inside the bracket. As
   every count off a grid it is an upper bound on the fewest n ("≤N": ``curves.crossing``).
3. **The interval.** The bootstrap interval over the counted prompts is taken, as for every
   count, from each resample's first crossing among the measured n (``curves.count_interval``),
   so its ends are measured points. An end whose n − 1 is unmeasured is bisected the same way:
   the midpoint between it and the measured n below it is measured and the interval taken
   again, until both ends have their predecessor measured (``interval_to_the_head``) or
   ``interval_points`` points are spent (then ``interval_to_the_head`` is false: an end is then
   the first crossing on the measured n of the resample that sets it, an upper bound). Where
   every prompt's metric climbs monotonically near an end, the end is the one a sweep of every
   n gives: at least as many resamples cross at or below the end's predecessor as below it.

Each point may move the count (a curve that is not monotonic), an end or the band, so steps 1-3
start again after every point, in that order. Cost: the coarse grid, a few fine points per
stretch near the threshold, and about log2 of each bracket's width for the count and for each
end of the interval.

No torch here: the points are measured through a patcher handed in (``kept`` and
``per_prompt``, as ``patching.edges.EdgeCircuits`` and ``patching.heads.Patcher`` have them).
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import pandas as pd
from tqdm import tqdm

from attnlab.circuits.counting import FEW_COUNTED_PROMPTS, Bootstrap, Counted
from attnlab.circuits.curves import count_interval, crossing, fragility

log = logging.getLogger(__name__)

SEARCH = "bisection"


def _effects(means: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
    """The measured n, ascending, and the mean curve's explained effect at each."""
    ks = np.array(sorted(means))
    values = np.array([means[k] for k in ks])
    span = values[-1] - values[0]
    if span == 0:
        raise ValueError("the metric is the same with all components and with none: explained effect is undefined")
    return ks, (values - values[0]) / span


def _open_bracket(ks: np.ndarray, end: int | None) -> tuple[int, int] | None:
    """(the measured n just below ``end``, ``end``) while an n between them is unmeasured."""
    if end is None:
        return None
    below = ks[ks < end]
    if len(below) and end - int(below[-1]) > 1:
        return int(below[-1]), end
    return None


def _first_reaching(ks: np.ndarray, effects: np.ndarray, threshold: float) -> int | None:
    reached = np.flatnonzero(effects >= threshold)
    return int(ks[reached[0]]) if len(reached) else None


def _fine_point_inside(fine: np.ndarray, low: int, high: int) -> int | None:
    """The point of the fine grid strictly between ``low`` and ``high`` nearest their geometric
    midpoint (None when there is none)."""
    inside = fine[(fine > low) & (fine < high)]
    if not len(inside):
        return None
    middle = np.sqrt(max(low, 1) * high)
    return int(inside[np.argmin(np.abs(np.log(inside) - np.log(middle)))])


def search_points(measure: Callable[[int], tuple[float, np.ndarray]], grid: list[int], fine: list[int],
                  threshold: float, draws: np.ndarray, confidence: float, interval_points: int
                  ) -> tuple[dict[int, float], dict[int, np.ndarray], dict[str, list[int]]]:
    """Measure ``grid`` (with 0 and all), then, one n at a time: the points of ``fine`` next to
    any measured n whose bootstrap band holds the threshold, the count's crossing and the
    interval's ends (module docstring). ``measure(n)``: the mean metric and each prompt's with n
    components kept. Returns the means, the per-prompt metrics and the n added (``fine``,
    ``crossing``, ``interval``)."""
    if not grid or min(grid) != 0:
        raise ValueError("the grid must hold 0 and all components (the explained effect's end points)")
    fine_points = np.array(sorted(set(fine)))
    means: dict[int, float] = {}
    metrics: dict[int, np.ndarray] = {}
    for n in tqdm(sorted(set(grid)), desc="sweep", unit="n", mininterval=10):
        means[n], metrics[n] = measure(n)
    added: dict[str, list[int]] = {"fine": [], "crossing": [], "interval": []}

    def take(n: int, why: str) -> None:
        means[n], metrics[n] = measure(n)
        added[why].append(n)
        log.debug("%s: measured n = %d", why, n)

    while True:
        ks, effects = _effects(means)
        interval = count_interval(ks, np.stack([metrics[k] for k in ks]), threshold, draws, confidence)
        near = (interval["band_low"] <= threshold) & (threshold <= interval["band_high"])
        finer = next((point for i in range(len(ks) - 1) if near[i] or near[i + 1]
                      for point in [_fine_point_inside(fine_points, int(ks[i]), int(ks[i + 1]))] if point is not None),
                     None)
        if finer is not None:
            take(finer, "fine")
            continue
        bracket = _open_bracket(ks, _first_reaching(ks, effects, threshold))
        if bracket:
            take(sum(bracket) // 2, "crossing")
            continue
        if len(added["interval"]) >= interval_points:
            break
        brackets = [b for b in (_open_bracket(ks, interval["low"]), _open_bracket(ks, interval["high"])) if b]
        if not brackets:
            break
        take(sum(brackets[0]) // 2, "interval")
    return means, metrics, added


def searched_count(patcher, order, grid: list[int], fine: list[int], threshold: float, bootstrap: Bootstrap,
                   prompt_ids: list[int], interval_points: int) -> Counted:
    """``counting.count_heads`` by search (module docstring): the curve on ``grid`` and the
    searched points, each prompt's metric at every measured n, and the summary's keys as
    ``count_heads`` writes them (components named heads, as the counting names them), with
    ``search`` and the points each part added."""
    if list(prompt_ids) != sorted(prompt_ids):
        raise ValueError("searched_count needs the counted prompts in ascending order of their ids")
    if len(prompt_ids) < FEW_COUNTED_PROMPTS:
        log.warning("the count's interval rests on %d counted prompts (fewer than %d): read it as a "
                    "rough spread; raise the task's n", len(prompt_ids), FEW_COUNTED_PROMPTS)
    draws = bootstrap.draws(len(prompt_ids))
    means, metrics, added = search_points(lambda n: patcher.per_prompt(patcher.kept(order, n)), grid, fine,
                                          threshold, draws, bootstrap.confidence, interval_points)
    ks, effects = _effects(means)
    matrix = np.stack([metrics[k] for k in ks])
    interval = count_interval(ks, matrix, threshold, draws, bootstrap.confidence)
    searched = set(added["fine"]) | set(added["crossing"]) | set(added["interval"])
    curve = pd.DataFrame({"heads_kept": ks, "metric": [means[k] for k in ks], "explained_effect": effects,
                          "refined": [k in searched for k in ks],
                          "effect_low": interval["band_low"], "effect_high": interval["band_high"]})
    ends_open = [b for b in (_open_bracket(ks, interval["low"]), _open_bracket(ks, interval["high"])) if b]
    undefined = ({"undefined_resamples": interval["undefined_resamples"]}
                 if "undefined_resamples" in interval else {})  # resamples without an explained effect
    summary = {**crossing(curve, threshold), **fragility(curve, threshold),
               "heads_interval": [interval["low"], interval["high"]],
               "interval_to_the_head": not ends_open, "interval_points_added": len(added["interval"]),
               "never_reached_share": interval["never_share"], **undefined,
               "search": SEARCH, "grid_points": len(set(grid)), "fine_points_added": len(added["fine"]),
               "crossing_points_added": len(added["crossing"])}
    log.info("%s: %d grid points, %d of the fine grid where the band holds the threshold, %d searched for the "
             "crossing, %d for the interval's ends (%s)", SEARCH, len(set(grid)), len(added["fine"]),
             len(added["crossing"]), len(added["interval"]),
             "both found to the component" if not ends_open else "not both found: interval_points spent")
    per_prompt = pd.DataFrame({"heads_kept": np.repeat(ks, len(prompt_ids)),
                               "prompt": np.tile(prompt_ids, len(ks)),
                               "metric": matrix.reshape(-1)})
    return Counted(curve, per_prompt, summary)
