"""Shares of the total effect, with intervals over items.

A component's share in one direction is mean over items of its effect / mean over items of the
total effect (a ratio of means: an item whose total effect is near 0 would make a per-item ratio
explode); its interval is the 95% percentile bootstrap of that ratio over items resampled with
replacement (seeded), the same resamples for every component. Layer sums add a layer's heads.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

SHARE_DEFINITION = ("share = mean over items of the component's effect / mean over items of the total effect "
                    "(metric: log-probability of the treated run's answer; effects treated − baseline; "
                    "interval: 95% percentile bootstrap over items)")


def _resamples(n: int, n_resamples: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(n_resamples, n))


def mean_interval(values: np.ndarray, n_resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 95% percentile bootstrap interval of the mean of ``values`` over items (the same
    resamples as the shares'): where it holds 0, no share of the total effect means much."""
    means = values[_resamples(len(values), n_resamples, seed)].mean(1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def shares(effects: pd.DataFrame, totals: pd.Series, n_resamples: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Per direction and component (``effects``: id, direction, component, kind, layer, head,
    effect, method; ``totals``: the total effect per id): mean effect, share, its interval, how the
    effect was measured; plus one row per layer summing its heads (kind "heads")."""
    ids = list(totals.index)
    total = totals.to_numpy(float)
    draws = _resamples(len(ids), n_resamples, seed)
    denominators = total[draws].mean(1)
    heads = effects[effects["kind"] == "head"].groupby(["direction", "layer", "id"], as_index=False)["effect"].sum()
    method = effects.loc[effects["kind"] == "head", "method"].iloc[0] if (effects["kind"] == "head").any() else "exact"
    heads = heads.assign(component=[f"L{layer}.heads" for layer in heads["layer"]], kind="heads", head=-1,
                         method=method)
    rows = []
    for (direction, component), frame in pd.concat([effects, heads]).groupby(["direction", "component"], sort=False):
        values = frame.set_index("id")["effect"].reindex(ids).to_numpy(float)
        ratios = values[draws].mean(1) / denominators
        rows.append({"direction": direction, "component": component, "kind": frame["kind"].iloc[0],
                     "layer": int(frame["layer"].iloc[0]), "head": int(frame["head"].iloc[0]),
                     "method": frame["method"].iloc[0],
                     "mean_effect": float(values.mean()), "share": float(values.mean() / total.mean()),
                     "share_low": float(np.nanpercentile(ratios, 2.5)),
                     "share_high": float(np.nanpercentile(ratios, 97.5))})
    return pd.DataFrame(rows)


def top_heads_share(effects: pd.DataFrame, totals: pd.Series, n_resamples: int = 2000,
                    seed: int = 0) -> pd.DataFrame:
    """Per direction: the share of the heads that carry most of the effect patched together (the group
    rows named ``top{k}_heads``, one exact patch; the heads chosen once, on all items), with its
    interval and the heads."""
    ids, total = list(totals.index), totals.to_numpy(float)
    draws = _resamples(len(ids), n_resamples, seed)
    rows = []
    groups = effects[(effects["kind"] == "group") & effects["component"].str.match(r"top\d+_heads$")]
    for (direction, component), frame in groups.groupby(["direction", "component"], sort=False):
        values = frame.set_index("id")["effect"].reindex(ids).to_numpy(float)
        ratios = values[draws].mean(1) / total[draws].mean(1)
        rows.append({"direction": direction, "component": component, "heads": frame["members"].iloc[0],
                     "share": float(values.mean() / total.mean()), "share_low": float(np.nanpercentile(ratios, 2.5)),
                     "share_high": float(np.nanpercentile(ratios, 97.5))})
    return pd.DataFrame(rows)
