"""A sparse copy is one more model of the workflow: every stage runs on it, gated."""

import json

import h5py
import numpy as np
import pandas as pd
import pytest
import yaml

from conftest import REPO, copy_config, dry_run as _dry_run, job_counts, refusal, snakemake

pytestmark = pytest.mark.slow
DENSE, SPARSE = "smollm2-135m", "smollm2-135m-sparse"
CONTROL = f"{SPARSE}-control"


def _config():
    return yaml.safe_load((REPO / "tests/configs/sparse_tiny.yaml").read_text())


def test_a_copys_dense_control_is_prepared_after_its_post_training_and_compared(tmp_path):
    """The tiny config declares the copy's dense control as a model, as config/sparse.yaml does:
    its folder is not there before the copy's post-training, yet the workflow plans its
    preparation after it, and sweeps it beside base and copy; a copy whose constraint trains no
    control is refused."""
    config = _config()
    result = _dry_run(tmp_path, config)
    assert result.returncode == 0, result.stdout[-3000:]
    counts = job_counts(result.stdout)
    assert counts["prepare_model"] == 2 and counts["score_heads"] == 3 and counts["sweep_heads"] == 3 * 2  # corrupted, mean
    assert counts["circuit_areas"] == 1
    assert f"input: results/sparsify/{SPARSE}/summary.json" in result.stdout
    assert f"output: resources/models/{CONTROL}" in result.stdout
    config["models"][SPARSE]["source"]["sparsify"]["constraint"] = {"type": "kl", "slack": 0.1}
    (tmp_path / "kl").mkdir()
    refused = _dry_run(tmp_path / "kl", config)
    assert refused.returncode != 0 and "trains no control" in refused.stdout, refused.stdout[-3000:]


def test_dry_run_plans_one_post_training_and_treats_the_copy_as_a_model(tmp_path):
    result = _dry_run(tmp_path, _config())
    assert result.returncode == 0, result.stdout
    counts = job_counts(result.stdout)
    assert counts["prepare_model"] == 2 and counts["sparsify_model"] == 1 and counts["plot_sparsify"] == 1
    assert counts["generate"] == 2 and counts["extract_attention"] == 2  # 2 models x 1 condition (the control: none)
    assert counts["score_heads"] == 3 and counts["sweep_heads"] == 3 * 2  # base, control, copy; corrupted and mean


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["models"][SPARSE]["source"]["sparsify"].update(base="nope"),
     "models.smollm2-135m-sparse.source.sparsify.base is 'nope', which is not a configured model"),
    (lambda c: c["models"].update({"twice": {"source": {"sparsify": {"base": SPARSE}}}}),
     "sparse copy of a sparse copy"),
    (lambda c: c["models"][SPARSE]["source"]["sparsify"].update(corpus={"paths": ["/no/such.txt"]}),
     "corpus.paths: '/no/such.txt' does not exist"),
    (lambda c: c["models"][SPARSE]["source"]["sparsify"].update(gate_bias=100),
     "gate_bias"),
    (lambda c: c["models"][SPARSE]["source"]["sparsify"].update(constraint={"slack": -1}),
     "slack"),
])
def test_bad_sparsify_settings_fail_before_any_job(tmp_path, edit, message):
    config = _config()
    edit(config)
    found = refusal(config, tmp_path)
    assert message in found, found


@pytest.fixture(scope="module")
def sparse_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("sparse")
    config = copy_config("sparse_tiny.yaml", workdir)
    result = snakemake("--cores", "2", "--configfile", str(config), workdir=workdir, timeout=1800)
    assert result.returncode == 0, result.stdout[-5000:]
    return workdir


def test_every_stage_runs_on_the_sparse_copy(sparse_run):
    workdir = sparse_run
    model = workdir / f"resources/models/{SPARSE}"
    config = json.loads((model / "config.json").read_text())
    assert config["attnlab_sparse"]["gate_bias"] == 6.0 and config["attnlab_sparse"]["base"] == DENSE
    summary = json.loads((workdir / f"results/sparsify/{SPARSE}/summary.json").read_text())
    assert summary["steps"] == 2 and 0 < summary["heldout_density"] < 1
    assert not (workdir / f"resources/sparsify/{SPARSE}/checkpoint.pt").exists()
    # the default constraint, ce_control: its dense control beside, and what the fine-tuning alone cost
    assert summary["constraint"]["type"] == "ce_control" and summary["heldout_kl_control"] >= 0
    control = json.loads((workdir / f"resources/sparsify/{SPARSE}/control/attnlab_source.json").read_text())
    assert control["dense_control_of"] == SPARSE and "attnlab_sparse" not in json.loads(
        (workdir / f"resources/sparsify/{SPARSE}/control/config.json").read_text())
    for figure in ("training", "density"):
        assert (workdir / f"results/figures/sparsify/{SPARSE}/{figure}.png").stat().st_size > 10_000
    for name in (DENSE, SPARSE):
        assert (workdir / f"results/grades/{name}/svamp/none.json").is_file()
        assert (workdir / f"results/tables/mlp/{name}/svamp.csv").is_file()
        for ablation in ("corrupted", "mean"):
            assert (workdir / f"results/pruning/{name}/ioi/{ablation}/sweep.csv").is_file()
        # the mean sweep counted with the scoring job's reference, and says what it was taken over
        assert (json.loads((workdir / f"results/pruning/{name}/ioi/mean/sweep.json").read_text())["mean_over"]
                == json.loads((workdir / f"results/pruning/{name}/ioi/scores.json").read_text())["mean_over"])
        assert (workdir / f"results/pruning/{name}/ioi/mean/means.safetensors").stat().st_size > 0
    for ablation in ("corrupted", "mean"):
        assert (workdir / f"results/figures/pruning/{ablation}/ioi.png").is_file()
    table = pd.read_csv(workdir / "results/tables/heads_vs_density.csv")
    assert sorted(table["ablation"]) == ["corrupted", "corrupted", "mean", "mean"]
    heads = table[table["ablation"] == "corrupted"].set_index("label")
    assert heads.loc[DENSE, "heldout_density"] == 1 and heads.loc[SPARSE, "heldout_density"] == summary["heldout_density"]
    sweeps = {name: json.loads((workdir / f"results/pruning/{name}/ioi/corrupted/sweep.json").read_text())
              for name in (DENSE, SPARSE)}
    assert list(heads.loc[[DENSE, SPARSE], "heads_to_reach_threshold"]) == [
        sweeps[name]["heads_to_reach_threshold"] for name in (DENSE, SPARSE)]
    # the copy shares its base's tokenizer, so both were counted on the same prompts: a paired N×
    assert sweeps[DENSE]["counted_prompts_digest"] == sweeps[SPARSE]["counted_prompts_digest"]
    assert heads.loc[SPARSE, "heads_fewer_paired"] == True  # noqa: E712 (read from CSV: a bool or NaN)
    # the copy's clean − corrupted gap over its base's on the counted prompts (circuits.task_gap)
    gaps = {name: np.mean(sweeps[name]["clean_metric_per_prompt"]) - np.mean(sweeps[name]["corrupted_metric_per_prompt"])
            for name in (DENSE, SPARSE)}
    assert heads.loc[SPARSE, "kept_gap"] == pytest.approx(gaps[SPARSE] / gaps[DENSE])
    assert heads.loc[SPARSE, "task_lost"] == (gaps[SPARSE] / gaps[DENSE] < 0.8)
    assert (workdir / "results/figures/pruning/heads_vs_density.png").stat().st_size > 10_000
    _check_edge_circuits(workdir)
    _check_areas(workdir)
    # Extraction of the copy is gated: it says so, and its received attention differs from the base's.
    with h5py.File(workdir / f"results/attention/{SPARSE}/svamp/none.h5") as sparse_h5, \
            h5py.File(workdir / f"results/attention/{DENSE}/svamp/none.h5") as dense_h5:
        assert json.loads(sparse_h5.attrs["sparse_attention"])["gate_bias"] == 6.0
        assert json.loads(dense_h5.attrs["sparse_attention"]) is None
        last = "layer_29"
        difference = np.nanmax(np.abs(sparse_h5["received"][last][:] - dense_h5["received"][last][:]))
        assert difference > 1e-3
    accuracy = pd.read_csv(workdir / "results/tables/accuracy.csv")
    assert set(accuracy["model"]) == {DENSE, SPARSE}


def _check_areas(workdir):
    """The control is a model of the workflow (its folder the post-training's control), swept
    beside base and copy; every curve has MIB's areas on measured sizes, and every compared pair
    (the fine-tuning, the gates, both) its differences; the per-task figure is drawn."""
    from safetensors.torch import load_file

    control = load_file(workdir / f"resources/models/{CONTROL}/model.safetensors")
    trained = load_file(workdir / f"resources/sparsify/{SPARSE}/control/model.safetensors")
    base = load_file(workdir / f"resources/models/{DENSE}/model.safetensors")
    assert control.keys() == trained.keys() and all(control[name].equal(trained[name]) for name in control)
    assert any(not control[name].equal(base[name]) for name in control)  # fine-tuned: not the base
    areas = pd.read_csv(workdir / "results/tables/areas.csv")
    heads = areas[areas["unit"] == "heads"]
    assert sorted(set(heads["model"])) == sorted([DENSE, CONTROL, SPARSE]) and len(heads) == 3 * 2
    assert sorted(areas.loc[areas["unit"] == "edges", "model"]) == sorted([DENSE, SPARSE])
    assert areas["mib_missing"].isna().all() and (areas["components"][areas["unit"] == "heads"] == 270).all()
    differences = pd.read_csv(workdir / "results/tables/area_differences.csv")
    pairs = set(zip(differences["first"], differences["second"]))
    assert pairs == {(DENSE, CONTROL), (CONTROL, SPARSE), (DENSE, SPARSE)} and differences["paired"].all()
    for ablation in ("corrupted", "mean"):
        assert (workdir / f"results/figures/pruning/{ablation}/tasks.png").stat().st_size > 20_000


def _check_edge_circuits(workdir):
    """Both models' edge circuits on the head sweep's prompts: every edge scored, the curve from
    the corrupted run (0) to the clean one (1), its count inside its interval, and the figure."""
    for name in (DENSE, SPARSE):
        folder = workdir / f"results/circuits/{name}/ioi"
        edges = pd.read_parquet(folder / "edges.parquet")
        summary = json.loads((folder / "summary.json").read_text())
        curve = pd.read_csv(folder / "curve.csv")
        heads = json.loads((workdir / f"results/pruning/{name}/ioi/corrupted/sweep.json").read_text())
        assert len(edges) == summary["edges"] == 70_651  # SmolLM2's graph (test_edges)
        assert summary["score_chunk"] == 20 and summary["recordings_kept"] == [1, 2]  # sparse_tiny.yaml
        logged = (workdir / f"results/logs/edge_circuit/{name}/ioi.log").read_text()
        for part in ("edge_scores (batch 2, tokens", "points_per_batch 20, prompts 4, chunks 2, steps 2): estimated peak",
                     "edge_circuit (batch 2,", "corrupted recordings kept between evaluations: 1 of 2",
                     "edge_circuit asked for mem_mb=", "min: the cost fit: the stage's estimate"):
            assert part in logged, (part, logged[-2000:])  # the cost fit's estimate, the cache's use
        assert sorted(edges["rank"]) == list(range(1, len(edges) + 1))
        assert curve["explained_effect"].iloc[0] == 0 and curve["explained_effect"].iloc[-1] == 1
        assert curve["edges_kept"].iloc[-1] == len(edges)
        assert summary["counted_prompts_digest"] == heads["counted_prompts_digest"]  # the same prompts
        assert summary["clean_metric"] == pytest.approx(curve["metric"].iloc[-1])
        needed, (low, high) = summary["edges_to_reach_threshold"], summary["edges_interval"]
        assert needed is not None and low <= needed <= high
    assert (workdir / "results/figures/circuits/ioi.png").stat().st_size > 10_000
    for name in (DENSE, SPARSE):
        assert (workdir / f"results/figures/circuits/{name}/ioi.circuit.png").stat().st_size > 10_000
    table = pd.read_csv(workdir / "results/tables/edges_vs_density.csv").set_index("label")
    assert table.loc[DENSE, "heldout_density"] == 1 and table.loc[SPARSE, "edges_fewer_paired"] == True  # noqa: E712
    assert table.loc[SPARSE, "edges_to_reach_threshold"] == json.loads(
        (workdir / f"results/circuits/{SPARSE}/ioi/summary.json").read_text())["edges_to_reach_threshold"]
    assert (workdir / "results/figures/circuits/edges_vs_density.png").stat().st_size > 10_000
