"""Heads and edges needed against a sparse copy's density: the table and the figure."""

import numpy as np
import pandas as pd


def test_heads_vs_density_figure_labels_dense_over_copy(tmp_path, monkeypatch):
    from attnlab.plots.circuits import plot_heads_vs_density

    table = pd.DataFrame({"task": ["ioi"] * 3, "ablation": ["corrupted"] * 3, "ranking": ["exact"] * 3,
                          "n_prompts": [96] * 3, "threshold": [0.9] * 3, "heldout_density": [1.0, 0.05, 0.01],
                          "heads_to_reach_threshold": [10, 5, 20]})
    from matplotlib.axes import Axes

    labels, original = [], Axes.annotate
    monkeypatch.setattr(Axes, "annotate", lambda self, text, *a, **k: labels.append(text) or original(self, text, *a, **k))
    plot_heads_vs_density(table, "dense", tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0
    assert sorted(labels) == ["0.5×", "2×"]

    labels.clear()
    plot_heads_vs_density(table.assign(heads_fewer_fragile=[False, True, False]), "dense", tmp_path / "g.png")
    assert sorted(labels) == ["0.5×", "2× (fragile)"]

    labels.clear()  # the copy's count comes from a grid: an upper bound, so its N× is not exact
    plot_heads_vs_density(table.assign(heads_to_reach_exact=[True, False, True]), "dense", tmp_path / "h.png")
    assert sorted(labels) == ["0.5×", "2× (grid)"]


def test_heads_vs_density_table_puts_each_copy_beside_its_own_base():
    from attnlab.circuits.curves import heads_vs_density_table

    sweep = lambda needed, back=False: {"ablation": "corrupted", "ranking": "exact", "threshold": 0.9,  # noqa: E731
                                        "heads_to_reach_threshold": needed, "heads_to_reach_exact": True,
                                        "unmeasured_below": 0, "crosses_back_below": back}
    sweeps = {("a", "ioi", "corrupted"): sweep(10), ("a-sparse", "ioi", "corrupted"): sweep(5),
              ("b", "ioi", "corrupted"): sweep(8), ("b-sparse", "ioi", "corrupted"): sweep(None)}
    densities = {"a-sparse": {"heldout_density": 0.05, "heldout_kl": 0.1},
                 "b-sparse": {"heldout_density": 0.2, "heldout_kl": 0.12}}
    table = heads_vs_density_table([("a", "a-sparse"), ("b", "b-sparse")], sweeps, densities,
                                   {"ioi": 24}).set_index("label")
    assert list(table["base"]) == ["a", "a", "b", "b"]
    assert table.loc["a", "heldout_density"] == 1 and table.loc["a-sparse", "heldout_kl"] == 0.1
    assert table.loc["a-sparse", "heads_fewer"] == 2 and table.loc["a", "heads_fewer"] == 1
    assert np.isnan(table.loc["b-sparse", "heads_fewer"])  # never reaches the threshold


def test_heads_vs_density_bars_span_each_interval_and_point_up_where_it_never_ends(tmp_path, monkeypatch):
    """A count above its resamples' interval gets no negative bar (matplotlib refuses one); an
    interval whose upper end is never gets an arrow up instead of a bar."""
    from matplotlib.axes import Axes

    from attnlab.plots.circuits import plot_heads_vs_density

    table = pd.DataFrame({"task": ["ioi"] * 3, "ablation": ["corrupted"] * 3, "ranking": ["exact"] * 3,
                          "n_prompts": [96] * 3, "n_prompts_counted_on": [48] * 3, "threshold": [0.9] * 3,
                          "heldout_density": [1.0, 0.05, 0.01], "heads_to_reach_threshold": [10, 5, 20],
                          "heads_low": [12, 3, 15], "heads_high": [30, np.nan, 25],
                          # every note the title can carry, so that its longest form is drawn (strict)
                          "heads_fewer_low": [np.nan, 0.4, 0.2], "heads_fewer_high": [np.nan, 3.0, 0.9],
                          "heads_fewer_fragile": [False, True, False],
                          "heads_to_reach_exact": [True, False, True]})
    bars, arrows = [], []
    original_bars, original_arrow = Axes.errorbar, Axes.annotate
    monkeypatch.setattr(Axes, "errorbar", lambda self, x, y, yerr, **k: bars.append(
        (list(x), list(y), [list(e) for e in yerr])) or original_bars(self, x, y, yerr=yerr, **k))
    monkeypatch.setattr(Axes, "annotate", lambda self, text, xy, *a, **k: (
        arrows.append(xy) if text == "" else None) or original_arrow(self, text, xy, *a, **k))
    plot_heads_vs_density(table, "dense", tmp_path / "f.png")
    # the dense count 10 lies below its interval [12, 30]: no bar below it, 20 above it
    assert bars == [([0.01, 1.0], [20.0, 10.0], [[5.0, 0.0], [5.0, 20.0]])]  # by density
    assert arrows == [(0.05, 5.0)]
