"""Explained-effect curves without torch: the sweep over a grid refined at the crossing, the
heads needed to reach a threshold, and when that count is fragile. The pruning jobs
(``attnlab.patching.heads``) compute the curves; the figures and tables read them with this alone.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pandas as pd
from tqdm import tqdm


def refined_sweep(metric_at: Callable[[int], float], n_heads: int, ks: list[int],
                  threshold: float | None = None, refine_points: int | None = None) -> pd.DataFrame:
    """``metric_at(k)`` for every k of the grid, then for every k strictly between the
    last grid point below ``threshold`` and the first at or above it, so that the grid's
    first crossing is found to the head rather than to the grid's step (an upper bound on the
    fewest heads unless every k below it is measured: ``crossing``). With ``refine_points``
    (edges: brackets of hundreds), rounds of that many log-spaced k inside the bracket of the
    first crossing instead, until the bracket closes: the same crossing where the curve climbs
    monotonically inside the bracket, for a few dozen k.
    Columns: heads_kept, metric, explained_effect, refined (k added by the refinement).
    """
    if 0 not in ks or n_heads not in ks:
        raise ValueError(f"the sweep grid must hold 0 and all {n_heads} heads (the effect's end points)")
    grid = sorted(set(ks))
    metrics = {k: metric_at(k) for k in tqdm(grid, desc="sweep", unit="k", mininterval=10)}
    none_kept, all_kept = metrics[0], metrics[n_heads]
    if all_kept == none_kept:
        raise ValueError("the metric is the same with all heads and with none: explained effect is undefined")

    def effect(k: int) -> float:
        return (metrics[k] - none_kept) / (all_kept - none_kept)
    added: list[int] = []
    if threshold is not None:
        first = next((i for i, k in enumerate(grid) if effect(k) >= threshold), None)
        if first:  # index 0 (k = 0) reaching it leaves nothing to refine
            low, high = grid[first - 1], grid[first]
            while high - low > 1:
                inner = _inside(low, high, refine_points)
                for k in tqdm(inner, desc="refine", unit="k", mininterval=10):
                    metrics[k] = metric_at(k)
                added += inner
                reached = [k for k in inner if effect(k) >= threshold]
                high = reached[0] if reached else high
                low = max(k for k in [low, *inner] if k < high)
    frame = pd.DataFrame({"heads_kept": sorted(metrics)})
    frame["metric"] = [metrics[k] for k in frame["heads_kept"]]
    frame["explained_effect"] = (frame["metric"] - none_kept) / (all_kept - none_kept)
    frame["refined"] = frame["heads_kept"].isin(added)
    return frame


def renamed_unit(value, source: str = "heads", target: str = "edges"):
    """A sweep's frame (its columns) or summary (its keys, nested) with the components' name
    changed, in the fragility reasons too: the counting here names them heads; edge circuits
    write "edges" (and read back)."""
    if isinstance(value, pd.DataFrame):
        renamed = value.rename(columns=lambda column: column.replace(source, target))
        reasons = renamed.get("fragile_reasons")  # a table's, joined: "falls back to 0.85 at 12 heads"
        # text is object or (pandas 3's default) str dtype: each must have its words renamed
        if reasons is not None and (reasons.dtype == object or pd.api.types.is_string_dtype(reasons)):
            renamed["fragile_reasons"] = reasons.str.replace(f" {source}", f" {target}", regex=False)
        return renamed
    if isinstance(value, dict):
        return {key.replace(source, target).replace(f"the_{source[:-1]}", f"the_{target[:-1]}"):
                renamed_unit(item, source, target) for key, item in value.items()}  # interval_to_the_head
    if isinstance(value, list):  # fragile_reasons: "falls back to 0.85 at 12 heads"
        return [item.replace(f" {source}", f" {target}") if isinstance(item, str) else item for item in value]
    return value


def _inside(low: int, high: int, points: int | None) -> list[int]:
    """The k strictly between ``low`` and ``high`` to measure next: every one, or ``points``
    log-spaced ones."""
    if points is None or high - low - 1 <= points:
        return list(range(low + 1, high))
    spaced = np.unique(np.round(np.geomspace(low + 1, high - 1, points)).astype(int))
    return [int(k) for k in spaced]


def extend_sweep(sweep: pd.DataFrame, metrics: dict[int, float]) -> pd.DataFrame:
    """``sweep`` with the metric at more k (marked ``refined``), their explained effect taken
    against the sweep's own m(0) and m(all)."""
    none_kept, all_kept = sweep["metric"].iloc[0], sweep["metric"].iloc[-1]
    added = pd.DataFrame({"heads_kept": list(metrics), "metric": list(metrics.values()), "refined": True})
    added["explained_effect"] = (added["metric"] - none_kept) / (all_kept - none_kept)
    frame = pd.concat([sweep, added[sweep.columns]], ignore_index=True)
    return frame.sort_values("heads_kept", ignore_index=True)


def crossing(sweep: pd.DataFrame, threshold: float) -> dict:
    """What a sweep says about reaching the threshold.

    heads_to_reach_threshold: fewest measured heads whose explained effect reaches it
    (None: never). heads_to_reach_exact: every k below that number was measured too (a
    complete sweep up to it), so no fewer heads reach it. Otherwise the number is the first
    crossing found on the grid (every k between the grid points around it measured): an upper
    bound, since on a curve that is not monotonic an unmeasured k below it may reach the
    threshold as well; unmeasured_below counts those k. crosses_back_below: a measured k
    above it falls below the threshold again (dips between grid points are not seen).
    """
    needed = heads_to_reach(sweep, threshold)
    measured = set(sweep["heads_kept"])
    if needed is None:
        exact = measured == set(range(max(measured) + 1))
        unmeasured, back = None, False
    else:
        unmeasured = needed - len({k for k in measured if k < needed})
        exact = unmeasured == 0
        later = sweep[sweep["heads_kept"] > needed]
        back = bool((later["explained_effect"] < threshold).any())
    return {"heads_to_reach_threshold": needed, "heads_to_reach_exact": bool(exact),
            "unmeasured_below": unmeasured, "crosses_back_below": back}


def count_text(needed: int | None, exact: bool) -> str:
    """A count to the threshold as figures print it: "never", "17", or "≤190" for an upper
    bound (the first crossing found on a grid; see ``crossing``)."""
    if needed is None:
        return "never"
    return f"{needed}" if exact else f"≤{needed}"


GRID_COUNT = ("first crossing among the n measured (a log grid refined around it, or a bisection "
              "search) with smaller n unmeasured, an upper bound")
GRID_NOTE = f"≤N: {GRID_COUNT}"


def k_grid(n_heads: int, max_all: int = 300, points: int = 40) -> list[int]:
    """Every k for small models, a log-spaced grid (with 0 and all) for large ones."""
    if n_heads <= max_all:
        return list(range(n_heads + 1))
    grid = np.unique(np.round(np.geomspace(1, n_heads, points)).astype(int))
    return [0, *[int(k) for k in grid if 0 < k < n_heads], n_heads]


def heads_to_reach(sweep: pd.DataFrame, threshold: float) -> int | None:
    """Fewest heads kept whose explained effect reaches the threshold."""
    reached = sweep[sweep["explained_effect"] >= threshold]
    return int(reached["heads_kept"].min()) if len(reached) else None


# ---- when a count to the threshold cannot be taken at face value ----
# A count is "fragile" when any of these holds (each is recorded in sweep.json and drawn on
# the figure):
# - late jump: the curve climbs to the threshold from its foot, the last measured k at least
#   CLIMB_DEPTH below the threshold, and before that foot it had stayed within PLATEAU_BAND of
#   the foot's level for at least PLATEAU_SHARE of the model's heads. The count then says where
#   a late rise happens (often heads that hurt the task being ablated), not how many heads
#   add up to the effect: 3 heads give 0.6 and 218 give 0.9.
# - overshoot: the largest explained effect exceeds 1 by more than OVERSHOOT_TOLERANCE (heads
#   that work against the task are ablated in part of the sweep; the normalisation misleads).
# - cross-back: the curve falls below the threshold again after its first crossing.
# workflow/report/pruning.rst and docs/patching.md quote these numbers: change them together.
CLIMB_DEPTH = 0.25
PLATEAU_BAND = 0.1
PLATEAU_SHARE = 0.25
OVERSHOOT_TOLERANCE = 0.1
FRAGILITY_RULES = {"climb_depth": CLIMB_DEPTH, "plateau_band": PLATEAU_BAND,
                   "plateau_share": PLATEAU_SHARE, "overshoot_tolerance": OVERSHOOT_TOLERANCE}
FRAGILITY_DEFINITION = (
    f"fragile count: late jump = the climb to the threshold (from the last point ≥ {CLIMB_DEPTH:g} "
    f"below it) follows ≥ {PLATEAU_SHARE:.0%} of the heads within ±{PLATEAU_BAND:g} of its start; "
    f"overshoot = max explained effect − 1 > {OVERSHOOT_TOLERANCE:g}; "
    "cross-back = below the threshold again after the first crossing")


def climb(sweep: pd.DataFrame, threshold: float) -> dict:
    """The climb into the first crossing and the flat stretch before it (measured points only).

    jump_from_heads: the foot (last k before the crossing at least CLIMB_DEPTH below the
    threshold); jump_width_heads and jump_rise: heads and explained effect from the foot to the
    crossing; plateau_heads: how many heads before the foot the curve stayed within
    PLATEAU_BAND of the foot's level (plateau_level). All None without a crossing or a foot.
    """
    none = dict.fromkeys(("jump_from_heads", "jump_width_heads", "jump_rise", "plateau_heads",
                          "plateau_level"))
    needed = heads_to_reach(sweep, threshold)
    curve = sweep.sort_values("heads_kept")
    k, effect = curve["heads_kept"].to_numpy(), curve["explained_effect"].to_numpy(float)
    below = np.flatnonzero((k < (needed or 0)) & (effect <= threshold - CLIMB_DEPTH))
    if needed is None or not len(below):
        return none
    foot = below[-1]
    start = foot
    while start > 0 and abs(effect[start - 1] - effect[foot]) <= PLATEAU_BAND:
        start -= 1
    return {"jump_from_heads": int(k[foot]), "jump_width_heads": int(needed - k[foot]),
            "jump_rise": float(effect[k == needed][0] - effect[foot]),
            "plateau_heads": int(k[foot] - k[start]), "plateau_level": float(effect[foot])}


def fragility(sweep: pd.DataFrame, threshold: float) -> dict:
    """Whether the count to ``threshold`` is fragile (see FRAGILITY_DEFINITION), the measured
    climb, overshoot and cross-back, and one short reason per flag for labels."""
    n_heads = int(sweep["heads_kept"].max())
    jump = climb(sweep, threshold)
    late = jump["plateau_heads"] is not None and jump["plateau_heads"] >= PLATEAU_SHARE * n_heads
    peak = sweep.loc[sweep["explained_effect"].idxmax()]
    overshoot = max(0.0, float(peak["explained_effect"]) - 1)
    needed = heads_to_reach(sweep, threshold)
    after = sweep[sweep["heads_kept"] > needed] if needed is not None else sweep.iloc[:0]
    dip = after.loc[after["explained_effect"].idxmin()] if len(after) else None
    back = dip is not None and float(dip["explained_effect"]) < threshold
    reasons = []
    if late:
        reasons.append(f"late jump of {jump['jump_rise']:.2f} over {jump['jump_width_heads']} "
                       f"heads at {needed} heads")
    if overshoot > OVERSHOOT_TOLERANCE:
        reasons.append(f"overshoot of {overshoot:.2f} at {int(peak['heads_kept'])} heads")
    if back:
        reasons.append(f"falls back to {float(dip['explained_effect']):.2f} at {int(dip['heads_kept'])} heads")
    return {"fragile": bool(reasons), "fragile_reasons": reasons, "late_jump": bool(late), **jump,
            "max_explained_effect": float(peak["explained_effect"]), "overshoot": overshoot,
            "overshoot_at_heads": int(peak["heads_kept"]), "overshoots": overshoot > OVERSHOOT_TOLERANCE,
            "cross_back_min": float(dip["explained_effect"]) if back else None,
            "cross_back_at_heads": int(dip["heads_kept"]) if back else None,
            "fragility_rules": FRAGILITY_RULES}


def flag_fragile_counts(table: pd.DataFrame, flags: dict[tuple[str, str, str], dict]) -> pd.DataFrame:
    """Add to a heads-vs-density table (rows: label = model, base = its dense model, task,
    ablation) each count's fragility (``flags[(model, task, ablation)]``, from ``fragility``) and
    whether its N× (``heads_fewer``: the base's count over this one) rests on a fragile count of
    either."""
    table = table.copy()
    row_flags = [flags[(row.label, row.task, row.ablation)] for row in table.itertuples()]
    for key in ("fragile", "late_jump", "jump_rise", "jump_width_heads", "overshoot"):
        table[key] = [flag[key] for flag in row_flags]
    table["fragile_reasons"] = ["; ".join(flag["fragile_reasons"]) for flag in row_flags]
    fragile = {(row.label, row.task, row.ablation): row.fragile for row in table.itertuples()}
    table["heads_fewer_fragile"] = [fragile[(row.label, row.task, row.ablation)]
                                    or fragile.get((row.base, row.task, row.ablation), False)
                                    for row in table.itertuples()]
    return table


def heads_vs_density_table(pairs: list[tuple[str, str]], sweeps: dict[tuple[str, str, str], dict],
                           densities: dict[str, dict], n_prompts: dict[str, int]) -> pd.DataFrame:
    """One row per model x task x ablation of each (dense, sparse copy) pair (``sweeps`` keyed
    (model, task, ablation), each a sweep.json): heads to the threshold beside the model's
    held-out density and KL (a copy's summary.json; 1 and 0 for the dense model), and
    ``heads_fewer`` = heads the dense model needs / heads the copy needs, under the same ablation."""
    ablations = list(dict.fromkeys(ablation for _, _, ablation in sweeps))
    rows = []
    for dense, copy in pairs:
        for model in (dense, copy):
            held_out = densities.get(model, {"heldout_density": 1.0, "heldout_kl": 0.0})
            for task, n in n_prompts.items():
                for ablation in ablations:
                    sweep = sweeps[(model, task, ablation)]
                    rows.append({"label": model, "base": dense, "heldout_density": held_out["heldout_density"],
                                 "heldout_kl": held_out["heldout_kl"], "task": task, "n_prompts": n,
                                 "n_prompts_counted_on": sweep.get("n_prompts_counted_on", n),
                                 **{key: sweep[key] for key in ("ablation", "ranking", "threshold",
                                                                "heads_to_reach_threshold", "heads_to_reach_exact",
                                                                "unmeasured_below", "crosses_back_below")}})
    table = pd.DataFrame(rows).drop_duplicates(["label", "base", "task", "ablation"], ignore_index=True)
    needed = table.set_index(["label", "task", "ablation"])["heads_to_reach_threshold"]
    table["heads_fewer"] = [heads_ratio(needed.get((row.base, row.task, row.ablation)), row.heads_to_reach_threshold)
                            for row in table.itertuples()]
    return table


def heads_ratio(dense, copy) -> float:
    """dense / copy; NaN where either never reaches the threshold."""
    if dense is None or copy is None or pd.isna(dense) or pd.isna(copy) or copy == 0:
        return float("nan")
    return float(dense) / float(copy)


# ---- intervals over prompts: the bootstrap of a count to the threshold ----
# A count is measured on a sample of prompts. Resampling those prompts (with replacement)
# and recomputing the explained-effect curve from the per-prompt metrics at every measured k
# gives the count's sampling spread without another forward pass. Two counts compared as an
# N× are resampled with the same draws when they were measured on the same prompts (a model
# and its own sparse copy), independently otherwise.


def resample_draws(n_prompts: int, n_resamples: int, seed: int) -> np.ndarray:
    """Prompt indices of each bootstrap resample: [n_resamples, n_prompts], seeded."""
    return np.random.default_rng(seed).integers(0, n_prompts, size=(n_resamples, n_prompts))


def per_prompt_matrix(per_prompt: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(the measured k, ascending; the metric of each prompt at each k: [k, prompts]) from
    long rows (heads_kept, prompt, metric) of one curve."""
    wide = per_prompt.pivot(index="heads_kept", columns="prompt", values="metric").sort_index()
    if wide.isna().any().any():
        raise ValueError("per-prompt metrics missing for some k: every prompt is measured at every k")
    return wide.index.to_numpy(), wide.to_numpy(float)


def resampled_effects(metrics: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """Explained effect at every k for each resample: [resamples, k]; the first k is none kept,
    the last all kept (a row of NaN where a resample's m(all) equals its m(0): its explained
    effect is undefined, and the intervals skip that resample)."""
    means = np.stack([metrics[:, rows].mean(-1) for rows in draws])  # [resamples, k]
    span = means[:, -1:] - means[:, :1]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(span != 0, (means - means[:, :1]) / span, np.nan)


def first_reaching(ks: np.ndarray, effects: np.ndarray, threshold: float) -> np.ndarray:
    """Per resample, the fewest measured heads whose explained effect reaches ``threshold``: inf
    where none does ("never"), NaN where the resample's explained effect is undefined (its
    m(all) equals its m(0): a row of NaN from ``resampled_effects``), which is no count at all."""
    reached = effects >= threshold
    counts = np.where(reached.any(-1), ks[reached.argmax(-1)].astype(float), np.inf)
    return np.where(np.isnan(effects).all(-1), np.nan, counts)


def order_interval(values: np.ndarray, confidence: float) -> tuple[float, float]:
    """The central ``confidence`` interval of resampled values as order statistics (no
    interpolation: counts stay whole numbers, inf stays "never"); NaN values are dropped."""
    values = np.sort(values[~np.isnan(values)])
    if not len(values):
        return float("nan"), float("nan")
    tail = (1 - confidence) / 2
    return float(np.quantile(values, tail, method="lower")), float(np.quantile(values, 1 - tail, method="higher"))


def count_interval(ks: np.ndarray, metrics: np.ndarray, threshold: float, draws: np.ndarray,
                   confidence: float) -> dict:
    """The bootstrap interval of the heads needed to reach ``threshold`` and the pointwise band
    of the curve. Each resample's count is its first crossing among the measured k, so an end of
    the interval is exact (to the head) only where the k just below it were measured
    (``interval_gaps``). A resample whose m(all) equals its m(0) has no explained effect: it is
    skipped (``undefined_resamples`` counts them), not counted as never reaching the threshold;
    ``never_share`` is the share of the other resamples that never reach it (None when no
    resample has an explained effect)."""
    effects = resampled_effects(metrics, draws)
    counts = first_reaching(ks, effects, threshold)
    low, high = order_interval(counts, confidence)
    tail = 100 * (1 - confidence) / 2
    defined = counts[~np.isnan(counts)]
    return {"counts": counts, "low": _whole(low), "high": _whole(high),
            "never_share": float(np.isinf(defined).mean()) if len(defined) else None,
            "undefined_resamples": int(len(counts) - len(defined)),
            "band_low": np.nanpercentile(effects, tail, axis=0),
            "band_high": np.nanpercentile(effects, 100 - tail, axis=0)}


def _whole(value: float) -> int | None:
    """A count as JSON holds it: None for never (inf) or undefined (NaN)."""
    return None if not np.isfinite(value) else int(value)


def interval_gaps(measured, low: int | None, high: int | None) -> list[int]:
    """The unmeasured k just below each end of the interval, back to the measured k before it:
    measuring them finds each end to the head, as the refinement around the count's own crossing
    does (``refined_sweep``). An end that is never reached needs none."""
    measured = sorted(set(int(k) for k in measured))
    gaps: set[int] = set()
    for end in (low, high):
        if end is not None:
            start = max((k for k in measured if k < end), default=0)
            gaps.update(k for k in range(start + 1, end) if k not in measured)
    return sorted(gaps)


def ratio_interval(counts_first: np.ndarray, counts_second: np.ndarray, confidence: float) -> dict:
    """The interval of N× = first's count / second's over resamples (paired or not, as the
    draws behind the counts were). A resample where neither reaches the threshold, or where
    either's explained effect is undefined (a NaN count: m(all) = m(0)), has no ratio
    (undefined_share); one where only the second never does gives 0, only the first: inf."""
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = counts_first / counts_second
    low, high = order_interval(ratios, confidence)
    return {"low": low, "high": high, "undefined_share": float(np.isnan(ratios).mean())}


def interval_text(low: int | float | None, high: int | float | None, digits: int | None = None) -> str:
    """``[12, 25]``; an end that is never reached prints "never" (counts) or "∞" (ratios)."""
    def end(value):
        if value is None or (isinstance(value, float) and np.isinf(value)):
            return "never" if digits is None else "∞"
        if isinstance(value, float) and np.isnan(value):
            return "?"
        return f"{value:.{digits}f}" if digits is not None else f"{int(value)}"
    return f"[{end(low)}, {end(high)}]"
