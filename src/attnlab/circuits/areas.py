"""Areas over a whole explained-effect curve: MIB's CPR and CMD, with bootstrap intervals.

A count to a threshold is one reading of a curve at one height; two models' curves can differ
everywhere else (an overshoot past 1, a late climb). MIB's circuit-localisation track (Mueller
et al. 2025, "MIB: A Mechanistic Interpretability Benchmark", arXiv 2504.13151; its code's
``evaluate_area_under_curve``) scores a circuit method by two areas over the faithfulness curve
f(p) of circuits keeping a share p of the components:

- **CPR** (circuit performance ratio): the area under f, higher is better;
- **CMD** (circuit-model difference): the area between f and 1, that is of |1 − f(p)|, lower is
  better; an overshoot past 1 counts as much as a shortfall.

Both by the trapezoid rule over the shares p = 0.1%, 0.2%, 0.5%, 1%, 2%, 5%, 10%, 20%, 50% and
100% (linear in p, so the larger circuits weigh most), each circuit keeping ``int(p × N)`` of N
components (MIB's rounding: down). The trapezoid of |1 − f| takes |1 − f| at the two measured
ends, as MIB's code does, even where f crosses 1 between them.

attnlab's explained effect is MIB's faithfulness as its paper defines it, (m(C) − m(∅)) /
(m(N) − m(∅)): m(∅) is the metric with every component ablated (k = 0), m(N) with none. attnlab
computes the areas for heads as well as for edges (MIB: edges and nodes), under each configured
ablation, and on its own grid beside MIB's sizes: every k the sweep measured, x = k / N from 0
to 1. The difference between the two is stated as the grid's discretisation (an estimate: both
are trapezoids over measured points). MIB's sizes must have been measured (``pruning.mib_sizes``);
an area is never taken on points it would have to interpolate.

Intervals: the counted prompts are resampled (``curves.resample_draws``) and each resample's
curve is normalised by its own m(∅) and m(N), as the count's interval is; a difference of two
models' areas is paired (the same resamples) when both were counted on the same prompts.
"""

from __future__ import annotations

import numpy as np

from attnlab.circuits.curves import order_interval, per_prompt_matrix, resampled_effects
from attnlab.config.plan import MIB_SHARES, mib_sizes  # the sizes a sweep measures: the plan's

AREAS = ("cpr", "cmd")


class AreaError(ValueError):
    """An area that the measured points cannot give without interpolating."""


def _trapezoid(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The trapezoid rule along the last axis (y: [..., len(x)])."""
    return ((y[..., 1:] + y[..., :-1]) / 2 * np.diff(x)).sum(-1)


def grid_areas(ks: np.ndarray, effects: np.ndarray, n_components: int) -> dict[str, np.ndarray]:
    """CPR and CMD over every measured k (x = k / N, from k = 0 to N); ``effects``: [..., len(ks)]."""
    ks = np.asarray(ks)
    if ks[0] != 0 or ks[-1] != n_components:
        raise AreaError(f"an area over the whole curve needs k = 0 and k = {n_components} measured; "
                        f"the sweep has k from {ks[0]} to {ks[-1]}")
    x = ks / n_components
    return {"cpr": _trapezoid(x, effects), "cmd": _trapezoid(x, np.abs(1 - effects))}


def mib_areas(ks: np.ndarray, effects: np.ndarray, n_components: int) -> dict[str, np.ndarray]:
    """CPR and CMD on MIB's sizes (module docstring); every size must be measured."""
    position = {int(k): i for i, k in enumerate(ks)}
    missing = sorted(set(mib_sizes(n_components)) - set(position))
    if missing:
        raise AreaError(f"MIB's areas need the curve at {missing} of {n_components} components, which the "
                        "sweep did not measure (an area is never interpolated): set pruning.mib_sizes: true "
                        "and run the sweep again")
    at = effects[..., [position[k] for k in mib_sizes(n_components)]]
    shares = np.array(MIB_SHARES)
    return {"cpr": _trapezoid(shares, at), "cmd": _trapezoid(shares, np.abs(1 - at))}


def point_effects(metrics: np.ndarray) -> np.ndarray:
    """The explained effect at every k from all prompts' mean metric ([k, prompts] -> [k]): k = 0
    is none kept, the last k all kept."""
    means = metrics.mean(-1)
    return (means - means[0]) / (means[-1] - means[0])


def curve_areas(per_prompt, n_components: int, draws: np.ndarray, confidence: float) -> dict:
    """One curve's areas from its per-prompt rows (heads_kept, prompt, metric): on MIB's sizes
    (None with ``mib_missing`` where a size was not measured) and on the measured grid, each with
    its bootstrap interval over ``draws``, and the difference between the two (the grid's
    discretisation, estimated)."""
    ks, metrics = per_prompt_matrix(per_prompt)
    effects, resampled = point_effects(metrics), resampled_effects(metrics, draws)
    out = {"components": n_components, "points": len(ks)}
    measured = {"grid": grid_areas}
    try:
        mib_areas(ks, effects, n_components)
        measured["mib"] = mib_areas
        out["mib_missing"] = None
    except AreaError as error:  # the columns stay, empty, beside the reason
        out["mib_missing"] = str(error)
        out.update({f"{name}_mib{end}": None for name in AREAS for end in ("", "_low", "_high")})
    for where, areas in measured.items():
        point, spread = areas(ks, effects, n_components), areas(ks, resampled, n_components)
        for name in AREAS:
            low, high = order_interval(spread[name], confidence)
            out[f"{name}_{where}"] = float(point[name])
            out[f"{name}_{where}_low"], out[f"{name}_{where}_high"] = low, high
    for name in AREAS:
        out[f"{name}_discretisation"] = (abs(out[f"{name}_mib"] - out[f"{name}_grid"])
                                         if "mib" in measured else None)
    return out


def area_difference(first, second, sizes: tuple[int, int], draws_first: np.ndarray, draws_second: np.ndarray,
                    confidence: float, where: str = "mib") -> dict:
    """second's areas − first's (say copy − base; ``sizes``: each one's component count), with
    the interval of the difference over resamples: paired when both draws are the same array
    (the same prompts), independent otherwise. A copy identical to its base has a difference of
    exactly 0 in every resample."""
    areas = mib_areas if where == "mib" else grid_areas
    points, spreads = [], []
    for rows, n_components, draws in ((first, sizes[0], draws_first), (second, sizes[1], draws_second)):
        ks, metrics = per_prompt_matrix(rows)
        points.append(areas(ks, point_effects(metrics), n_components))
        spreads.append(areas(ks, resampled_effects(metrics, draws), n_components))
    out = {}
    for name in AREAS:
        low, high = order_interval(spreads[1][name] - spreads[0][name], confidence)
        out[f"{name}_difference"] = float(points[1][name] - points[0][name])
        out[f"{name}_difference_low"], out[f"{name}_difference_high"] = low, high
    return out
