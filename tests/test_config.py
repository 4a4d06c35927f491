"""Bad configs fail before any job runs, with messages that say what and where."""

import time

import yaml

from conftest import REPO, dry_run as _dry_run, job_counts, snakemake


def _tiny():
    return yaml.safe_load((REPO / "tests/configs/tiny.yaml").read_text())


def test_tiny_config_dry_run_counts_jobs(tmp_path):
    result = _dry_run(tmp_path, _tiny())
    assert result.returncode == 0, result.stdout
    counts = job_counts(result.stdout)
    # 1 model x 2 datasets x 4 conditions (one placed at the end, one ARM); attention and
    # the MLP analysis on 1 dataset, 1 configured head; pruning on 1 task; a placement
    # table and one placement figure per dataset.
    assert counts == {"prepare_model": 1, "prepare_dataset": 2, "make_prompts": 8, "generate": 8,
                      "grade": 8, "accuracy_table": 1, "plot_accuracy": 2, "extract_attention": 4,
                      "plot_attention_head": 1, "rank_attention_heads": 1, "lambda_summary": 1,
                      "mlp_activations": 4, "mlp_summary": 1, "placement_table": 2,
                      "plot_placement": 2, "score_heads": 1, "sweep_heads": 1, "plot_pruning": 1,
                      "all": 1, "total": 50}


def test_length_sweep_adds_one_figure_per_model_and_dataset(tmp_path):
    config = _tiny()
    config["conditions"]["mless_25"] = {"kind": "repeat", "unit": "/", "length": 25}
    result = _dry_run(tmp_path, config)
    assert result.returncode == 0, result.stdout
    assert job_counts(result.stdout)["plot_length_sweep"] == 2
    assert job_counts(_dry_run(tmp_path, _tiny()).stdout).get("plot_length_sweep") is None


def test_placement_sweep_only_when_a_condition_moves_the_insertion(tmp_path):
    config = _tiny()
    del config["conditions"]["mless_end"]
    counts = job_counts(_dry_run(tmp_path, config).stdout)
    assert "placement_table" not in counts and "plot_placement" not in counts
    # ARM and other placements stay out of the length sweep's lines
    config["conditions"]["mless_25"] = {"kind": "repeat", "unit": "/", "length": 25}
    assert job_counts(_dry_run(tmp_path, config).stdout)["plot_length_sweep"] == 2


def test_mlp_and_arm_settings_are_checked(tmp_path):
    config = _tiny()
    config["mlp"]["baseline"] = "plain"
    result = _dry_run(tmp_path, config)
    assert result.returncode != 0 and "mlp.baseline is 'plain', not in conditions" in result.stdout
    config = _tiny()
    config["models"]["smollm2-135m"]["arm"] = {"pmin": 0.3, "pmax": 0.1}
    result = _dry_run(tmp_path, config)
    assert result.returncode != 0 and "pmin (0.3) is above pmax (0.1)" in result.stdout
    config = _tiny()
    config["models"]["smollm2-135m"]["arm"] = {"mode": "swap"}
    result = _dry_run(tmp_path, config)
    assert result.returncode != 0 and "swap" in result.stdout
    config = _tiny()
    config["conditions"]["mless"]["placement"] = "middle"
    result = _dry_run(tmp_path, config)
    assert result.returncode != 0 and "middle" in result.stdout


def test_configfile_replaces_the_default_config(tmp_path):
    result = _dry_run(tmp_path, _tiny())
    assert "gemma3-270m" not in result.stdout and "math500" not in result.stdout


def test_unknown_key_is_named(tmp_path):
    config = _tiny()
    config["generation"]["max_new_tokenz"] = 5
    result = _dry_run(tmp_path, config)
    assert result.returncode != 0
    assert "'max_new_tokenz' was unexpected" in result.stdout
    assert "additionalProperties" in result.stdout


def test_wrong_type_is_named(tmp_path):
    config = _tiny()
    config["generation"]["batch_size"] = "sixteen"
    result = _dry_run(tmp_path, config)
    assert result.returncode != 0
    assert "'sixteen' is not of type 'integer'" in result.stdout
    assert "batch_size" in result.stdout


def test_condition_kind_requires_its_fields(tmp_path):
    config = _tiny()
    config["conditions"]["mless"] = {"kind": "repeat", "length": 5}
    result = _dry_run(tmp_path, config)
    assert result.returncode != 0 and "'unit' is a required property" in result.stdout


def test_names_cannot_escape_results(tmp_path):
    for bad in ["../evil", "a/b", "/abs", ".hidden"]:
        config = _tiny()
        config["conditions"][bad] = {"kind": "none"}
        result = _dry_run(tmp_path, config)
        assert result.returncode != 0, bad
        assert "does not match" in result.stdout and "propertyNames" in result.stdout, bad


def test_missing_local_model_folder_fails_before_jobs(tmp_path):
    config = _tiny()
    config["models"]["smollm2-135m"]["source"] = {"local": str(tmp_path / "no-such-model")}
    result = _dry_run(tmp_path, config)
    assert result.returncode != 0
    assert "models.smollm2-135m.source.local" in result.stdout
    assert "no config.json" in result.stdout


def test_missing_gguf_file_lists_what_is_there(tmp_path):
    config = _tiny()
    config["models"]["smollm2-135m"]["source"]["gguf_file"] = "nope.gguf"
    result = _dry_run(tmp_path, config)
    assert result.returncode != 0
    assert "no file 'nope.gguf'" in result.stdout and "SmolLM2-135M-Instruct.Q4_1.gguf" in result.stdout


def test_attention_cross_references_are_checked(tmp_path):
    config = _tiny()
    config["attention"]["top_changed"]["between"] = ["none", "mful"]
    result = _dry_run(tmp_path, config)
    assert result.returncode != 0 and "names ['mful'], not in conditions" in result.stdout
    config = _tiny()
    config["attention"]["datasets"] = ["math500"]
    result = _dry_run(tmp_path, config)
    assert result.returncode != 0 and "attention.datasets names ['math500']" in result.stdout


def test_paper_config_dry_run_is_fast_and_its_dag_stays_small(tmp_path):
    """5 hub models (no weights here) and 2 sparse copies of them, 2 datasets, 13 conditions
    (length and placement sweeps, ARM), 5 plotted heads, 4 pruning tasks: one job per
    model x dataset x condition at most."""
    started = time.perf_counter()
    result = snakemake("-n", "--cores", "1", "--configfile", str(REPO / "config/paper.yaml"),
                       workdir=tmp_path)
    elapsed = time.perf_counter() - started
    assert result.returncode == 0, result.stdout
    models = 7
    cells = models * 2 * 13  # models x datasets x conditions
    assert job_counts(result.stdout) == {
        "prepare_model": 5, "sparsify_model": 2, "plot_sparsify": 2, "prepare_dataset": 2,
        "make_prompts": cells, "generate": cells,
        "grade": cells, "accuracy_table": 1, "plot_accuracy": 2, "plot_length_sweep": models * 2,
        "placement_table": 2, "plot_placement": 2,
        "extract_attention": models * 13, "plot_attention_head": models * 5,
        "rank_attention_heads": models, "lambda_summary": models, "mlp_activations": models * 13,
        "mlp_summary": models, "score_heads": models * 4, "sweep_heads": models * 4, "plot_pruning": 4,
        "all": 1, "total": 877}
    assert elapsed < 10, f"dry run of the paper config took {elapsed:.1f} s"


def test_lint_passes():
    result = snakemake("--lint", workdir=REPO)
    assert result.returncode == 0, result.stdout
