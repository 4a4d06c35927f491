"""Claims of the README that a test can check, kept true: the rules it says ask for a GPU are the
rules that do, and its example config validates and plans jobs."""

import re

import yaml

from conftest import REPO, dry_run, job_counts
from test_slurm import declared_gpu_rules

README = (REPO / "README.md").read_text()


def test_the_readme_lists_exactly_the_rules_that_ask_for_a_gpu():
    sentence = re.search(r"\(GPU rules: (.*?)\) declare `gpu=1`", README, re.S).group(1)
    listed = set(re.findall(r"`(\w+)`", sentence))
    assert listed == declared_gpu_rules() == {"generate", "extract_attention", "mlp_activations", "score_heads",
                                              "sweep_heads", "edge_circuit", "sparsify_model"}


def test_the_readmes_example_config_validates_and_plans_jobs(tmp_path):
    block = re.search(r"## The config\n\n```yaml\n(.*?)```", README, re.S).group(1)
    config = yaml.safe_load(block)
    result = dry_run(tmp_path, config)
    assert result.returncode == 0, result.stdout[-3000:]
    counts = job_counts(result.stdout)
    assert counts["generate"] == 3 * 1 * 7 and counts["sparsify_model"] == 1 and counts["edge_circuit"] == 1
