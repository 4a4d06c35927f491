"""The contract users rely on: the real workflow, through the Snakemake CLI,
on real SmolLM2 weights and real data (the run: conftest.tiny_run), and a second run that does
nothing; only what went stale reruns. Its report and faults: test_workflow_faults.py."""

import json
import os
import shutil

import h5py
import numpy as np
import pandas as pd
import pytest
import yaml

from attnlab.circuits.curves import heads_to_reach, k_grid
from attnlab.config.plan import with_mib_sizes

from conftest import job_counts, snakemake

pytestmark = pytest.mark.slow

MODEL, DATASETS, CONDITIONS = "smollm2-135m", ["svamp", "gsm8k"], ["none", "mless", "mless_end", "arm"]


def _cells():
    return [(d, c) for d in DATASETS for c in CONDITIONS]


def test_every_declared_output_exists(tiny_run):
    workdir, *_ = tiny_run
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


def test_continuous_engine_gives_the_tiny_runs_tokens(tiny_run):
    """Cells of the tiny run (static engine) generated again with generation.engine: continuous,
    ARM on for the ARM condition: the same token ids for every prompt. Every condition on svamp (a
    full batch of 4) and gsm8k's plain cell (longer prompts, a batch of 3): the other three cells
    add 9 s and no case (test_generation.py compares the engines on both embedded models)."""
    import torch

    from attnlab.interventions import intervened
    from attnlab.interventions.mlp import ArmSettings
    from attnlab.models import load_model
    from attnlab.reasoning.generation import generate_all
    from attnlab.tokenization import load_tokenizer

    workdir, config, _ = tiny_run
    settings = yaml.safe_load(config.read_text())["generation"]
    folder = workdir / f"resources/models/{MODEL}"
    model, tokenizer = load_model(folder, torch.device("cpu"), torch.float32), load_tokenizer(folder)
    for dataset, condition in [("svamp", condition) for condition in CONDITIONS] + [("gsm8k", "none")]:
        prompts = pd.read_parquet(workdir / f"results/prompts/{MODEL}/{dataset}/{condition}.parquet")
        static = pd.read_parquet(workdir / f"results/generations/{MODEL}/{dataset}/{condition}.parquet")
        with intervened(model, arm=ArmSettings() if condition == "arm" else None):
            continuous = generate_all(model, tokenizer, prompts, settings["batch_size"],
                                      settings["max_new_tokens"], engine="continuous")
        assert set(continuous["engine"]) == {"continuous"} and set(static["engine"]) == {"static"}
        assert [list(ids) for ids in static["new_token_ids"]] == continuous["new_token_ids"].tolist(), (
            dataset, condition)


def test_outputs_are_consistent(tiny_run):
    workdir, *_ = tiny_run
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
    workdir, config, snakefile = tiny_run
    dry = snakemake("-n", "--cores", "2", "--configfile", str(config), workdir=workdir, snakefile=snakefile)
    assert dry.returncode == 0
    assert "Nothing to be done" in dry.stdout
    again = snakemake("--cores", "2", "--configfile", str(config), workdir=workdir, snakefile=snakefile)
    assert again.returncode == 0
    assert "Finished job" not in again.stdout


def test_attention_hdf5_layout(tiny_run):
    import h5py

    workdir, *_ = tiny_run
    prompts = pd.read_parquet(workdir / f"results/prompts/{MODEL}/svamp/mless.parquet")
    with h5py.File(workdir / f"results/attention/{MODEL}/svamp/mless.h5") as h5:
        assert h5.attrs["complete"] and h5.attrs["model"] == MODEL and h5.attrs["condition"] == "mless"
        assert "mean over i > j of A[i, j]" in h5.attrs["metric_definition"]
        assert "transformers" in json.loads(h5.attrs["versions"])
        n, width = len(prompts), int(prompts["n_prompt_tokens"].max())
        assert h5.attrs["n_layers"] == 30 and h5.attrs["n_heads"] == 9
        for name in ("received", "lam"):
            layer = h5[f"{name}/layer_29"]
            assert layer.shape == (9, n, width) and layer.chunks == (1, n, width)
            assert layer.compression == "gzip"
        assert h5["token_ids"][0, : prompts["n_prompt_tokens"][0]].tolist() == prompts["input_ids"][0].tolist()
        assert h5["spans"][:, 1].tolist() == prompts[["inserted_start", "inserted_end"]].values.tolist()
        lam = h5["lam/layer_05"][:]
        assert np.nanmax(lam) <= 1 + 1e-6 and np.nanmin(lam) < 1  # the insertion takes attention
    with h5py.File(workdir / f"results/attention/{MODEL}/svamp/none.h5") as h5:
        lengths = h5["lengths"][:]
        for layer in range(30):
            lam = h5[f"lam/layer_{layer:02d}"][:]
            assert all((lam[:, i, :length] == 1.0).all() for i, length in enumerate(lengths))


def test_attention_figures_and_tables(tiny_run):
    workdir, *_ = tiny_run
    figures = workdir / f"results/figures/attention/{MODEL}/svamp"
    assert (figures / "layer0_head0.png").stat().st_size > 10_000
    assert (figures / "lambda.png").is_file()
    assert (workdir / "results/figures/attention/composite/head1_layers1-2.png").stat().st_size > 10_000
    ranked = pd.read_csv(workdir / f"results/tables/attention/{MODEL}/svamp/head_changes.csv")
    assert len(ranked) == 30 * 9 and ranked["score"].is_monotonic_decreasing
    top = ranked.iloc[0]
    assert [p.name for p in (figures / "top_changed").glob("*.png")] == [
        f"rank1_layer{top['layer']}_head{top['head']}.png"]
    lam = pd.read_csv(workdir / f"results/tables/attention/{MODEL}/svamp/lambda.csv")
    assert len(lam) == len(CONDITIONS) * 30 * 9
    assert (lam[lam["condition"].isin(["none", "arm"])]["lambda_mean"] == 1.0).all()
    assert (lam[lam["condition"] == "mless"]["lambda_mean"] < 1.0).any()


def test_head_out_of_range_names_the_real_shape(tiny_run):
    workdir, config, snakefile = tiny_run
    bad = workdir / "bad_head.yaml"
    bad.write_text(config.read_text().replace("heads: [{layer: 0, head: 0}]", "heads: [{layer: 30, head: 2}]"))
    result = snakemake("-n", "--cores", "1", "--configfile", str(bad), workdir=workdir, snakefile=snakefile)
    assert result.returncode != 0
    assert "model 'smollm2-135m' has 30 layers x 9 heads" in result.stdout
    bad.write_text(config.read_text().replace("max_prompts: 3", "max_prompts: 3\n  layer: 30"))
    result = snakemake("-n", "--cores", "1", "--configfile", str(bad), workdir=workdir, snakefile=snakefile)
    assert result.returncode != 0
    assert "model 'smollm2-135m' has 30 layers (0-based: 0..29); mlp.layer is 30" in result.stdout


def test_placement_end_puts_the_insertion_after_the_question(tiny_run):
    workdir, *_ = tiny_run
    end = pd.read_parquet(workdir / f"results/prompts/{MODEL}/svamp/mless_end.parquet")
    plain = pd.read_parquet(workdir / f"results/prompts/{MODEL}/svamp/none.parquet")
    assert (end["inserted_start"] >= end["question_end"]).all() and (end["inserted_tokens"] == 10).all()
    for row, ids in zip(end.itertuples(), plain["input_ids"]):
        kept = list(row.input_ids[: row.cut_start]) + list(row.input_ids[row.cut_end:])
        assert kept == list(ids)
    table = pd.read_csv(workdir / "results/tables/placement/svamp.csv")
    assert set(table["placement"]) == {"none", "between", "end"}  # ARM stays out
    assert len(table) == 3 and (table["dataset"] == "svamp").all()
    assert (workdir / "results/figures/placement/svamp.png").stat().st_size > 10_000


def test_arm_condition_changes_only_what_follows_its_layer(tiny_run):
    """ARM on layer 0's MLP: same prompt as `none`, same layer-0 attention, different after."""
    import h5py

    workdir, *_ = tiny_run
    arm = pd.read_parquet(workdir / f"results/prompts/{MODEL}/svamp/arm.parquet")
    plain = pd.read_parquet(workdir / f"results/prompts/{MODEL}/svamp/none.parquet")
    assert [list(x) for x in arm["input_ids"]] == [list(x) for x in plain["input_ids"]]
    assert arm["arm"].all() and not plain["arm"].any()
    with h5py.File(workdir / f"results/attention/{MODEL}/svamp/arm.h5") as a, \
            h5py.File(workdir / f"results/attention/{MODEL}/svamp/none.h5") as b:
        assert json.loads(a.attrs["arm"])["c"] == 0.2 and json.loads(b.attrs["arm"]) == {}
        # ARM acts after layer 0's attention: the two jobs compute it alike (1e-6: well below any
        # change ARM makes, which starts at layer 1, and above float32 rounding in another order)
        np.testing.assert_allclose(a["received/layer_00"][:], b["received/layer_00"][:], rtol=1e-6, equal_nan=True)
        assert not np.allclose(a["received/layer_01"][:], b["received/layer_01"][:], equal_nan=True)


def test_mlp_outputs(tiny_run):
    workdir, *_ = tiny_run
    stats = {c: pd.read_csv(workdir / f"results/mlp/{MODEL}/svamp/{c}.csv") for c in CONDITIONS}
    for condition, frame in stats.items():
        assert len(frame) == 3 and frame["id"].tolist() == stats["none"]["id"].tolist()
        histogram = pd.read_csv(workdir / f"results/mlp/{MODEL}/svamp/{condition}.hist.csv")
        assert histogram["count"].sum() == frame["n_tokens"].sum() * 1536  # SmolLM2's intermediate size
        assert frame["gini"].between(0, 1).all() and frame["near_zero"].between(0, 1).all()
    # Causal attention: a question before the insertion cannot see it.
    columns = ["near_zero", "l1", "l2", "gini", "gate_variance"]
    pd.testing.assert_frame_equal(stats["mless_end"][columns], stats["none"][columns])
    assert not np.allclose(stats["mless"]["l1"], stats["none"]["l1"])
    # ARM redraws the entries nearest zero, so few stay below the threshold.
    assert (stats["arm"]["near_zero"] < stats["none"]["near_zero"]).all()
    summary = pd.read_csv(workdir / f"results/tables/mlp/{MODEL}/svamp.csv").set_index("condition")
    assert list(summary.index) == CONDITIONS
    assert summary.loc["none", "near_zero_delta"] == 0.0
    assert summary.loc["arm", "near_zero_delta_ci_high"] < 0
    assert (workdir / f"results/figures/mlp/{MODEL}/svamp.png").stat().st_size > 10_000


def test_pruning_outputs(tiny_run):
    """Heads ranked on half the prompts and counted on the others, both rankings swept, each
    prompt's metric kept, and the count's interval drawn from them."""
    from scipy.stats import spearmanr

    workdir, *_ = tiny_run
    folder = workdir / f"results/pruning/{MODEL}/ioi"  # the split; each ablation's scores and sweep below it
    scores = pd.read_csv(folder / "corrupted/scores.csv")
    assert len(scores) == 270 and sorted(scores["rank"]) == list(range(1, 271))
    assert scores.sort_values("rank")["exact"].is_monotonic_decreasing  # ranked by exact patching
    summary = json.loads((folder / "scores.json").read_text())
    assert summary["clean_metric"] > summary["corrupted_metric"] and summary["ablations"] == ["corrupted"]
    assert summary["by_ablation"]["corrupted"]["spearman_attribution_vs_exact"] == pytest.approx(
        spearmanr(scores["attribution"], scores["exact"]).statistic)
    ranked, counted = summary["ranked_on"], summary["counted_on"]
    assert len(ranked) == len(counted) == 4 and sorted(ranked + counted) == list(range(8))
    curves = pd.read_csv(folder / "corrupted/sweep.csv")
    assert set(curves["ranking"]) == {"exact", "attribution"}
    crossed = json.loads((folder / "corrupted/sweep.json").read_text())
    assert crossed["ranking"] == "exact" and crossed["n_prompts_counted_on"] == 4
    # the log grid and MIB's sizes (pruning.mib_sizes), with every k between the two points around the crossing
    grid = with_mib_sizes(k_grid(270, max_all=100), 270, True)
    per_prompt = pd.read_parquet(folder / "corrupted/per_prompt.parquet")
    for ranking, sweep in curves.groupby("ranking"):
        kept = sweep["heads_kept"]
        assert kept.is_monotonic_increasing and set(grid) <= set(kept)
        assert set(kept[sweep["refined"]]) == set(kept) - set(grid)
        rows = per_prompt[per_prompt["ranking"] == ranking]
        assert sorted(rows["prompt"].unique()) == counted  # counted on the prompts not ranked on
        means = rows.groupby("heads_kept")["metric"].mean()
        np.testing.assert_allclose(means.loc[kept].to_numpy(), sweep["metric"].to_numpy(), atol=1e-5)
        assert crossed["rankings"][ranking]["heads_to_reach_threshold"] == heads_to_reach(sweep, 0.9)
    sweep = curves[curves["ranking"] == "exact"]
    kept = sweep["heads_kept"]
    assert crossed["refined_points"] == int(sweep["refined"].sum())
    if crossed["heads_to_reach_threshold"]:  # found to the head, an upper bound off the grid
        needed = crossed["heads_to_reach_threshold"]
        assert needed - 1 in set(kept)
        assert crossed["unmeasured_below"] == needed - int((kept < needed).sum())
        assert crossed["heads_to_reach_exact"] == (crossed["unmeasured_below"] == 0)
        # the interval, recomputed by hand from the per-prompt metrics: the configured 1,000
        # resamples of the 4 counted prompts (seed 0), each one's first k at 0.9 explained effect
        wide = per_prompt[per_prompt["ranking"] == "exact"].pivot(index="heads_kept", columns="prompt",
                                                                  values="metric")
        counts = []
        for rows in np.random.default_rng(0).integers(0, 4, size=(1000, 4)):
            metric = wide.iloc[:, rows].mean(axis=1)
            gap = metric.iloc[-1] - metric.iloc[0]
            if gap == 0:
                continue  # explained effect undefined for this resample
            reached = metric.index[(metric - metric.iloc[0]) / gap >= 0.9]
            counts.append(reached[0] if len(reached) else np.inf)
        low, high = np.quantile(counts, 0.025, method="lower"), np.quantile(counts, 0.975, method="higher")
        assert crossed["heads_interval"] == [int(low), None if np.isinf(high) else int(high)]
    assert (workdir / "results/figures/pruning/corrupted/ioi.png").stat().st_size > 10_000


# ---- reruns: only what is stale ----


def _planned(tiny_run, tmp_path, edit=None) -> dict[str, int]:
    """Jobs a dry run schedules on the finished tiny run after ``edit`` of its config."""
    workdir, config, snakefile = tiny_run
    data = yaml.safe_load(config.read_text())
    if edit:
        edit(data)
    changed = tmp_path / config.name  # the same name: gathered tables carry it (plan.config_label)
    changed.write_text(yaml.safe_dump(data, sort_keys=False))  # key order is bar order
    dry = snakemake("-n", "--cores", "1", "--configfile", str(changed), workdir=workdir,
                    snakefile=snakefile)
    assert dry.returncode == 0, dry.stdout[-3000:]
    if "Nothing to be done" in dry.stdout:
        return {}
    counts = job_counts(dry.stdout)
    del counts["total"]
    return counts


def test_rerun_after_a_condition_length_changes(tiny_run, tmp_path):
    def edit(config):
        config["conditions"]["mless"]["length"] = 12
    # mless on 2 datasets; attention and MLP on svamp; then what shows mless
    assert _planned(tiny_run, tmp_path, edit) == {
        "make_prompts": 2, "generate": 2, "grade": 2, "extract_attention": 1, "mlp_activations": 1,
        "accuracy_table": 1, "accuracy_paired": 2, "plot_accuracy": 2, "placement_table": 2, "plot_placement": 2,
        "plot_attention_head": 1, "rank_attention_heads": 1, "lambda_summary": 1, "mlp_summary": 1,
        "plot_attention_figure": 1, "mediate": 1, "plot_mediation": 1, "mediation_table": 1, "all": 1}


def test_rerun_after_a_plot_option_changes(tiny_run, tmp_path):
    def edit(config):
        config["plots"] = {"dpi": 100}
    assert _planned(tiny_run, tmp_path, edit) == {
        "plot_accuracy": 2, "plot_placement": 2, "plot_attention_head": 1, "rank_attention_heads": 1,
        "lambda_summary": 1, "mlp_summary": 1, "plot_pruning": 1, "circuit_areas": 1, "plot_attention_figure": 1,
        "plot_mediation": 1, "all": 1}


def test_rerun_after_a_subset_size_changes(tiny_run, tmp_path):
    def edit(config):
        config["datasets"]["gsm8k"]["n"] = 2
    # gsm8k only: it has no attention or MLP analysis in the tiny config
    assert _planned(tiny_run, tmp_path, edit) == {
        "prepare_dataset": 1, "make_prompts": 4, "generate": 4, "grade": 4, "accuracy_table": 1,
        "accuracy_paired": 1, "plot_accuracy": 1, "placement_table": 1, "plot_placement": 1, "all": 1}


def test_rerun_after_arm_settings_change(tiny_run, tmp_path):
    def edit(config):
        config["models"]["smollm2-135m"]["arm"] = {"c": 0.3}
    assert _planned(tiny_run, tmp_path, edit) == {
        "generate": 2, "grade": 2, "extract_attention": 1, "mlp_activations": 1, "accuracy_table": 1,
        "accuracy_paired": 2, "plot_accuracy": 2, "plot_attention_head": 1, "rank_attention_heads": 1, "lambda_summary": 1,
        "mlp_summary": 1, "mediate": 1, "plot_mediation": 1, "mediation_table": 1, "all": 1}


def test_rerun_after_the_extraction_script_changes(tiny_run, tmp_path):
    _, _, snakefile = tiny_run
    script = snakefile.parent / "workflow/scripts/extract_attention.py"
    original, stat = script.read_text(), script.stat()
    script.write_text(original + "# edited\n")
    try:
        planned = _planned(tiny_run, tmp_path)
    finally:
        # Snakemake sees script edits by their modification time: restore both
        script.write_text(original)
        os.utime(script, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert planned == {"extract_attention": 4, "plot_attention_head": 1, "rank_attention_heads": 1,
                       "lambda_summary": 1, "plot_attention_figure": 1, "all": 1}
    assert _planned(tiny_run, tmp_path) == {}


# One job of each rule that computes numbers from a model or resamples them, deleted from a copy of
# the finished run and made again from the same inputs: determinism is a property of a rule's code
# (its seeds, orderings and reductions), so one cell per rule checks what a whole second run did
# (238 s on 2 cores) in the time of its longest chain, the pruning scores and sweep.
RECOMPUTED = {
    "generate": f"results/generations/{MODEL}/svamp/mless.parquet",  # then grade and the accuracy tables
    "extract_attention": f"results/attention/{MODEL}/svamp/mless.h5",  # then the attention tables
    "mlp_activations": f"results/mlp/{MODEL}/svamp/mless.csv",  # then the MLP table
    "mediate": f"results/mediation/{MODEL}/svamp/mless.json",  # then the mediation table
    "score_heads": f"results/pruning/{MODEL}/ioi/scores.json",  # then the sweep: its bootstrap
}


def test_each_rule_gives_the_same_tables_again(tiny_run, tmp_path):
    workdir, config, snakefile = tiny_run
    second = tmp_path / "second"
    for folder in ("resources", "results", ".snakemake"):  # copy2 keeps the times Snakemake compares
        shutil.copytree(workdir / folder, second / folder, symlinks=True,
                        ignore=shutil.ignore_patterns("locks", "incomplete", "log"))
    first_csvs = sorted(p.relative_to(workdir) for p in (workdir / "results").rglob("*.csv"))
    # the tables only, as targets: no figure holds a number to compare (targets before
    # --configfile, which takes every value after it; a dot file is a job's by-product)
    targets = [str(p) for p in first_csvs if not p.name.startswith(".")]
    outputs = list(RECOMPUTED.values())
    run = ["--cores", "2", *targets, "--configfile", str(config)]
    result = snakemake(*run, "--forcerun", *outputs, workdir=second, snakefile=snakefile, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:]
    ran = job_counts(result.stdout)
    assert all(ran.get(rule) == 1 for rule in RECOMPUTED), ran  # each rule's one job, once
    assert ran["sweep_heads"] == 1 and ran["grade"] == 1 and ran["generate"] == 1, ran
    assert first_csvs == sorted(p.relative_to(second) for p in (second / "results").rglob("*.csv"))
    different = [str(p) for p in first_csvs if (workdir / p).read_bytes() != (second / p).read_bytes()]
    assert not different
