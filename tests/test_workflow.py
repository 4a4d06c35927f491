"""The contract users rely on: the real workflow, through the Snakemake CLI,
on real SmolLM2 weights and real data, and a second run that does nothing."""

import json

import pandas as pd
import pytest

from conftest import copy_config, snakemake

pytestmark = pytest.mark.slow

MODEL, DATASETS, CONDITIONS = "smollm2-135m", ["svamp", "gsm8k"], ["none", "mless"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tiny")
    config = copy_config("tiny.yaml", workdir)
    result = snakemake("--cores", "2", "--configfile", str(config), workdir=workdir)
    assert result.returncode == 0, result.stderr[-5000:]
    return workdir, config


def _cells():
    return [(d, c) for d in DATASETS for c in CONDITIONS]


def test_every_declared_output_exists(tiny_run):
    workdir, _ = tiny_run
    assert (workdir / f"resources/models/{MODEL}/model.safetensors").is_file()
    assert (workdir / f"resources/models/{MODEL}/tokenizer.json").is_file()
    for dataset, condition in _cells():
        cell = f"{MODEL}/{dataset}/{condition}"
        for path in [f"results/data/{dataset}.parquet", f"results/prompts/{cell}.parquet",
                     f"results/generations/{cell}.parquet", f"results/grades/{cell}.csv",
                     f"results/grades/{cell}.json", f"results/logs/generate/{cell}.log",
                     f"results/benchmarks/generate/{cell}.tsv"]:
            assert (workdir / path).is_file(), path
    for dataset in DATASETS:
        figure = workdir / f"results/figures/accuracy/{dataset}.png"
        assert figure.stat().st_size > 10_000
    # No temporary leftovers anywhere.
    assert not [p for p in workdir.rglob("*.tmp-*")]


def test_outputs_are_consistent(tiny_run):
    workdir, _ = tiny_run
    table = pd.read_csv(workdir / "results/tables/accuracy.csv")
    assert len(table) == len(_cells())
    assert set(table["condition"]) == set(CONDITIONS)
    assert (table["n"] == table["dataset"].map({"svamp": 4, "gsm8k": 3})).all()
    for grader in ("math_verify", "lenient"):
        assert table[f"{grader}_acc"].between(0, 100).all()
        assert (table[f"{grader}_ci_low"] <= table[f"{grader}_acc"] + 1e-9).all()
        assert (table[f"{grader}_acc"] <= table[f"{grader}_ci_high"] + 1e-9).all()
    prompts = pd.read_parquet(workdir / f"results/prompts/{MODEL}/svamp/mless.parquet")
    assert (prompts["inserted_tokens"] == 10).all() and prompts["span_exact"].all()
    generations = pd.read_parquet(workdir / f"results/generations/{MODEL}/svamp/mless.parquet")
    assert generations["id"].tolist() == prompts["id"].tolist()
    assert (generations["n_new_tokens"].between(1, 16)).all()
    assert (generations["decoding"] == "greedy").all()
    graded = pd.read_csv(workdir / f"results/grades/{MODEL}/svamp/mless.csv")
    summary = json.loads((workdir / f"results/grades/{MODEL}/svamp/mless.json").read_text())
    assert summary["math_verify_acc"] == pytest.approx(100 * graded["math_verify"].mean())


def test_second_run_schedules_nothing(tiny_run):
    workdir, config = tiny_run
    dry = snakemake("-n", "--cores", "2", "--configfile", str(config), workdir=workdir)
    assert dry.returncode == 0
    assert "Nothing to be done" in dry.stdout + dry.stderr
    again = snakemake("--cores", "2", "--configfile", str(config), workdir=workdir)
    assert again.returncode == 0
    assert "Finished job" not in again.stdout + again.stderr
