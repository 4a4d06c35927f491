"""pruning.ablation, one value or a list, as the workflow plans it: one scoring job per model x
task, a sweep and a figure per ablation, and a bad value refused before any job."""

import re

import pytest
import yaml

from conftest import REPO, dry_run as _dry_run, job_counts, refusal


def _tiny():
    return yaml.safe_load((REPO / "tests/configs/tiny.yaml").read_text())


def test_every_configured_ablation_gets_its_sweeps_and_figures_from_one_scoring_job(tmp_path):
    """pruning.ablation as a list: one scoring job per model x task, one sweep per model x task x
    ablation, a figure per task x ablation, and heads_vs_density reading every ablation's sweeps;
    ground truth and edge circuits keep reading the primary's (the first)."""
    config = yaml.safe_load((REPO / "tests/configs/sparse_tiny.yaml").read_text())
    config["pruning"]["ablation"] = ["mean", "corrupted", "zero"]
    result = _dry_run(tmp_path, config)
    assert result.returncode == 0, result.stdout[-3000:]
    counts = job_counts(result.stdout)
    models = ("smollm2-135m", "smollm2-135m-sparse", "smollm2-135m-sparse-control")  # the tiny config's three
    assert (counts["score_heads"], counts["sweep_heads"], counts["plot_pruning"]) == (3, 3 * 3, 3)
    assert counts["heads_vs_density"] == 1 and counts["edge_circuit"] == 2  # edges: as with one ablation
    assert counts["circuit_areas"] == 1  # every ablation's curves, a figure of the tasks for each
    for ablation in ("mean", "corrupted", "zero"):
        assert f"results/figures/pruning/{ablation}/ioi.png" in result.stdout
        assert f"results/figures/pruning/{ablation}/tasks.png" in result.stdout
        for model in models:
            assert f"results/pruning/{model}/ioi/{ablation}/sweep.json" in result.stdout
    density = re.search(r"rule heads_vs_density:\n\s+input: (.*)", result.stdout).group(1)
    assert density.count("/sweep.json") == 2 * 3


@pytest.mark.parametrize("value, found", [
    ("nope", "'nope' is not valid under any of the given schemas"),
    ([], "[] should be non-empty"),
    (["mean", "zero", "mean"], "['mean', 'zero', 'mean'] has non-unique elements"),
    (["mean", "nope"], "pruning.ablation[1]: 'nope' is not one of ['corrupted', 'mean', 'zero']"),
], ids=["unknown", "empty", "repeated", "unknown-in-a-list"])
def test_a_bad_ablation_is_refused_before_any_job_naming_the_key_and_the_value(tmp_path, value, found):
    config = _tiny()
    config["pruning"]["ablation"] = value
    message = refusal(config, tmp_path)
    assert "config key pruning.ablation" in message and found in message, message
