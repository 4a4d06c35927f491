"""Bad configs fail before any job runs, with messages that say what and where.

Most refusals are found in process (conftest.refusal: the check common.smk runs while Snakemake
parses); one dry run per class of refusal (the schema, a cross-reference, a model's source, a
layer out of range) checks that Snakemake prints it before any job."""

import re
import time

import yaml

from conftest import REPO, dry_run as _dry_run, fake_prepared_model, job_counts, refusal, snakemake


def _tiny():
    return yaml.safe_load((REPO / "tests/configs/tiny.yaml").read_text())


def test_tiny_config_dry_run_counts_jobs(tmp_path):
    result = _dry_run(tmp_path, _tiny())
    assert result.returncode == 0, result.stdout
    counts = job_counts(result.stdout)
    # 1 model x 2 datasets x 4 conditions (one placed at the end, one ARM); attention and
    # the MLP analysis on 1 dataset, 1 configured head, 1 composite figure; pruning on 1 task;
    # a placement table and one placement figure per dataset; the mediation of mless on svamp.
    assert counts == {"prepare_model": 1, "prepare_dataset": 2, "make_prompts": 8, "generate": 8,
                      "grade": 8, "accuracy_table": 1, "accuracy_paired": 2, "plot_accuracy": 2, "extract_attention": 4,
                      "plot_attention_head": 1, "rank_attention_heads": 1, "lambda_summary": 1,
                      "plot_attention_figure": 1,
                      "mlp_activations": 4, "mlp_summary": 1, "placement_table": 2,
                      "plot_placement": 2, "score_heads": 1, "sweep_heads": 1, "plot_pruning": 1, "circuit_areas": 1,
                      "mediate": 1, "plot_mediation": 1, "mediation_table": 1, "all": 1, "total": 57}
    # --configfile replaces the default config: none of its models or datasets is planned
    assert "gemma3-270m" not in result.stdout and "math500" not in result.stdout


def test_default_config_dry_run_counts_jobs_with_gemmas_edge_circuit(tmp_path):
    """make run's plan: 2 models x 2 datasets (MATH-500, arithmetic) x 4 conditions, attention and
    the MLP analysis on MATH-500, heads on IOI for both models, and the edge circuit of Gemma-3
    alone on IOI with its curve figure and its drawing (SmolLM2's: config/sparse-edges.yaml)."""
    result = snakemake("-n", "--cores", "2", workdir=tmp_path)  # no --configfile: config/config.yaml
    assert result.returncode == 0, result.stdout[-3000:]
    counts = job_counts(result.stdout)
    cells = 2 * 2 * 4
    assert counts == {"prepare_model": 2, "prepare_dataset": 2, "prepare_fewshot": 2, "make_prompts": cells,
                      "generate": cells, "grade": cells, "accuracy_table": 1, "accuracy_paired": 2, "plot_accuracy": 2,
                      "extract_attention": 2 * 4, "plot_attention_head": 2 * 2, "rank_attention_heads": 2,
                      "lambda_summary": 2, "mlp_activations": 2 * 4, "mlp_summary": 2,
                      "score_heads": 2, "sweep_heads": 2, "plot_pruning": 1, "circuit_areas": 1,
                      "edge_circuit": 1, "plot_edges": 1, "plot_circuit": 1, "all": 1, "total": 95}
    assert "results/circuits/gemma3-270m/ioi/curve.csv" in result.stdout
    assert "results/figures/circuits/gemma3-270m/ioi.circuit.png" in result.stdout
    assert "results/circuits/smollm2-135m" not in result.stdout


def test_make_sparse_runs_no_edge_circuit_and_its_edges_overlay_adds_only_the_edge_jobs(tmp_path):
    """make sparse (config/sparse.yaml) counts heads only; make sparse-edges (config/sparse-edges.yaml
    over it) adds both models' IOI edge circuits, their figures and table, and changes no head job."""
    sparse = ["--configfile", str(REPO / "config/sparse.yaml")]
    alone = snakemake("-n", "--cores", "2", *sparse, workdir=tmp_path / "a")
    both = snakemake("-n", "--cores", "2", *sparse, str(REPO / "config/sparse-edges.yaml"), workdir=tmp_path / "b")
    assert alone.returncode == 0 and both.returncode == 0, alone.stdout[-3000:] + both.stdout[-3000:]
    alone, both = job_counts(alone.stdout), job_counts(both.stdout)
    assert not {"edge_circuit", "plot_edges", "edges_vs_density", "plot_circuit"} & set(alone)
    added = {rule: both[rule] - alone.get(rule, 0) for rule in both if both[rule] != alone.get(rule, 0)}
    assert added == {"edge_circuit": 2, "plot_circuit": 2, "plot_edges": 1, "edges_vs_density": 1, "total": 6}


def test_edge_circuits_run_for_the_models_named_and_refuse_unknown_ones(tmp_path):
    config = _tiny()
    config["pruning"]["edges"] = {"tasks": ["ioi"]}  # models: null, every swept model
    counts = job_counts(_dry_run(tmp_path, config).stdout)
    assert counts["edge_circuit"] == 1 and counts["plot_edges"] == 1 and counts["plot_circuit"] == 1
    config["pruning"]["edges"]["models"] = []
    counts = job_counts(_dry_run(tmp_path, config).stdout)
    assert "edge_circuit" not in counts and "plot_edges" not in counts and counts["sweep_heads"] == 1
    config["pruning"]["edges"]["models"] = ["gemma"]
    assert "pruning.edges.models names ['gemma'], not in models: ['smollm2-135m']" in refusal(config, tmp_path)


def test_length_sweep_adds_one_figure_per_model_and_dataset(tmp_path):
    config = _tiny()
    config["conditions"]["mless_25"] = {"kind": "repeat", "unit": "/", "length": 25}
    result = _dry_run(tmp_path, config)
    assert result.returncode == 0, result.stdout
    assert job_counts(result.stdout)["plot_length_sweep"] == 2  # none without mless_25: the tiny plan's counts


def test_placement_sweep_only_when_a_condition_moves_the_insertion(tmp_path):
    config = _tiny()
    del config["conditions"]["mless_end"]
    counts = job_counts(_dry_run(tmp_path, config).stdout)
    assert "placement_table" not in counts and "plot_placement" not in counts
    # ARM and other placements stay out of the length sweep's lines
    config["conditions"]["mless_25"] = {"kind": "repeat", "unit": "/", "length": 25}
    assert job_counts(_dry_run(tmp_path, config).stdout)["plot_length_sweep"] == 2


def test_a_cross_reference_refusal_is_printed_by_a_dry_run_before_any_job(tmp_path):
    config = _tiny()
    config["mlp"]["baseline"] = "plain"
    result = _dry_run(tmp_path, config)
    assert result.returncode != 0 and "mlp.baseline is 'plain', not in conditions" in result.stdout
    assert "Job stats" not in result.stdout and not (tmp_path / "results").exists()


def test_mlp_and_arm_settings_are_checked(tmp_path):
    config = _tiny()
    config["mlp"]["baseline"] = "plain"
    assert "mlp.baseline is 'plain', not in conditions" in refusal(config, tmp_path)
    config = _tiny()
    config["models"]["smollm2-135m"]["arm"] = {"pmin": 0.3, "pmax": 0.1}
    assert "pmin (0.3) is above pmax (0.1)" in refusal(config, tmp_path)
    config = _tiny()
    config["models"]["smollm2-135m"]["arm"] = {"mode": "swap"}
    assert "swap" in refusal(config, tmp_path)
    config = _tiny()
    config["conditions"]["mless"]["arm_seed"] = 3
    assert "conditions.mless sets arm_seed without arm: true" in refusal(config, tmp_path)
    config = _tiny()
    config["conditions"]["mless"]["placement"] = "middle"
    assert "middle" in refusal(config, tmp_path)


def test_wrong_type_is_named(tmp_path):
    config = _tiny()
    config["generation"]["batch_size"] = "sixteen"
    message = refusal(config, tmp_path)
    assert "'sixteen' is not of type 'integer'" in message and "batch_size" in message


def test_condition_kind_requires_its_fields(tmp_path):
    config = _tiny()
    config["conditions"]["mless"] = {"kind": "repeat", "length": 5}
    assert "'unit' is a required property" in refusal(config, tmp_path)


def test_names_cannot_escape_results(tmp_path):
    for bad in ["../evil", "a/b", "/abs", ".hidden"]:
        config = _tiny()
        config["conditions"][bad] = {"kind": "none"}
        message = refusal(config, tmp_path)
        assert "does not match" in message and "propertyNames" in message, bad


def test_missing_local_model_folder_fails_before_jobs(tmp_path):
    config = _tiny()
    config["models"]["smollm2-135m"]["source"] = {"local": str(tmp_path / "no-such-model")}
    message = refusal(config, tmp_path)
    assert "models.smollm2-135m.source.local" in message and "no config.json" in message


def test_missing_gguf_file_lists_what_is_there(tmp_path):
    config = _tiny()
    config["models"]["smollm2-135m"]["source"]["gguf_file"] = "nope.gguf"
    result = _dry_run(tmp_path, config)
    assert result.returncode != 0
    assert "no file 'nope.gguf'" in result.stdout and "SmolLM2-135M-Instruct.Q4_1.gguf" in result.stdout


def test_attention_cross_references_are_checked(tmp_path):
    config = _tiny()
    config["attention"]["top_changed"]["between"] = ["none", "mful"]
    assert "names ['mful'], not in conditions" in refusal(config, tmp_path)
    config = _tiny()
    config["attention"]["datasets"] = ["math500"]
    assert "attention.datasets names ['math500']" in refusal(config, tmp_path)


def test_composite_figures_are_checked_before_any_job(tmp_path):
    config = _tiny()
    config["attention"]["figures"][0]["panels"][0]["dataset"] = "gsm8k"
    assert "panel 1: dataset 'gsm8k' has no attention files" in refusal(config, tmp_path)
    config = _tiny()
    config["attention"]["figures"][0]["panels"][1]["layer"] = 30
    result = _dry_run(tmp_path, config)  # before the model is prepared: its GGUF header says
    assert result.returncode != 0 and "has 30 layers x 9 heads" in result.stdout
    assert "Fix attention.figures in the config" in result.stdout and "source's metadata" in result.stdout
    fake_prepared_model(tmp_path / "resources/models/smollm2-135m", layers=32)
    assert refusal(config, tmp_path) is None  # once prepared, its own config.json
    config["attention"]["figures"][0]["panels"][1]["layer"] = 32
    message = refusal(config, tmp_path)
    assert "has 32 layers x 9 heads" in message and "resources/models/smollm2-135m/config.json" in message


def test_paper_config_dry_run_is_fast_and_its_dag_stays_small(tmp_path):
    """4 hub models of 2510.01032 on 2 datasets x 13 conditions (length and placement sweeps, ARM),
    5 plotted heads, 3 composite attention figures; 2512.05865's GPT-2 and OLMo-7B (no datasets:
    kept for their circuits) with their sparse copies; 4 pruning tasks for all 8 models, edge
    circuits of GPT-2, OLMo-7B and their copies on 2 tasks, the heads- and edges-vs-density
    tables: one job per model x dataset x condition at most."""
    started = time.perf_counter()
    result = snakemake("-n", "--cores", "1", "--configfile", str(REPO / "config/paper.yaml"),
                       workdir=tmp_path)
    elapsed = time.perf_counter() - started
    assert result.returncode == 0, result.stdout
    on_datasets, swept = 4, 8
    cells = on_datasets * 2 * 13  # models x datasets x conditions
    assert job_counts(result.stdout) == {
        "prepare_model": 6, "sparsify_model": 2, "plot_sparsify": 2, "prepare_dataset": 2,
        "make_prompts": cells, "generate": cells,
        "grade": cells, "accuracy_table": 1, "accuracy_paired": 2, "plot_accuracy": 2,
        "plot_length_sweep": on_datasets * 2,
        "placement_table": 2, "plot_placement": 2,
        "extract_attention": on_datasets * 13, "plot_attention_head": on_datasets * 5, "plot_attention_figure": 3,
        "rank_attention_heads": on_datasets, "lambda_summary": on_datasets, "mlp_activations": on_datasets * 13,
        "mlp_summary": on_datasets, "score_heads": swept * 4, "sweep_heads": swept * 4, "plot_pruning": 4,
        "heads_vs_density": 1, "edge_circuit": 4 * 2, "plot_circuit": 4 * 2, "plot_edges": 2,
        "edges_vs_density": 1, "all": 1, "circuit_areas": 1, "total": 570}
    assert elapsed < 10, f"dry run of the paper config took {elapsed:.1f} s"


def test_lint_passes():
    result = snakemake("--lint", workdir=REPO)
    assert result.returncode == 0, result.stdout


# ---- clear errors for bad input, before any job ----


def _readme_commands() -> list[list[str]]:
    """The commands of the README's "Running Snakemake yourself" block that run the workflow."""
    import re
    import shlex

    readme = (REPO / "README.md").read_text()
    block = re.search(r"## Running Snakemake yourself\s+```bash\n(.*?)```", readme, re.S).group(1)
    commands = [shlex.split(line, comments=True) for line in block.splitlines()]
    # my.yaml stands for the reader's own file; --report renders results that do not exist yet
    return [c for c in commands if c and c[0] == "snakemake" and "my.yaml" not in c and "--report" not in c]


def test_readme_commands_pass_a_dry_run(tmp_path):
    import subprocess
    import sys

    commands = _readme_commands()
    assert any("--config" in c for c in commands) and len(commands) >= 4
    for command in commands:
        dry = [sys.executable, "-m", "snakemake", *command[1:], "-n", "--directory", str(tmp_path)]
        result = subprocess.run(dry, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, timeout=300)
        assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout}"


def test_nested_command_line_values_are_read_as_yaml():
    """`--config generation='{max_new_tokens: 64}'` arrives as {'max_new_tokens': '64'}."""
    from attnlab.config.schema import validate_config

    config = _tiny()
    config["generation"] = {"max_new_tokens": "64", "stop_strings": ["1"]}
    config["attention"]["datasets"] = "null"
    config["conditions"]["mless"].update(length="10", unit="1", arm="true")
    validate_config(config, REPO / "config/schema.yaml")
    assert config["generation"]["max_new_tokens"] == 64 and config["generation"]["batch_size"] == 16
    assert config["generation"]["stop_strings"] == ["1"]  # strings stay strings
    assert config["attention"]["datasets"] is None
    assert config["conditions"]["mless"] == {"kind": "repeat", "unit": "1", "length": 10, "arm": True,
                                             "placement": "between", "seed": 0}


def test_unknown_key_prints_the_allowed_keys_not_the_schema(tmp_path):
    """A schema refusal, printed by a dry run before any job."""
    config = _tiny()
    config["generation"]["max_new_tokenz"] = 5
    result = _dry_run(tmp_path, config)
    assert result.returncode != 0 and "Job stats" not in result.stdout
    assert "'max_new_tokenz' was unexpected" in result.stdout and "additionalProperties" in result.stdout
    assert ("unknown config key generation.max_new_tokenz" in result.stdout
            and "Allowed keys under generation: batch_size, device, dtype, engine, max_new_tokens, seed, "
                "stop_strings." in result.stdout)
    assert "$defs" not in result.stdout and len(result.stdout.splitlines()) < 10, result.stdout


def test_empty_selection_means_none_and_null_all(tmp_path):
    config = _tiny()
    config["attention"]["datasets"] = []
    config["attention"].pop("figures", None)  # composite figures need an attention dataset
    config["pruning"]["models"] = []
    counts = job_counts(_dry_run(tmp_path, config).stdout)
    # mlp.datasets null follows attention.datasets: none either
    for rule in ("extract_attention", "mlp_activations", "score_heads", "plot_pruning"):
        assert rule not in counts, rule
    config["attention"]["datasets"] = config["pruning"]["models"] = None
    config["mlp"]["datasets"] = []
    counts = job_counts(_dry_run(tmp_path, config).stdout)
    assert counts["extract_attention"] == 8 and counts["score_heads"] == 1  # every dataset, every model
    assert "mlp_activations" not in counts


def test_condition_names_cannot_collide_with_output_suffixes(tmp_path):
    config = _tiny()
    config["mlp"]["datasets"] = ["svamp"]
    config["conditions"]["none.hist"] = {"kind": "none"}  # refused by the check, before Snakemake's
    assert "a name under conditions: 'none.hist' does not match" in refusal(config, tmp_path)  # ambiguity


def test_bad_template_and_range_fail_in_a_dry_run(tmp_path):
    config = _tiny()
    config["prompt"] = {"raw_template": "{system}\n{user}\nAnswer ({units}):"}
    assert r"unknown placeholder(s) {units}" in refusal(config, tmp_path)
    config = _tiny()
    config["datasets"]["svamp"]["source"] = {"arithmetic": {"low": 9, "high": 2}}
    assert "datasets.svamp.source.arithmetic: low (9) is above high (2)" in refusal(config, tmp_path)


def test_chat_format_on_a_prepared_model_without_template_fails_in_a_dry_run(tmp_path):
    folder = fake_prepared_model(tmp_path / "resources/models/smollm2-135m", chat_template=False)
    assert ("models.smollm2-135m.prompt_format is 'chat' but the model's tokenizer has no chat template"
            in refusal(_tiny(), tmp_path))
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    assert refusal(_tiny(), tmp_path) is None


def test_one_entry_point_checks_schema_and_cross_references_without_snakemake(tmp_path):
    """validate.check: the schema (defaults filled in place) and every cross-reference, each
    problem one ConfigError naming the key; layers and heads against a prepared model folder."""
    import pytest

    from attnlab.config.sources import SourceError
    from attnlab.config.validate import ConfigError, check

    config = _tiny()
    check(config, models_dir=tmp_path)
    assert config["generation"]["max_new_tokens"] > 0 and "pmin" in config["models"]["smollm2-135m"]["arm"]
    broken = [
        (lambda c: c.update(bogus=1), "unknown config key bogus"),
        (lambda c: c["attention"]["top_changed"].update(between=["none", "mful"]), "not in conditions"),
        (lambda c: c.update(prompt={"raw_template": "{system} {user} {units}"}), "unknown placeholder(s) {units}"),
        (lambda c: c["pruning"].update(compare=["smollm2-135m", "nope"]), "pruning names models ['nope']"),
        (lambda c: c["models"]["smollm2-135m"]["source"].update(gguf_file="missing.gguf"), "missing.gguf"),
    ]
    for breaks, message in broken:
        config = _tiny()
        breaks(config)
        with pytest.raises(ConfigError, match=re.escape(message)):
            check(config, models_dir=tmp_path)
    assert issubclass(SourceError, ConfigError)
    fake_prepared_model(tmp_path / "smollm2-135m", layers=2, heads=3)
    config = _tiny()
    config["attention"]["heads"] = [{"layer": 5, "head": 0}]
    with pytest.raises(ConfigError, match="attention.heads"):
        check(config, models_dir=tmp_path)


def test_jobs_import_this_workflows_own_library(tmp_path):
    """A job's script finds the library beside its Snakefile, before any installed attnlab (a
    conda env without the package, a virtualenv shared by two clones): no path line needed."""
    from conftest import copy_config, copy_workflow

    snakefile = copy_workflow(tmp_path / "clone")
    script = tmp_path / "clone/workflow/scripts/prepare_dataset.py"
    script.write_text(script.read_text() + "import logging, attnlab\n"
                      "logging.getLogger('attnlab').info('library: %s', attnlab.__file__)\n")
    config = copy_config("tiny.yaml", tmp_path)
    result = snakemake("results/data/gsm8k.parquet", "--cores", "1", "--configfile", str(config),
                       workdir=tmp_path, snakefile=snakefile)
    assert result.returncode == 0, result.stdout[-3000:]
    log = (tmp_path / "results/logs/prepare_dataset/gsm8k.log").read_text()
    assert f"library: {tmp_path / 'clone/src/attnlab/__init__.py'}" in log, log[-2000:]
