import numpy as np
import pandas as pd

from attnlab.plots.base import plot_accuracy, plot_length_sweep


def _cell(condition, tokens, acc, model="m"):
    row = {"model": model, "dataset": "d", "condition": condition, "n": 20, "inserted_tokens": tokens}
    for grader in ("math_verify", "lenient"):
        row.update({f"{grader}_acc": acc, f"{grader}_ci_low": acc - 10, f"{grader}_ci_high": acc + 10})
    row.update({"extracted_boxed": 0.5, "extracted_hash": 0.1, "extracted_last_number": 0.3,
                "extracted_none": 0.1, "hit_token_limit": 0.25, "n_hit_token_limit": 5})
    return row


def test_length_sweep_draws_each_kinds_accuracy_against_its_recorded_length(tmp_path, monkeypatch):
    """One line per inserted kind, through the plain prompt (0 tokens) and that kind's cells in
    order of inserted tokens, at their accuracy, per grader; the CI band spans each cell's CI."""
    table = pd.DataFrame([_cell("none", 0, 40), _cell("mless_10", 10, 45), _cell("mless_55", 55, 50),
                          _cell("mful_55", 55, 35)])
    table["lenient_substring_only"] = 0
    families = {"none": None, "mless_10": "repeat '/'", "mless_55": "repeat '/'", "mful_55": "repeat 'he'"}
    drawn = _drawn_figure(monkeypatch)
    plot_length_sweep(table, families, "m", "d", tmp_path / "sweep.png", dpi=60)
    for ax in drawn["fig"].axes:
        lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
        assert list(lines)[:2] == ["repeat '/'", "repeat 'he'"]
        assert lines["repeat '/'"].get_xdata().tolist() == [0, 10, 55]
        assert lines["repeat '/'"].get_ydata().tolist() == [40, 45, 50]
        assert lines["repeat 'he'"].get_xdata().tolist() == [0, 55]
        assert lines["repeat 'he'"].get_ydata().tolist() == [40, 35]
        band = ax.collections[0].get_paths()[0].vertices
        assert band[:, 1].min() == 30 and band[:, 1].max() == 60  # none's and mless_55's CI ends


def test_accuracy_figure_draws_each_cells_accuracy_and_interval(tmp_path, monkeypatch):
    table = pd.DataFrame([_cell("none", 0, 40), _cell("mless_10", 10, 45), _cell("mful_55", 55, 35)])
    drawn = _drawn_figure(monkeypatch)
    plot_accuracy(table, "d", ["m"], ["none", "mless_10", "mful_55"], tmp_path / "bars.png", dpi=60)
    panel = drawn["fig"].axes[0]  # math-verify: one bar per condition, in the configured order
    bars = [c for c in panel.containers if hasattr(c, "errorbar") and c.errorbar is not None]
    assert [round(c.patches[0].get_height(), 6) for c in bars] == [40, 45, 35]
    intervals = [sorted(c.errorbar.lines[2][0].get_segments()[0][:, 1].tolist()) for c in bars]
    assert intervals == [[30, 50], [35, 55], [25, 45]]  # each cell's CI


def test_the_paired_panel_draws_each_conditions_difference_from_the_baseline(tmp_path, monkeypatch):
    table = pd.DataFrame([_cell("none", 0, 40), _cell("mless", 10, 45)])
    paired = pd.DataFrame([{"model": "m", "dataset": "d", "condition": "mless", "baseline": "none", "grader": grader,
                            "difference_pts": 5.0, "ci_low_pts": -2.0, "ci_high_pts": 12.0,
                            "holm_p": 0.01 if grader == "math_verify" else 0.5}
                           for grader in ("math_verify", "lenient")])
    drawn = _drawn_figure(monkeypatch)
    plot_accuracy(table, "d", ["m"], ["none", "mless"], tmp_path / "bars.png", dpi=60, paired=paired)
    math_verify, lenient = drawn["fig"].axes[2], drawn["fig"].axes[3]
    for panel in (math_verify, lenient):
        point = panel.lines[0].get_ydata()
        assert list(point) == [5.0]  # the difference, under mless's bar
        segment = panel.collections[0].get_segments()[0][:, 1]
        assert sorted(segment.tolist()) == [-2.0, 12.0]  # its interval
        assert "Newcombe" in panel.get_title()
    assert [t.get_text() for t in math_verify.texts] == ["*"] and len(lenient.texts) == 0  # Holm < 0.05 only


def _drawn_figure(monkeypatch):
    """Keep the figure a plot function saves, to read what it drew; it is still saved, through
    the check of its text (ATTNLAB_STRICT_FIGURES, tests/conftest.py)."""
    from attnlab.plots import base as plots

    drawn, original = {}, plots._save

    def save(fig, out_path, dpi):
        drawn.update(fig=fig)
        original(fig, out_path, dpi)
    monkeypatch.setattr(plots, "_save", save)
    return drawn


def test_lenient_bars_hatch_their_substring_only_part(tmp_path, monkeypatch):
    """lenient 33% of which 17 points (1 of 6 items) are substring-only: the hatched part sits
    on top of the bar, the label says so and the legend explains the hatching."""
    from attnlab.plots.base import SUBSTRING_HATCH, SUBSTRING_LABEL

    drawn = _drawn_figure(monkeypatch)
    none = {**_cell("none", 0, 100 / 6), "n": 6, "lenient_substring_only": 0}
    mless = {**_cell("mless", 55, 100 / 3), "n": 6, "lenient_substring_only": 1}
    plot_accuracy(pd.DataFrame([none, mless]), "d", ["m"], ["none", "mless"], tmp_path / "bars.png")
    math_verify, lenient = drawn["fig"].axes[:2]
    hatched = [p for p in lenient.patches if p.get_hatch() == SUBSTRING_HATCH]
    assert [(round(p.get_y(), 3), round(p.get_height(), 3)) for p in hatched] == [(16.667, 0.0), (16.667, 16.667)]
    assert not [p for p in math_verify.patches if p.get_hatch()]
    label = next(t for t in lenient.texts if "substr." in t.get_text())
    assert label.get_text() == "33 (17 pts substr.)" and label.get_rotation() == 90
    assert "hatched: substring-only" in lenient.get_title()
    assert SUBSTRING_LABEL in [t.get_text() for t in drawn["fig"].legends[0].get_texts()]


def test_a_cell_with_nothing_to_grade_is_an_empty_bar_with_its_reason(tmp_path, monkeypatch):
    """No items, or no answer extracted from any: never a bare 0% bar."""
    drawn = _drawn_figure(monkeypatch)
    empty = {**_cell("none", 0, float("nan")), "n": 0}
    unextracted = {**_cell("mless", 55, 0.0), "n": 6, "extracted_boxed": 0.0, "extracted_hash": 0.0,
                   "extracted_last_number": 0.0, "extracted_none": 1.0}
    plot_accuracy(pd.DataFrame([empty, unextracted]), "d", ["m"], ["none", "mless"], tmp_path / "bars.png")
    for ax in drawn["fig"].axes[:2]:
        texts = [t.get_text() for t in ax.texts]
        assert "no items" in texts and "no answer extracted (6/6)" in texts
        assert not [t for t in texts if t.startswith("0") or t == "nan"]
        outlines = [p for p in ax.patches if not p.get_fill()]
        assert sum(p.get_linestyle() == "--" and p.get_height() == 100 for p in outlines) == 2


# ---- attention figures: shading from every prompt's spans ----


def _attention_file(path, prompts, n_layers=2, n_heads=3, seed=0):
    """An attention HDF5 in the extraction's format, with random received values."""
    import numpy as np

    from attnlab.extraction.extract import Extraction, write_attention

    rng = np.random.default_rng(seed)
    width = int(prompts["n_prompt_tokens"].max())
    received = [rng.random((n_heads, len(prompts), width), dtype=np.float32) for _ in range(n_layers)]
    write_attention(path, Extraction(received, [np.ones_like(r) for r in received], {}), prompts,
                    {"model": "tiny", "condition": path.stem})
    return path


def _varying_prompts(inserted: list[tuple[int, int]], length: int = 30):
    """Prompts whose inserted run sits at a different place in each (as question_random does)."""
    rows = []
    for i, (start, end) in enumerate(inserted):
        rows.append({"id": f"p{i}", "input_ids": list(range(3, 3 + length)), "n_prompt_tokens": length,
                     "system_start": 0, "system_end": 5, "inserted_start": start, "inserted_end": end,
                     "question_start": 5, "question_end": length, "cut_start": start, "cut_end": end})
    return pd.DataFrame(rows)


def _shaded(ax) -> list[tuple[float, float, float]]:
    """(start, end, alpha) of the vertical spans on an axes."""
    return sorted((p.get_x(), p.get_x() + p.get_width(), p.get_alpha()) for p in ax.patches)


def test_inserted_shading_comes_from_every_prompt(tmp_path):
    import matplotlib.pyplot as plt

    from attnlab.extraction.analysis import inserted_share, read_head
    from attnlab.plots.attention import _shade_inserted

    path = _attention_file(tmp_path / "mless_inside.h5", _varying_prompts([(8, 12), (10, 14), (20, 24)]))
    head = read_head(path, layer=1, head=2)
    share = inserted_share(head["spans"], 30)
    assert share[10:12].tolist() == [2 / 3, 2 / 3] and share[20:24].tolist() == [1 / 3] * 4
    assert share[:8].sum() == share[14:20].sum() == 0
    fig, ax = plt.subplots()
    _shade_inserted(ax, {"mless_inside": head})
    # no position is inserted in all three prompts: light shading only, over each prompt's run
    assert _shaded(ax) == [(7.5, 13.5, 0.07), (19.5, 23.5, 0.07)]
    plt.close(fig)


def test_shared_inserted_run_is_shaded_dark(tmp_path):
    import matplotlib.pyplot as plt

    from attnlab.extraction.analysis import read_head
    from attnlab.plots.attention import _shade_inserted

    path = _attention_file(tmp_path / "mless.h5", _varying_prompts([(5, 10), (5, 12), (5, 10)]))
    fig, ax = plt.subplots()
    _shade_inserted(ax, {"mless": read_head(path, layer=0, head=0)})
    assert _shaded(ax) == [(4.5, 9.5, 0.2), (9.5, 11.5, 0.07)]
    plt.close(fig)


def test_question_random_prompts_shade_each_insertion(smollm2_tokenizer, tmp_path):
    """Real question_random prompts: every prompt's inserted tokens lie in a shaded span."""
    import matplotlib.pyplot as plt

    from attnlab.extraction.analysis import inserted_share, read_head, runs_of
    from attnlab.plots.attention import plot_attention_head
    from attnlab.reasoning.prompts import make_prompts

    questions = pd.DataFrame({"id": ["a", "b", "c"], "answer": ["2", "3", "4"], "question": [
        "Tom has 3 apples and buys 4 more apples at the shop. How many apples does he have now?",
        "A train travels 60 miles in 2 hours. What is its average speed in miles per hour?",
        "If x + 2 = 5, what is the value of x?"]})
    condition = {"kind": "repeat", "unit": "/", "length": 10, "placement": "question_random"}
    prompts = make_prompts(smollm2_tokenizer, questions, "mless_inside", condition,
                           {"system": "Solve it.", "raw_template": "{system}\n{question}"}, "chat", 8192)
    assert prompts["inserted_start"].nunique() > 1  # the run's place differs between prompts
    head = read_head(_attention_file(tmp_path / "mless_inside.h5", prompts), layer=0, head=0)
    share = inserted_share(head["spans"], int(head["lengths"].max()))
    shaded = runs_of(share > 0)
    for start, end in zip(prompts["inserted_start"], prompts["inserted_end"]):
        assert any(s <= start and end <= e for s, e in shaded)
    none = _attention_file(tmp_path / "none.h5", _varying_prompts([(5, 5)] * 3))
    plot_attention_head({"none": read_head(none, 0, 0), "mless_inside": head}, "m", "d", 0, 0,
                        tmp_path / "head.png", dpi=50)
    assert (tmp_path / "head.png").stat().st_size > 5_000
    plt.close("all")


# ---- composite attention figures ----


def test_composite_figure_reads_only_its_panels_files_and_draws_every_layout(tmp_path, monkeypatch):
    from attnlab import steps
    from attnlab.config.plan import attention_figures, figure_files

    monkeypatch.chdir(tmp_path)
    figure = {"name": "heads", "view": "full", "zoom": True, "conditions": ["none", "mless_inside"],
              "panels": [{"model": "a", "layer": 0, "head": 1}, {"model": "b", "layer": 1, "head": 2}]}
    figure = attention_figures([figure], ["d"])[0]
    files = figure_files(figure)
    assert list(files) == [("a", "d", "none"), ("a", "d", "mless_inside"), ("b", "d", "none"),
                           ("b", "d", "mless_inside")]
    spans = {"none": [(5, 5)] * 3, "mless_inside": [(8, 12), (10, 14), (20, 24)]}
    for (model, dataset, condition), path in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        _attention_file(tmp_path / path, _varying_prompts(spans[condition]), seed=len(model))
    for name, view, zoom in (("zoomed", "full", True), ("aligned", "aligned", False)):
        layout = {**figure, "name": name, "view": view, "zoom": zoom}
        steps.plot_attention_figure(layout, list(files.values()), f"{name}.png",
                                    {"drop_first": True, "per_prompt": 1}, dpi=60)
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000


def test_composite_zoom_shows_the_inserted_positions(tmp_path):
    import matplotlib.pyplot as plt

    from attnlab.extraction.analysis import read_head
    from attnlab.plots.attention import _draw_conditions, _zoom_on_inserted

    per_condition = {
        "none": read_head(_attention_file(tmp_path / "none.h5", _varying_prompts([(5, 5)] * 3)), 0, 0),
        "mless": read_head(_attention_file(tmp_path / "mless.h5", _varying_prompts([(10, 14)] * 3)), 0, 0)}
    fig, ax = plt.subplots()
    _draw_conditions(ax, per_condition, False, True, 0)
    _zoom_on_inserted(ax, per_condition)
    low, high = ax.get_xlim()
    assert low < 9.5 and 13.5 < high and high - low < 15  # the 4 inserted positions, a margin
    plt.close(fig)


def test_figures_and_tables_are_drawn_without_importing_torch(tmp_path):
    """The HDF5 reader, the curve arithmetic and every figure need no torch: a plotting job
    starts without its import (a separate process, so nothing imported by other tests counts)."""
    import json
    import subprocess
    import sys

    curve = pd.DataFrame({"heads_kept": range(11), "explained_effect": np.linspace(0, 1, 11)})
    curve["metric"] = curve["explained_effect"]
    curve["ranking"] = "exact"
    per_prompt = pd.DataFrame({"heads_kept": np.repeat(range(11), 4), "prompt": np.tile(range(4), 11),
                               "metric": np.repeat(np.linspace(0, 1, 11), 4) + np.tile([0, .1, -.1, 0], 11),
                               "ranking": "exact"})
    for model in ("dense", "copy"):
        curve.to_csv(tmp_path / f"{model}.csv", index=False)
        per_prompt.to_parquet(tmp_path / f"{model}.parquet")
        (tmp_path / f"{model}.json").write_text(json.dumps(
            {"ablation": "corrupted", "ranking": "exact", "threshold": 0.9, "heads_interval": [8, 10],
             "counted_prompts_digest": "same", "heads_to_reach_threshold": 9, "crosses_back_below": False}))
    (tmp_path / "summary.json").write_text(json.dumps({"heldout_density": 0.05, "heldout_kl": 0.1}))
    script = f"""
import sys
from pathlib import Path
from attnlab import steps
import attnlab.extraction.analysis, attnlab.circuits.curves, attnlab.extraction.h5format, attnlab.plots.base
d = Path({str(tmp_path)!r})
bootstrap = {{"n_resamples": 100, "confidence": 0.95, "seed": 0}}
steps.plot_pruning({{m: {{"sweep": d / f"{{m}}.csv", "summary": d / f"{{m}}.json", "per_prompt": d / f"{{m}}.parquet"}}
                    for m in ("dense", "copy")}}, d / "ioi.png", "ioi", ["dense", "copy"], 0.9, "corrupted",
                   "exact", bootstrap, 50)
steps.heads_vs_density({{f"{{m}}/ioi": d / f"{{m}}.json" for m in ("dense", "copy")}},
                       {{f"{{m}}/ioi": d / f"{{m}}.csv" for m in ("dense", "copy")}},
                       {{f"{{m}}/ioi": d / f"{{m}}.parquet" for m in ("dense", "copy")}},
                       {{"copy": d / "summary.json"}}, [["dense", "copy"]], {{"ioi": 8}}, bootstrap,
                       d / "table.csv", d / "density.png", 50)
assert "torch" not in sys.modules, "a figure step imported torch"
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "ioi.png").stat().st_size > 0 and (tmp_path / "density.png").stat().st_size > 0
    table = pd.read_csv(tmp_path / "table.csv")
    assert table["heads_fewer"].tolist() == [1.0, 1.0]
    # the copy against its base, paired on the same prompts: every resample gives N× = 1
    assert table.loc[1, ["heads_fewer_low", "heads_fewer_high"]].tolist() == [1.0, 1.0]
    assert table.loc[1, "heads_fewer_paired"] and table.loc[1, ["heads_low", "heads_high"]].tolist() == [8, 10]


def test_an_edge_figure_of_one_model_draws_without_the_ratio_that_compare_names(tmp_path):
    """make run finds Gemma-3's edge circuit alone while pruning.compare names both models: the
    edge figure draws that one curve with its count and no N×."""
    import json

    from attnlab import steps

    curve = pd.DataFrame({"edges_kept": [0, 10, 100, 1000, 5644], "metric": [0.0, 0.3, 0.6, 0.95, 1.0]})
    curve["explained_effect"], curve["refined"] = curve["metric"], False
    per_prompt = pd.DataFrame({"edges_kept": np.repeat(curve["edges_kept"], 4), "prompt": np.tile(range(4), 5),
                               "metric": np.repeat(curve["metric"], 4) + np.tile([0, .05, -.05, 0], 5)})
    curve.to_csv(tmp_path / "gemma.csv", index=False)
    per_prompt.to_parquet(tmp_path / "gemma.parquet")
    (tmp_path / "gemma.json").write_text(json.dumps(
        {"threshold": 0.9, "edges_interval": [1000, 1000], "edges_to_reach_threshold": 1000,
         "counted_prompts_digest": "d"}))
    out = tmp_path / "ioi.png"
    steps.plot_pruning({"gemma": {"sweep": tmp_path / "gemma.csv", "summary": tmp_path / "gemma.json",
                                  "per_prompt": tmp_path / "gemma.parquet"}}, out, "ioi", ["smollm2", "gemma"],
                       0.9, "corrupted", "EAP-IG (5 steps), by |score|", {"n_resamples": 100, "confidence": 0.95,
                                                                          "seed": 0}, 50, unit="edges")
    assert out.stat().st_size > 10_000
