"""Claims of the docs that a test can check, kept true: the rules docs/pipeline.md says ask for a
GPU are the rules that do, and the README's example config validates and plans jobs; every number docs/results.md quotes
from a results tree is listed with its file (docs/results-quotes.yaml) and the checker finds a
changed one."""

import importlib.util
import json
import re

import pandas as pd
import yaml

from conftest import REPO, dry_run, job_counts
from test_slurm import declared_gpu_rules

README = (REPO / "README.md").read_text()
PIPELINE = (REPO / "docs" / "pipeline.md").read_text()


def test_the_pipeline_page_lists_exactly_the_rules_that_ask_for_a_gpu():
    sentence = re.search(r"\(GPU rules: (.*?)\) declare `gpu=1`", PIPELINE, re.S).group(1)
    listed = set(re.findall(r"`(\w+)`", sentence))
    assert listed == declared_gpu_rules() == {"generate", "extract_attention", "mlp_activations", "score_heads",
                                              "sweep_heads", "edge_circuit", "sparsify_model", "mediate",
                                              "groundtruth_score"}


def test_the_readmes_example_config_validates_and_plans_jobs(tmp_path):
    block = re.search(r"A short config:\n\n```yaml\n(.*?)```", README, re.S).group(1)
    config = yaml.safe_load(block)
    result = dry_run(tmp_path, config)
    assert result.returncode == 0, result.stdout[-3000:]
    counts = job_counts(result.stdout)
    assert counts["generate"] == 3 * 1 * 4 and counts["sparsify_model"] == 1 and counts["edge_circuit"] == 1


def _check_quotes():
    spec = importlib.util.spec_from_file_location("check_quotes", REPO / "benchmarks" / "tools" / "check_quotes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_listed_quote_is_still_in_the_results_doc():
    text = " ".join((REPO / "docs" / "results.md").read_text().split())
    quotes = yaml.safe_load((REPO / "docs" / "results-quotes.yaml").read_text())
    assert {str(q["section"]) for q in quotes} >= {"1", "5"}
    missing = [q["text"] for q in quotes if " ".join(q["text"].split()) not in text]
    assert not missing, f"docs/results.md no longer quotes these; update docs/results-quotes.yaml: {missing}"


def test_the_quote_checker_finds_a_changed_number_and_a_missing_file(tmp_path):
    checker = _check_quotes()
    (tmp_path / "tables").mkdir()
    pd.DataFrame({"model": ["a", "b"], "acc": [15.625, 34.375], "low": [6.86, 20.4]}).to_csv(
        tmp_path / "tables" / "t.csv", index=False)
    (tmp_path / "s.json").write_text(json.dumps({"n": 583, "interval": [507, 1576], "p": 0.0703125}))
    quotes = [
        {"section": 1, "text": "15.6% [6.9]", "file": "tables/t.csv", "where": {"model": "a"}, "columns": ["acc", "low"]},
        {"section": 1, "text": "≤583 [507, 1,576], p = 0.070", "file": "s.json", "digits": [0, 0, 0, 3],
         "keys": ["n", "interval.0", "interval.1", "p"]},
        {"section": 1, "text": "34.5%", "file": "tables/t.csv", "where": {"model": "b"}, "columns": ["acc"]},
        {"section": 5, "text": "1.0", "file": "gone.json", "keys": ["x"]},
    ]
    found = checker.differences(tmp_path, quotes)
    assert len(found) == 2
    assert "34.5%" in found[0] and "[34.4]" in found[0]
    assert "gone.json" in found[1] and "cannot read" in found[1]
    assert checker.quoted_numbers("−6.8, 1,576 and 0.5") == [-6.8, 1576.0, 0.5]
