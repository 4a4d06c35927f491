"""Counts that never reach the threshold, and resamples that have no explained effect.

A resample whose m(all) equals its m(0) (no clean−corrupted gap) has no explained effect: the
interval skips it and reports how many it skipped (``undefined_resamples``), as the workflow
test's hand reference does; only a resample whose curve stays below the threshold is "never".
With the schema's threshold ≤ 1 every defined curve reaches it at k = all (its explained effect
is 1 there), so a count that never reaches it needs a threshold above 1 (the library takes one):
here, end to end, its table row, its interval with a missing end and the figures' "never"
branches, drawn under the strict text check.
"""

import json

import numpy as np
import pandas as pd
import pytest

from attnlab.circuits.counting import Bootstrap, count_heads, ratio_between
from attnlab.circuits.curves import count_interval, refined_sweep, renamed_unit, resample_draws


class TablePatcher:
    """A stand-in for pruning.Patcher (or EdgeCircuits) over a table of per-prompt metrics [k, prompts]."""

    def __init__(self, metrics: np.ndarray):
        self.metrics = metrics

    def kept(self, order, k):
        return k

    def per_prompt(self, k):
        return float(self.metrics[k].mean()), self.metrics[k].copy()

    def sweep(self, order, ks, threshold=None):
        per_prompt = {}

        def metric_at(k):
            mean, per_prompt[k] = self.per_prompt(k)
            return mean
        return refined_sweep(metric_at, len(order), ks, threshold), per_prompt


def _without_a_gap() -> np.ndarray:
    """[k = 0..10, 3 prompts]: prompt 0 flat at 0.5 (m(all) = m(0)), prompt 1 concave, prompt 2
    linear: a resample drawing prompt 0 alone (1 in 27) has no explained effect."""
    k = np.arange(11) / 10
    return np.stack([np.full(11, 0.5), np.sqrt(k), 2 * k], axis=1)


def _by_hand(ks, metrics, draws, threshold):
    """Each resample's first k at the threshold, skipping those without a gap (the workflow
    test's reference, tests/test_workflow.py)."""
    counts, skipped = [], 0
    for rows in draws:
        metric = metrics[:, rows].mean(axis=1)
        gap = metric[-1] - metric[0]
        if gap == 0:
            skipped += 1
            continue
        reached = ks[(metric - metric[0]) / gap >= threshold]
        counts.append(reached[0] if len(reached) else np.inf)
    return np.array(counts, dtype=float), skipped


def test_a_resample_without_a_gap_is_skipped_and_counted_not_never():
    ks, metrics = np.arange(11), _without_a_gap()
    draws = resample_draws(3, 1000, seed=0)
    interval = count_interval(ks, metrics, 0.9, draws, 0.95)
    counts, skipped = _by_hand(ks, metrics, draws, 0.9)
    assert skipped == int((draws == 0).all(axis=1).sum()) > 25  # more than the 2.5% tail
    assert interval["undefined_resamples"] == skipped
    assert np.isnan(interval["counts"]).sum() == skipped and not np.isinf(interval["counts"]).any()
    low, high = np.quantile(counts, 0.025, method="lower"), np.quantile(counts, 0.975, method="higher")
    assert (interval["low"], interval["high"]) == (int(low), int(high))  # no "never" end
    assert interval["never_share"] == 0
    # the same through a sweep: its summary reports the skipped resamples
    counted = count_heads(TablePatcher(metrics), list(range(10)), list(range(11)), 0.9,
                          Bootstrap(1000, 0.95, 0), [0, 1, 2])
    assert counted.summary["undefined_resamples"] == skipped
    assert counted.summary["heads_interval"] == [int(low), int(high)]
    assert counted.summary["never_reached_share"] == 0
    # and an N× against it: those resamples have no ratio
    rows = counted.per_prompt
    ratio = ratio_between(rows, rows, True, 0.9, Bootstrap(1000, 0.95, 0))
    assert ratio["undefined_share"] == pytest.approx(skipped / 1000)
    assert (ratio["low"], ratio["high"]) == (1.0, 1.0)


THRESHOLD = 1.05
N_PROMPTS = 10


def _overshooting(units: int) -> np.ndarray:
    """[k, prompts]: a climb to 1 at k = 4, then 1.2 for half the prompts and 0.95 for the others
    until all units are kept (1): the whole sample reaches 1.05 at k = 4, a resample with fewer
    than 4 of the first half never does (about 17% of them)."""
    k = np.arange(units + 1)[:, None]
    after = np.where(np.arange(N_PROMPTS) < N_PROMPTS // 2, 1.2, 0.95)[None, :]
    metrics = np.where(k < 4, k / 4 * np.ones(N_PROMPTS), after)
    metrics[-1] = 1.0
    return metrics


def _linear(units: int) -> np.ndarray:
    """[k, prompts]: k / units for every prompt, scaled per prompt: never above 1."""
    return np.arange(units + 1)[:, None] / units * np.linspace(0.5, 1.5, N_PROMPTS)[None, :]


def _kept_figures(monkeypatch) -> list:
    """The figures the circuit plots save; each still goes through the saving and its strict check."""
    from attnlab.plots import circuits as plots_circuits

    figures, original = [], plots_circuits._save

    def save(fig, out_path, dpi):
        figures.append(fig)
        original(fig, out_path, dpi)
    monkeypatch.setattr(plots_circuits, "_save", save)
    return figures


def _write(name, counted, folder, unit="heads", **extra) -> dict:
    curve, rows = counted.curve.assign(ranking="exact"), counted.per_prompt.assign(ranking="exact")
    summary = {**counted.summary, "ablation": "corrupted", "ranking": "exact", "threshold": THRESHOLD,
               "counted_prompts_digest": "same", "n_prompts_counted_on": N_PROMPTS, **extra}
    if unit == "edges":
        curve, rows, summary = (renamed_unit(value) for value in (curve, rows, summary))
    paths = {"sweep": folder / f"{name}.csv", "summary": folder / f"{name}.json", "per_prompt": folder / f"{name}.parquet"}
    curve.to_csv(paths["sweep"], index=False)
    rows.to_parquet(paths["per_prompt"])
    paths["summary"].write_text(json.dumps(summary))
    return paths


def test_a_count_that_never_reaches_the_threshold_end_to_end(tmp_path, monkeypatch):
    from attnlab import steps

    figures = _kept_figures(monkeypatch)
    units, bootstrap = 12, Bootstrap(500, 0.95, 0)
    ids = list(range(N_PROMPTS))
    dense = count_heads(TablePatcher(_overshooting(units)), list(range(units)), list(range(units + 1)), THRESHOLD,
                        bootstrap, ids)
    copy = count_heads(TablePatcher(_linear(units)), list(range(units)), list(range(units + 1)), THRESHOLD,
                       bootstrap, ids)
    # the whole sample reaches it, a resample in ~17% never does: an interval without an upper end
    assert dense.summary["heads_to_reach_threshold"] == 4 and dense.summary["heads_interval"] == [4, None]
    assert 0.025 < dense.summary["never_reached_share"] < 0.5 and dense.summary["undefined_resamples"] == 0
    # never, in the whole sample and in every resample
    assert copy.summary["heads_to_reach_threshold"] is None and copy.summary["heads_interval"] == [None, None]
    assert copy.summary["never_reached_share"] == 1.0
    paths = {"dense": _write("dense", dense, tmp_path), "copy": _write("copy", copy, tmp_path)}
    settings = {"n_resamples": 500, "confidence": 0.95, "seed": 0}

    # the pruning figure: "never" in the legend, the missing end printed, no N× label
    steps.plot_pruning(paths, tmp_path / "pruning.png", "ioi", ["dense", "copy"], THRESHOLD, "corrupted",
                       "exact", settings, 50)
    legend = [text.get_text() for text in figures[-1].axes[0].get_legend().get_texts()]
    assert legend[0].startswith("dense (4 [4, never] heads to 1.05") and legend[1].startswith(
        "copy (never [never, never] heads to 1.05")
    assert not [text.get_text() for text in figures[-1].texts if "fewer" in text.get_text() or " more " in
                text.get_text()]

    # the table: the copy's row has no count and no N×; the dense model's interval no upper end
    (tmp_path / "density.json").write_text(json.dumps({"heldout_density": 0.1, "heldout_kl": 0.1}))
    steps.heads_vs_density({f"{m}/ioi": paths[m]["summary"] for m in paths},
                           {f"{m}/ioi": paths[m]["sweep"] for m in paths},
                           {f"{m}/ioi": paths[m]["per_prompt"] for m in paths},
                           {"copy": tmp_path / "density.json"}, [["dense", "copy"]], {"ioi": N_PROMPTS}, settings,
                           tmp_path / "table.csv", tmp_path / "density.png", 50)
    table = pd.read_csv(tmp_path / "table.csv").set_index("label")
    assert np.isnan(table.loc["copy", "heads_to_reach_threshold"]) and np.isnan(table.loc["copy", "heads_fewer"])
    assert table.loc["dense", "heads_low"] == 4 and np.isnan(table.loc["dense", "heads_high"])
    assert (tmp_path / "density.png").stat().st_size > 0
    arrows = [text for text in figures[-1].axes[0].texts if text.get_text() == ""]
    assert len(arrows) == 1  # the dense count's interval points up: its upper end is never

    # the circuit figure of an edge sweep that never reaches it: every edge drawn, "never" said
    from attnlab.interventions.edges import Graph

    graph = Graph(n_layers=2, n_heads=2, n_kv_heads=1)
    edges = graph.edges()
    edges["score"] = np.linspace(1, -1, len(edges))
    edges["rank"] = edges["score"].abs().rank(ascending=False, method="first").astype(int)
    edges.to_parquet(tmp_path / "edges.parquet")
    n = len(edges)
    never = count_heads(TablePatcher(_linear(n)), list(range(n)), list(range(n + 1)), THRESHOLD, bootstrap, ids)
    summary = {**renamed_unit(never.summary), "task": "ioi", "threshold": THRESHOLD, "edges": n,
               "layers": 2, "heads": 2, "kv_heads": 1}
    assert summary["edges_to_reach_threshold"] is None
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    steps.plot_circuit(tmp_path / "edges.parquet", tmp_path / "summary.json", tmp_path / "circuit.png", "m", 50)
    title = figures[-1]._suptitle.get_text().replace("\n", " ")
    assert f"(never of {n:,} edges)" in title and f"all {n:,} edges drawn" in title
    assert (tmp_path / "circuit.png").stat().st_size > 0
