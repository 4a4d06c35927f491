"""The check every figure the tests draw goes through (``attnlab.plots.base.text_collisions``, enforced
by ATTNLAB_STRICT_FIGURES): it reports text drawn over other text and text off the canvas, and
strict saving refuses such a figure."""

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.plots.base import _save, plt, text_collisions


def _figure(overlapping: bool, off_canvas: bool):
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1])
    ax.text(0.3, 0.5, "first label", transform=ax.transAxes)
    if overlapping:
        ax.text(0.35, 0.5, "second label", transform=ax.transAxes)  # over the first
    else:
        ax.text(0.3, 0.2, "second label", transform=ax.transAxes)  # well below it
    if off_canvas:
        fig.text(0.9, 0.5, "a label running off the right edge")
    return fig


def test_overlapping_text_and_text_off_the_canvas_are_both_reported():
    clean = _figure(overlapping=False, off_canvas=False)
    assert text_collisions(clean) == []
    plt.close(clean)
    fig = _figure(overlapping=True, off_canvas=True)
    problems = text_collisions(fig)
    plt.close(fig)
    assert "'first label' overlaps 'second label'" in problems
    assert "'a label running off the right edge' outside the canvas" in problems
    assert len(problems) == 2, problems


def test_strict_saving_refuses_a_colliding_figure_and_writes_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ATTNLAB_STRICT_FIGURES", "1")
    with pytest.raises(RuntimeError, match=r"f\.png: text collides or is cut off: 'first label' overlaps "
                                           r"'second label'"):
        _save(_figure(overlapping=True, off_canvas=False), tmp_path / "f.png", 50)
    assert not (tmp_path / "f.png").exists()
    with pytest.raises(RuntimeError, match="outside the canvas"):
        _save(_figure(overlapping=False, off_canvas=True), tmp_path / "g.png", 50)
    # without the strict setting (a workflow run): written, the problem named in the log
    monkeypatch.delenv("ATTNLAB_STRICT_FIGURES")
    with caplog.at_level(logging.WARNING):
        _save(_figure(overlapping=True, off_canvas=False), tmp_path / "h.png", 50)
    assert (tmp_path / "h.png").stat().st_size > 0 and "'first label' overlaps 'second label'" in caplog.text


REPO = Path(__file__).resolve().parents[1]

# Run a workflow script as Snakemake's ``script:`` directive does: in a fresh interpreter, with a
# ``snakemake`` object holding the job's input, output, log, params and wildcards.
_JOB = """import json, runpy, sys
from types import SimpleNamespace
job = json.loads(sys.argv[2])
snakemake = SimpleNamespace(input=SimpleNamespace(**job["input"]), output=job["output"], log=job["log"],
                            params=SimpleNamespace(**job["params"]), wildcards=SimpleNamespace(**job["wildcards"]))
runpy.run_path(sys.argv[1], init_globals={"snakemake": snakemake}, run_name="__main__")
"""


def _summary(model: str, condition: str) -> dict:
    row = {"model": model, "dataset": "svamp", "condition": condition, "n": 20, "inserted_tokens": 0,
           "extracted_boxed": 0.5, "extracted_hash": 0.1, "extracted_last_number": 0.3, "extracted_none": 0.1,
           "hit_token_limit": 0.25, "n_hit_token_limit": 5}
    for grader in ("math_verify", "lenient"):
        row.update({f"{grader}_acc": 40.0, f"{grader}_ci_low": 30.0, f"{grader}_ci_high": 50.0})
    return row


def _plot_accuracy_job(folder: Path, strict: bool) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """workflow/scripts/plot_accuracy.py on two models whose names are far wider than their bars,
    so that their tick labels overlap (the figure does not wrap them)."""
    models = [f"{which}-model-with-a-name-far-wider-than-its-group-of-bars" for which in ("first", "second")]
    summaries = []
    for k, model in enumerate(models):
        summaries.append(str(folder / f"summary{k}.json"))
        Path(summaries[-1]).write_text(json.dumps(_summary(model, "none")))
    paired = folder / "paired.csv"
    paired.write_text("model,dataset,condition,baseline,grader,difference_pts,ci_low_pts,ci_high_pts,holm_p\n")
    figure, log = folder / "figures" / "svamp.png", folder / "plot_accuracy.log"
    figure.parent.mkdir()
    job = {"input": {"summaries": summaries, "paired": str(paired)}, "output": [str(figure)], "log": [str(log)],
           "params": {"models": models, "conditions": ["none"], "dpi": 40}, "wildcards": {"dataset": "svamp"}}
    env = {key: value for key, value in os.environ.items() if key != "ATTNLAB_STRICT_FIGURES"}
    if strict:
        env["ATTNLAB_STRICT_FIGURES"] = "1"
    script = REPO / "workflow/scripts/plot_accuracy.py"
    done = subprocess.run([sys.executable, "-c", _JOB, str(script), json.dumps(job)], env=env, capture_output=True,
                          text=True, timeout=120)
    return done, figure, log


def test_a_workflow_plotting_job_under_strict_figures_fails_on_colliding_text_and_writes_no_figure(tmp_path):
    """The tiny workflow run (tests/test_workflow.py) is held to its figures' text by
    ATTNLAB_STRICT_FIGURES, which tests/conftest.py sets for every job it runs: a job whose figure
    collides must fail, or the run passing would prove nothing. A real plotting script, run as a
    job, refuses such a figure and leaves none behind; without the setting it writes it and says why."""
    assert os.environ["ATTNLAB_STRICT_FIGURES"]  # what the workflow's jobs inherit from the tests
    (tmp_path / "strict").mkdir()
    done, figure, log = _plot_accuracy_job(tmp_path / "strict", strict=True)
    assert done.returncode != 0
    assert f"RuntimeError: {figure}: text collides or is cut off: 'first-model-with" in log.read_text()
    assert "overlaps 'second-model-with" in log.read_text()
    assert list(figure.parent.iterdir()) == []  # no figure, no temporary
    (tmp_path / "lenient").mkdir()
    done, figure, log = _plot_accuracy_job(tmp_path / "lenient", strict=False)
    assert done.returncode == 0, log.read_text()
    assert figure.stat().st_size > 0 and f"WARNING attnlab.plots.base: {figure}: text collides" in log.read_text()


def test_every_figure_is_written_through_the_text_check():
    """Only ``_save`` writes a figure, so no plotting function or workflow script can write one
    whose text the check has not seen (a figure written past it would pass the tiny run)."""
    writes = []
    for path in sorted([*(REPO / "src").rglob("*.py"), *(REPO / "workflow").rglob("*.py"), REPO / "Snakefile",
                        *(REPO / "workflow").rglob("*.smk")]):
        for line in path.read_text().splitlines():
            if re.search(r"\b(savefig|print_figure|print_png|imsave)\(", line):
                writes.append((str(path.relative_to(REPO)), line.strip()))
    assert writes == [("src/attnlab/plots/base.py",
                       'fig.savefig(tmp, dpi=dpi, format=str(out_path).rsplit(".", 1)[-1])')], writes


@pytest.mark.parametrize("conditions", [["none"], ["none", "mless", "mful"]])
def test_the_lambda_heatmap_of_one_condition_keeps_its_title_clear_of_its_panel(tmp_path, monkeypatch, conditions):
    """A model with one condition (a sparse copy's workflow runs only `none`) draws a narrow figure
    whose wrapped title once fell over the panel's title: strict saving refused it."""
    import pandas as pd

    from attnlab.plots.attention import plot_lambda_heatmap

    monkeypatch.setenv("ATTNLAB_STRICT_FIGURES", "1")
    rows = [{"condition": condition, "layer": layer, "head": head, "lambda_mean": 0.5}
            for condition in conditions for layer in range(3) for head in range(3)]
    out = tmp_path / "lambda.png"
    plot_lambda_heatmap(pd.DataFrame(rows), "smollm2-135m-sparse", "svamp", out, dpi=60)
    assert out.stat().st_size > 0
