"""The cost fit (attnlab.cost.model) and the GPU-memory refusal (attnlab.cost.budget).

The terms counted exactly (a model's parameters, the corrupted recordings of edge circuits) are
checked against what a built model and a real recording hold, at two sizes; the refusal through
the Snakemake command line, before any job."""

import json
from pathlib import Path

import pytest
import yaml

from attnlab.cost import budget, model as cost
from attnlab.config.checks import ConfigError
from attnlab.patching.edges import EdgeCircuits, recording_bytes
from conftest import REPO, dry_run
from test_attention import TINY
from test_edges_references import _batch, _pads

CONFIGS = REPO / "benchmarks" / "scale" / "model_configs"


def _shape(model) -> cost.Shape:
    return cost.Shape.of(model.config.to_dict())


@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2", "qwen2", "olmo", "gemma3-sliding", "mistral-sliding"])
def test_parameters_counted_from_the_config_equal_the_built_models_matrices(arch):
    """Embeddings, q/k/v/o and the MLP (the norms' vectors and biases left out: under 1% at 7B)."""
    model = TINY[arch]()
    matrices = sum(p.numel() for name, p in model.named_parameters()
                   if p.dim() == 2 and not name.endswith("wpe.weight"))  # GPT-2's positions: 1,024 x hidden
    assert _shape(model).parameters() == matrices


def test_the_papers_models_count_their_published_sizes():
    """From the committed config.json files: OLMo-7B 6.89B, Llama-3.1-8B 8.03B, Qwen2.5-Math-7B
    7.6B (biases aside), GPT-2 124M (its 0.8M learned positions aside)."""
    counted = {name: cost.Shape.of(json.loads((CONFIGS / f"{name}.json").read_text())).parameters() / 1e9
               for name in ("olmo-7b", "llama3.1-8b", "qwen2.5-math-7b", "gpt2")}
    assert counted["olmo-7b"] == pytest.approx(6.888, abs=0.001)
    assert counted["llama3.1-8b"] == pytest.approx(8.030, abs=0.001)
    assert counted["qwen2.5-math-7b"] == pytest.approx(7.615, abs=0.001)
    assert counted["gpt2"] == pytest.approx(0.1236, abs=0.0001)


@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2", "gemma3-sliding"])
def test_the_recordings_term_equals_a_recordings_bytes_at_two_depths(arch):
    """The corrupted recording of a mini-batch (every sender at its points, the residual at each
    reading point, the projections' outputs before the points): its bytes measured on a tiny
    model with all its layers and with two, against ``cost.features``' count."""
    full = TINY[arch]()
    for layers in (full.config.num_hidden_layers, 2):
        config = _with_layers(full.config.to_dict(), layers)
        model = type(full)(type(full.config).from_dict(config)).requires_grad_(False)
        batch = _batch(padding=_pads(arch))
        circuits = EdgeCircuits(model, batch, batch_size=6)
        rows = slice(0, 6)
        work = {"prompts": 6, "tokens": int(batch.clean.shape[1]), "batch": 6,
                "points": len(batch.differing_points(rows)), "points_per_batch": len(batch.differing_points(rows))}
        counted = cost.features("edge_circuit", cost.Shape.of(config), work)["recordings"] * 4
        assert recording_bytes(circuits.corrupted_run(0)) == counted, layers


@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2"])
def test_scorings_exact_terms_equal_what_one_scoring_pass_allocates(arch, monkeypatch):
    """EAP-IG over one mini-batch of 6 prompts: the receivers' gradients (ReceiverGradients'
    groups) and the clean and corrupted recordings at the points, measured on a tiny model,
    against ``cost.features``' gradients and senders terms."""
    from attnlab.patching import edges

    from attnlab import anatomy

    made = {"gradients": [], "recordings": [], "weights": []}
    for name, kind, real in (("ReceiverGradients", "gradients", edges.ReceiverGradients),
                             ("Recording", "recordings", edges.Recording)):
        monkeypatch.setattr(edges, name, lambda real=real, kind=kind, **kw: made[kind].append(real(**kw)) or made[kind][-1])
    heads_in = anatomy.heads_in  # the per-head weights the receivers' gradient hook reads (and copies)
    monkeypatch.setattr(anatomy, "heads_in", lambda *a: made["weights"].append(heads_in(*a)) or made["weights"][-1])
    model = TINY[arch]().requires_grad_(False)
    batch = _batch(padding=_pads(arch))
    EdgeCircuits(model, batch, batch_size=6).scores(2)
    points = len(batch.differing_points(slice(0, 6)))
    counted = cost.features("edge_scores", _shape(model), {"batch": 6, "tokens": int(batch.clean.shape[1]),
                                                           "points_per_batch": points})
    (gradients,), recordings = made["gradients"], made["recordings"]
    assert sum(t.numel() * t.element_size() for t in gradients.groups.values()) == counted["gradients"] * 4
    assert len(recordings) == 2 and sum(map(recording_bytes, recordings)) == counted["senders"] * 4
    # the fitted "projections" term counts the largest of them, the query projection's
    assert max(weight.numel() for weight in made["weights"]) == counted["projections"]


def _with_layers(config: dict, layers: int) -> dict:
    key = "n_layer" if config["model_type"] == "gpt2" else "num_hidden_layers"
    config = config | {key: layers}
    if config.get("layer_types"):
        config["layer_types"] = config["layer_types"][:layers]
    return config


def _coefficients(memory: dict, stage: str = "edge_circuit") -> dict:
    return {"stages": {stage: {"dtype_bytes": 4, "memory": memory, "constant_bytes": 0.0,
                               "seconds": {"cpu": {"multiply_adds": 1e-9, "receiver_elements": 0.0, "runs": 0.5}}}}}


def test_an_estimate_is_the_weights_plus_each_term_and_none_for_an_unknown_family():
    config = json.loads((CONFIGS / "olmo-7b.json").read_text())
    work = {"prompts": 8, "tokens": 20, "points": 128, "points_per_batch": 128, "batch": 8}
    table = _coefficients({"recordings": 4, "table": 4, "mixes": 4, "per_layer": 4, "activations": 10})
    found = cost.estimate("edge_circuit", config, work, 4, "cpu", table)
    shape = cost.Shape.of(config)
    terms = cost.features("edge_circuit", shape, work)
    assert found.weights_bytes == shape.parameters() * 4
    assert found.memory_bytes == pytest.approx(found.weights_bytes + 4 * terms["recordings"] + 4 * terms["table"]
                                               + 4 * terms["mixes"] + 4 * terms["per_layer"]
                                               + 10 * terms["activations"])
    stale = _coefficients({"recordings": 4, "table": 4, "activations": 10})  # fitted before "mixes"
    assert cost.estimate("edge_circuit", config, work, 4, "cpu", stale) is None
    assert cost.estimate("edge_circuit", config, work, 2, "cpu", table).weights_bytes == shape.parameters() * 2
    timed = cost.time_features("edge_circuit", shape, work)
    assert found.seconds == pytest.approx(1e-9 * timed["multiply_adds"] + 0.5)
    untimed = _coefficients(table["stages"]["edge_circuit"]["memory"])
    del untimed["stages"]["edge_circuit"]["seconds"]["cpu"]["runs"]  # fitted before a time feature was added
    assert cost.estimate("edge_circuit", config, work, 4, "cpu", untimed).seconds is None
    assert cost.estimate("edge_circuit", config, work, 4, "cuda", table).seconds is None  # no fit for it
    assert cost.estimate("edge_circuit", {"model_type": "mamba", "hidden_size": 8}, work, 4, "cpu", table) is None
    assert cost.estimate("lora_step", config, work, 4, "cpu", table) is None


@pytest.mark.parametrize("value", [0, -3, "many", float("inf")])
def test_a_gpu_memory_that_is_not_a_positive_number_is_refused_naming_the_resource(value):
    with pytest.raises(ConfigError, match="resource gpu_mem_gb is .*positive number"):
        budget.gpu_memory_limit(value)


def _big_model_config(tmp_path: Path) -> dict:
    """The tiny workflow with a local model of OLMo-7B's config (no weights: a dry run reads only
    its config.json) whose IOI edge circuit is planned."""
    folder = tmp_path / "olmo-shaped"
    folder.mkdir()
    (folder / "config.json").write_text((CONFIGS / "olmo-7b.json").read_text())
    config = yaml.safe_load((REPO / "tests/configs/tiny.yaml").read_text())
    config["models"]["olmo-shaped"] = {"source": {"local": str(folder)}, "prompt_format": "raw", "datasets": []}
    config["pruning"]["edges"] = {"tasks": ["ioi"], "models": ["olmo-shaped"]}
    return config


def test_a_plan_over_the_declared_gpu_memory_is_refused_before_any_job(tmp_path):
    """OLMo-7B's float32 weights alone (27.6 GB) exceed 16 GB; 200 GB holds the job."""
    config = _big_model_config(tmp_path)
    refused = dry_run(tmp_path, config, "--resources", "gpu_mem_gb=16")
    assert refused.returncode != 0, refused.stdout[-2000:]
    for needle in ("would hold more than the declared GPU memory (gpu_mem_gb=16)", "edge_circuit olmo-shaped ioi",
                   "weights 27.6 GB", "lower: pruning.edges.batch_size, pruning.edges.score_chunk"):
        assert needle in refused.stdout, (needle, refused.stdout[-3000:])
    assert not (tmp_path / "results").exists()
    # Snakemake itself refuses a negative or non-integer one, naming it; 0 reaches attnlab's check
    # (test_a_gpu_memory_that_is_not_a_positive_number_is_refused_naming_the_resource)
    bad = dry_run(tmp_path, config, "--resources", "gpu_mem_gb=-1")
    assert bad.returncode != 0 and "'gpu_mem_gb' was given value '-1'" in bad.stdout, bad.stdout[-2000:]
    allowed = dry_run(tmp_path, config, "--resources", "gpu_mem_gb=200")
    assert allowed.returncode == 0, allowed.stdout[-3000:]


def test_a_job_without_an_estimate_is_never_refused(tmp_path):
    """The embedded model's GGUF header gives its layers and heads, not its width: no estimate,
    so even a tiny declared memory lets its edge circuit run."""
    config = yaml.safe_load((REPO / "tests/configs/tiny.yaml").read_text())
    config["pruning"]["edges"] = {"tasks": ["ioi"]}
    jobs = budget.estimates(_validated(config), {"edge_models": ["smollm2-135m"]}, {}, tmp_path / "models")
    assert [job.estimate for job in jobs] == [None]
    assert "no estimate" in jobs[0].line()
    budget.check_gpu_memory(jobs, 0.001)  # not refused


def _validated(config: dict) -> dict:
    from attnlab.config.validate import check

    check(config, models_dir="/nonexistent")
    return config


def test_the_budget_counts_the_papers_olmo_edge_circuit_term_by_term():
    """config/paper.yaml's OLMo-7B IOI edge circuit (256 prompts, half ranked on, batch 4, 5
    steps, cache_gb 6): scoring holds 4 prompts' 57 patched points of gradients (3,105 receivers)
    and twice the recordings; the circuits keep 6 GB of recordings plus one mini-batch's."""
    config = _validated(yaml.safe_load((REPO / "config/paper.yaml").read_text()))
    olmo = json.loads((CONFIGS / "olmo-7b.json").read_text())
    shape = cost.Shape.of(olmo)
    pruning = config["pruning"]
    tokens, points, _ = budget.TASK_TOKENS["ioi"]
    scoring = cost.estimate("edge_scores", olmo, {"batch": 4, "tokens": tokens, "points_per_batch": 4 * points,
                                                  "prompts": 128, "steps": 5, "chunks": 1}, 4, "cuda")
    assert scoring.terms["gradients"] == pytest.approx(4 * points * 4096 * 3105 * 4)
    assert scoring.terms["senders"] == pytest.approx(2 * 4 * points * shape.recorded_per_point() * 4)
    found = budget.edge_estimate(olmo, "ioi", pruning)
    every = cost.features("edge_circuit", shape, {"batch": 4, "tokens": tokens, "points_per_batch": 4 * points,
                                                  "points": 128 * points, "prompts": 128})["recordings"] * 4
    circuit = budget.within_cache(cost.estimate("edge_circuit", olmo, {
        "batch": 4, "tokens": tokens, "points_per_batch": 4 * points, "points": 128 * points, "prompts": 128},
        4, "cuda"), 6, 4 / 128)
    assert circuit.terms["recordings"] == pytest.approx(6e9 + every * 4 / 128)
    assert found.memory_bytes == pytest.approx(max(scoring.memory_bytes, circuit.memory_bytes))
    assert 30e9 < found.memory_bytes < 45e9  # weights 27.6 GB and a few GB of edges


@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2", "gemma3-sliding"])
@pytest.mark.parametrize("ablation", ["corrupted", "zero"])
def test_the_references_term_equals_what_a_patcher_keeps_over_several_mini_batches(arch, ablation):
    """Six prompts in mini-batches of two: the head-patching engine keeps every mini-batch's
    references (each layer's heads' outputs under the ablation), not one mini-batch's."""
    from attnlab.patching.heads import Patcher

    model = TINY[arch]().requires_grad_(False)
    batch = _batch(padding=_pads(arch))
    patcher = Patcher(model, batch, ablation, batch_size=2)
    kept = sum(z.numel() * z.element_size() for chunk in patcher.references for z in chunk)
    work = {"prompts": 6, "batch": 2, "tokens": int(batch.clean.shape[1])}
    for stage in ("heads", "head_attribution"):
        assert cost.features(stage, _shape(model), work)["references"] * 4 == kept
