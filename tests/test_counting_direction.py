"""The direction of N×: (units model A needs) / (units model B needs), from two different
synthetic curves whose counts are known, through every place that computes or prints it (the
bootstrap ratio, the heads-vs-density table and figure, the pruning figure's label, for heads
and for edges)."""

import json

import numpy as np
import pandas as pd
import pytest

from attnlab.circuits.counting import Bootstrap, count_heads, ratio_between
from attnlab.circuits.curves import heads_ratio, heads_vs_density_table, refined_sweep, renamed_unit

UNITS = 40
THRESHOLD = 0.88
PROMPTS = 12
# per-prompt metric b_i + a_i · f(k), a_i > 0: every resample's explained effect is f(k) / f(all),
# so every resample needs exactly as many units as the whole sample
CURVES = {"A": lambda k: k / UNITS,  # linear: 0.88 first at 36 units (35.2 rounded up)
          "B": lambda k: np.minimum(1.0, k / 10) ** 0.5}  # concave, saturating: 0.88² · 10 = 7.7 -> 8
NEEDED = {"A": 36, "B": 8}


class CurvePatcher:
    """A stand-in for pruning.Patcher (or EdgeCircuits) with per-prompt metrics b_i + a_i f(k)."""

    def __init__(self, curve, seed: int):
        rng = np.random.default_rng(seed)
        self.curve, self.scale, self.offset = curve, rng.uniform(0.5, 2.0, PROMPTS), rng.normal(0, 1, PROMPTS)

    def kept(self, order, k):
        return k

    def per_prompt(self, k):
        values = self.offset + self.scale * self.curve(k)
        return float(values.mean()), values

    def sweep(self, order, ks, threshold=None):
        per_prompt = {}

        def metric_at(k):
            mean, per_prompt[k] = self.per_prompt(k)
            return mean
        return refined_sweep(metric_at, len(order), ks, threshold), per_prompt


def _counted(name: str):
    return count_heads(CurvePatcher(CURVES[name], seed=len(name) + ord(name)), list(range(UNITS)),
                       list(range(UNITS + 1)), THRESHOLD, Bootstrap(200, 0.95, 0), list(range(PROMPTS)))


@pytest.fixture(scope="module")
def counted():
    return {name: _counted(name) for name in CURVES}


def test_the_counts_of_the_two_curves(counted):
    for name, count in counted.items():
        assert count.summary["heads_to_reach_threshold"] == NEEDED[name]
        assert count.summary["heads_interval"] == [NEEDED[name]] * 2


def test_the_ratio_is_the_first_models_count_over_the_seconds(counted):
    per_prompt = {name: count.per_prompt for name, count in counted.items()}
    bootstrap = Bootstrap(200, 0.95, 0)
    forward = ratio_between(per_prompt["A"], per_prompt["B"], True, THRESHOLD, bootstrap)
    backward = ratio_between(per_prompt["B"], per_prompt["A"], False, THRESHOLD, bootstrap)
    assert (forward["low"], forward["high"]) == (4.5, 4.5)  # 36 / 8
    assert (backward["low"], backward["high"]) == (8 / 36, 8 / 36)
    assert heads_ratio(36, 8) == 4.5 and heads_ratio(8, 36) == pytest.approx(8 / 36)


def test_the_heads_vs_density_table_divides_the_dense_count_by_the_copys(counted):
    sweeps = {(name, "ioi", "corrupted"): {"ablation": "corrupted", "ranking": "exact", "threshold": THRESHOLD,
                                           **{key: count.summary[key] for key in (
                                               "heads_to_reach_threshold", "heads_to_reach_exact", "unmeasured_below",
                                               "crosses_back_below")}}
              for name, count in counted.items()}
    table = heads_vs_density_table([("A", "B")], sweeps, {"B": {"heldout_density": 0.1, "heldout_kl": 0.1}},
                                   {"ioi": PROMPTS}).set_index("label")
    assert table.loc["B", "heads_fewer"] == 4.5 and table.loc["A", "heads_fewer"] == 1.0
    # the copy needing more than its base: N× below 1
    table = heads_vs_density_table([("B", "A")], sweeps, {"A": {"heldout_density": 0.1, "heldout_kl": 0.1}},
                                   {"ioi": PROMPTS}).set_index("label")
    assert table.loc["A", "heads_fewer"] == pytest.approx(8 / 36)


def _write(counted, folder, unit: str) -> dict:
    """Each model's sweep as the workflow writes it (heads: sweep.csv with a ranking column,
    sweep.json, per_prompt.parquet; edges: the same renamed to edges)."""
    paths = {}
    for name, count in counted.items():
        curve, rows = count.curve.assign(ranking="exact"), count.per_prompt.assign(ranking="exact")
        summary = {**count.summary, "ablation": "corrupted", "ranking": "exact", "threshold": THRESHOLD,
                   "counted_prompts_digest": "same prompts", "n_prompts_counted_on": PROMPTS}
        if unit == "edges":
            curve, rows, summary = (renamed_unit(value) for value in (curve, rows, summary))
        paths[name] = {"sweep": folder / f"{name}.csv", "summary": folder / f"{name}.json",
                       "per_prompt": folder / f"{name}.parquet"}
        curve.to_csv(paths[name]["sweep"], index=False)
        rows.to_parquet(paths[name]["per_prompt"])
        paths[name]["summary"].write_text(json.dumps(summary))
    return paths


def _kept_figures(monkeypatch) -> list:
    """The figures the circuit plots save, kept to read what they drew; each still goes through
    the saving (and its strict text check)."""
    from attnlab.plots import circuits as plots_circuits

    figures, original = [], plots_circuits._save

    def save(fig, out_path, dpi):
        figures.append(fig)
        original(fig, out_path, dpi)
    monkeypatch.setattr(plots_circuits, "_save", save)
    return figures


@pytest.mark.parametrize("unit", ["heads", "edges"])
def test_the_pruning_figure_says_which_model_needs_fewer(counted, tmp_path, monkeypatch, unit):
    from attnlab import steps

    figures = _kept_figures(monkeypatch)
    paths = _write(counted, tmp_path, unit)
    bootstrap = {"n_resamples": 200, "confidence": 0.95, "seed": 0}
    for compare, want in ((["A", "B"], f"4.5× fewer {unit} for B than A at 0.88, N× [4.50, 4.50]"),
                          (["B", "A"], f"4.5× more {unit} for A than B (N× = 0.22, N× [0.22, 0.22])")):
        steps.plot_pruning(paths, tmp_path / "p.png", "ioi", compare, THRESHOLD, "corrupted", "exact", bootstrap,
                           50, unit=unit)
        texts = [text.get_text() for text in figures[-1].texts]
        assert any(text.startswith(want) for text in texts), texts
        legend = [text.get_text() for text in figures[-1].axes[0].get_legend().get_texts()]
        assert legend == [f"A (36 [36, 36] {unit} to 0.88)", f"B (8 [8, 8] {unit} to 0.88)"]


def test_the_heads_vs_density_step_labels_dense_over_copy(counted, tmp_path, monkeypatch):
    from attnlab import steps

    figures = _kept_figures(monkeypatch)
    paths = _write(counted, tmp_path, "heads")
    (tmp_path / "copy.json").write_text(json.dumps({"heldout_density": 0.1, "heldout_kl": 0.1}))
    steps.heads_vs_density({f"{name}/ioi": paths[name]["summary"] for name in counted},
                           {f"{name}/ioi": paths[name]["sweep"] for name in counted},
                           {f"{name}/ioi": paths[name]["per_prompt"] for name in counted},
                           {"B": tmp_path / "copy.json"}, [["A", "B"]], {"ioi": PROMPTS},
                           {"n_resamples": 200, "confidence": 0.95, "seed": 0}, tmp_path / "table.csv",
                           tmp_path / "density.png", 50)
    table = pd.read_csv(tmp_path / "table.csv").set_index("label")
    assert table.loc["B", "heads_to_reach_threshold"] == 8 and table.loc["A", "heads_to_reach_threshold"] == 36
    assert table.loc["B", ["heads_fewer", "heads_fewer_low", "heads_fewer_high"]].tolist() == [4.5, 4.5, 4.5]
    labels = [text.get_text() for text in figures[-1].axes[0].texts]
    assert labels == ["4.5× [4.50, 4.50]"]


def test_an_edge_tables_words_say_edges_whatever_the_text_dtype():
    """A fragility reason of an edge count reads "edges", in a table whose text column is pandas'
    str dtype (pandas 3's default: "falls back ... at 20790 heads" stayed so) or object."""
    for dtype in ("str", object):
        table = pd.DataFrame({"heads_to_reach_threshold": [583],
                              "fragile_reasons": pd.Series(["falls back to 0.90 at 20790 heads", None], dtype=dtype)[:1]})
        renamed = renamed_unit(table)
        assert list(renamed.columns) == ["edges_to_reach_threshold", "fragile_reasons"]
        assert renamed["fragile_reasons"].iloc[0] == "falls back to 0.90 at 20790 edges"
    assert renamed_unit({"fragile_reasons": ["overshoot of 0.12 at 40 heads"]}) == {
        "fragile_reasons": ["overshoot of 0.12 at 40 edges"]}
