import pandas as pd

from attnlab.plots import plot_accuracy, plot_length_sweep


def _cell(condition, tokens, acc, model="m"):
    row = {"model": model, "dataset": "d", "condition": condition, "n": 20, "inserted_tokens": tokens}
    for grader in ("math_verify", "lenient"):
        row.update({f"{grader}_acc": acc, f"{grader}_ci_low": acc - 10, f"{grader}_ci_high": acc + 10})
    return row


def test_length_sweep_and_accuracy_figures_are_written(tmp_path):
    table = pd.DataFrame([_cell("none", 0, 40), _cell("mless_10", 10, 45), _cell("mless_55", 55, 50),
                          _cell("mful_55", 55, 35)])
    families = {"none": None, "mless_10": "repeat '/'", "mless_55": "repeat '/'", "mful_55": "repeat 'he'"}
    plot_length_sweep(table, families, "m", "d", tmp_path / "sweep.png", dpi=60)
    plot_accuracy(table, "d", ["m"], list(families), tmp_path / "bars.png", dpi=60)
    assert (tmp_path / "sweep.png").stat().st_size > 5_000
    assert (tmp_path / "bars.png").stat().st_size > 5_000
    assert not list(tmp_path.glob(".*tmp-*"))
