"""The config's per-model settings through the workflow: the datasets a model runs on, and the
memory its jobs ask for from the size of its weights."""

import json
import re

import yaml

from conftest import REPO, dry_run as _dry_run, fake_prepared_model, job_counts


def _tiny():
    return yaml.safe_load((REPO / "tests/configs/tiny.yaml").read_text())


def test_a_7b_models_jobs_ask_for_the_memory_its_weights_need(tmp_path):
    """Once prepared, a model's safetensors size sets its jobs' mem_mb (a sparse file of a 7B
    float32 model's 27.6 GB here): 1.25x the weights + 4 GB, doubled per retry; the rules' floors
    stay for small models."""
    import struct

    from attnlab.cost.defaults import model_memory_mb

    assert model_memory_mb(0, 16000) == 16000 and model_memory_mb(0, 8000, attempt=2) == 16000
    assert model_memory_mb(27_600_000_000, 16000) == 38500 and model_memory_mb(27_600_000_000, 16000, 2) == 77000
    folder = fake_prepared_model(tmp_path / "resources/models/smollm2-135m")
    size = 27_600_000_000
    header = json.dumps({"w": {"dtype": "F32", "shape": [size // 4], "data_offsets": [0, size]}}).encode()
    with open(folder / "model.safetensors", "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.truncate(8 + len(header) + size)  # sparse: no disk used
    result = _dry_run(tmp_path, _tiny())
    assert result.returncode == 0, result.stdout[-2000:]
    jobs = result.stdout.split("\n\n")
    generate = next(job for job in jobs if "rule generate:" in job)
    mlp = next(job for job in jobs if "rule mlp_activations:" in job)
    assert "mem_mb=38500" in generate and "mem_mb=38500" in mlp, generate


def test_a_models_datasets_are_checked_and_plan_only_its_cells(tmp_path):
    """models.*.datasets: a name that is not a dataset, a composite figure of a model on a dataset
    it does not run, refused; a model on one of the two datasets has that dataset's cells only."""
    import pytest

    from attnlab.config.plan import model_datasets, models_on
    from attnlab.config.validate import ConfigError, check

    config = _tiny()
    config["models"]["smollm2-135m"]["datasets"] = ["nope"]
    with pytest.raises(ConfigError, match=re.escape("models.smollm2-135m.datasets names ['nope']")):
        check(config, models_dir=tmp_path)
    config = _tiny()
    others = [name for name in config["datasets"] if name not in (config["attention"]["datasets"] or [])]
    config["models"]["smollm2-135m"]["datasets"] = others
    with pytest.raises(ConfigError, match="is not run on"):
        check(config, models_dir=tmp_path)
    config["attention"]["figures"] = []
    check(config, models_dir=tmp_path)
    assert model_datasets(config) == {"smollm2-135m": others}
    assert models_on(config, others[0]) == ["smollm2-135m"]
    counts = job_counts(_dry_run(tmp_path, config).stdout)
    assert counts["generate"] == 4 * len(others) and "extract_attention" not in counts


def test_the_mechanism_config_reuses_the_defaults_shared_jobs():
    """What README and config/mechanism.yaml say: after make run, make mechanism reuses the jobs of
    the cells the two share (both models on arithmetic under none, mless, mful, random). Snakemake
    reruns a job whose parameters change: every parameter those jobs' rules take is equal here,
    read through the library functions the rules call."""
    from attnlab.config.plan import cell_generation, fewshot_shots, fewshot_spec
    from attnlab.config.schema import validate_config
    from attnlab.config.sources import sparse_bases

    configs = []
    for name in ("config.yaml", "mechanism.yaml"):
        config = yaml.safe_load((REPO / "config" / name).read_text())
        validate_config(config, REPO / "config" / "schema.yaml")
        configs.append(config)
    default, mechanism = configs
    shared_models = sorted(set(default["models"]) & set(mechanism["models"]))
    shared_datasets = sorted(set(default["datasets"]) & set(mechanism["datasets"]))
    shared_conditions = sorted(set(default["conditions"]) & set(mechanism["conditions"]))
    assert (shared_models, shared_datasets, shared_conditions) == (
        ["gemma3-270m", "smollm2-135m"], ["arithmetic"], ["mful", "mless", "none", "random"])

    def parameters(config, model, dataset, condition):
        spec = config["models"][model]
        return {"model source": spec["source"], "prompt format": spec["prompt_format"],
                "fewshot": fewshot_shots(config["models"], config["prompt"])[model],
                "fewshot spec": fewshot_spec(dataset, config["datasets"][dataset]),
                "fewshot seed": config["prompt"]["fewshot_seed"],
                "dataset": {k: v for k, v in config["datasets"][dataset].items() if k != "generation"},
                "condition": config["conditions"][condition],
                "prompt": {key: config["prompt"][key] for key in ("system", "raw_template")},
                "generation": cell_generation(config, model, dataset),
                "arm": spec["arm"] if config["conditions"][condition]["arm"] else None,
                "grading": config["grading"], "sparse bases": sparse_bases(config["models"])}
    for model in shared_models:
        for condition in shared_conditions:
            assert parameters(default, model, "arithmetic", condition) == parameters(
                mechanism, model, "arithmetic", condition), (model, condition)


def test_the_fields_models_config_plans_every_stage_for_each_family(tmp_path):
    """config/models.yaml: Pythia (GPT-NeoX), Gemma-2, Qwen3, Mistral and Phi-3, prepared here as
    folders of their own model_type (what the config check reads), plan every stage on each:
    generation and grading, extraction, the MLP analysis, head scoring and sweeps, edge circuits
    of Pythia, its sparse copy and Qwen3, and the copy's post-training."""
    config = yaml.safe_load((REPO / "config/models.yaml").read_text())
    types = {"pythia-160m": ("gpt_neox", 12, 12), "gemma2-2b": ("gemma2", 26, 8), "qwen3-0.6b": ("qwen3", 28, 16),
             "mistral-7b": ("mistral", 32, 32), "phi3-mini": ("phi3", 32, 32)}
    for name, (model_type, layers, heads) in types.items():
        fake_prepared_model(tmp_path / "resources/models" / name, layers=layers, heads=heads,
                            chat_template=config["models"][name]["prompt_format"] == "chat", model_type=model_type)
    result = _dry_run(tmp_path, config)
    assert result.returncode == 0, result.stdout[-3000:]
    counts = job_counts(result.stdout)
    cells = 5 * 3  # dense models x conditions on gsm8k
    assert {stage: counts.get(stage) for stage in ("generate", "extract_attention", "mlp_activations", "score_heads",
                                                    "sweep_heads", "edge_circuit", "sparsify_model")} == {
        "generate": cells, "extract_attention": cells, "mlp_activations": cells, "score_heads": 6 * 2,
        "sweep_heads": 6 * 2, "edge_circuit": 3, "sparsify_model": 1}
    assert "the fused attention kernels lack attention logit soft-capping" in result.stdout  # Gemma-2, said before any job
