"""What GPU rules' jobs ask the scheduler for (attnlab.cost.requests): the cost fit's estimate
with its margins on the CPU, the weights rule on a GPU, the rule's old request where nothing can
be estimated, and the values Snakemake's plan shows."""

import json
import math
import re

import pandas as pd
import pytest
import yaml

from attnlab.cost import model as cost, requests
from attnlab.cost.defaults import model_memory_mb
from conftest import REPO, dry_run
from test_cost import CONFIGS, _big_model_config, _validated

OLMO = json.loads((CONFIGS / "olmo-7b.json").read_text())
GENERATION = {"batch": 64, "new_tokens": 2048, "prompt_tokens": 302}


def _request(model_json, work, device="cpu", attempt=1, repeats=1, element_bytes=4, weights=0):
    return requests.request("generation", model_json, work, device=device, element_bytes=element_bytes,
                            weights=weights, least_mb=16000, least_min=120, attempt=attempt, repeats=repeats)


def test_on_the_cpu_a_job_asks_the_fits_estimate_with_its_margins():
    """OLMo-7B generating 2,048 tokens after 302 at batch 64 in float32: the weights (6.888e9
    parameters) and the KV cache (64 rows x 2,350 tokens x 32 layers x keys and values x 4,096)
    alone are 105 GB. The request: the weights, the rest of the estimate widened by the fit's
    largest memory error on generation, 1 GB for the process; the minutes times its largest time
    factor; both doubled on the second attempt."""
    weights_and_cache = 6.888e9 * 4 + 64 * 2350 * 32 * 2 * 4096 * 4
    fit = json.loads(cost.COEFFICIENTS.read_text())["stages"]["generation"]["fit"]
    found = cost.estimate("generation", OLMO, GENERATION, 4, "cpu")
    asked = _request(OLMO, GENERATION)
    above = found.memory_bytes - found.weights_bytes
    assert asked.mem_mb == math.ceil((found.weights_bytes + above * (1 + fit["largest_memory_error"]) + 1e9) / 1e6)
    assert asked.mem_mb > (weights_and_cache + 1e9) / 1e6
    assert asked.runtime == math.ceil(found.seconds * fit["largest_time_factor"] / 60)
    again = _request(OLMO, GENERATION, attempt=2)
    assert (again.mem_mb, again.runtime) == (2 * asked.mem_mb, 2 * asked.runtime)
    assert f"x{fit['largest_time_factor']:.2f} (its largest errors" in asked.line()


def test_a_small_workload_never_asks_less_than_its_rules_request():
    """A few tokens: the estimate is under the rule's 16 GB and 120 min, which stand."""
    asked = _request(OLMO, {"batch": 1, "new_tokens": 1, "prompt_tokens": 4}, weights=int(27.6e9))
    assert asked.mem_mb == model_memory_mb(int(27.6e9), 16000) == int(1.25 * 27.6e3) + 4000
    assert asked.runtime >= 120


def test_on_a_gpu_the_host_asks_the_weights_rule_and_the_estimate_is_at_the_jobs_dtype():
    asked = _request(OLMO, GENERATION, device="cuda", element_bytes=2, weights=int(13.8e9))
    assert (asked.mem_mb, asked.runtime) == (int(1.25 * 13.8e3) + 4000, 120)
    assert asked.estimate.weights_bytes == pytest.approx(6.888e9 * 2, rel=1e-3)
    assert asked.estimate.terms["kv_cache"] == 64 * 2350 * 32 * 2 * 4096 * 2
    assert "no GPU time fit" in asked.basis


@pytest.mark.parametrize("model_json, work, why", [
    (None, GENERATION, "its config.json is not at hand yet"),
    ({"model_type": "bert", "hidden_size": 8}, GENERATION, "the cost fit has no family or stage for it"),
    (OLMO, None, "its workload is not known before its inputs exist"),
])
def test_a_job_the_fit_cannot_estimate_asks_its_rules_request_and_says_why(model_json, work, why):
    asked = _request(model_json, work, attempt=2, weights=int(1e9))
    assert (asked.mem_mb, asked.runtime) == (2 * 16000, 240)
    assert asked.estimate is None and why in asked.basis and "the rule's request" in asked.basis


def _config_with_olmo(tmp_path):
    config = _validated(_big_model_config(tmp_path))
    config["models"]["olmo-shaped"]["datasets"] = list(config["datasets"])[:1]
    return config


def test_generation_reads_the_longest_prompt_once_the_prompts_exist(tmp_path):
    config = _config_with_olmo(tmp_path)
    dataset = config["models"]["olmo-shaped"]["datasets"][0]
    prompts = tmp_path / "prompts.parquet"
    wildcards = {"model": "olmo-shaped", "dataset": dataset, "condition": "none"}

    def asked():
        return requests.job_request("generate", config, wildcards, {"prompts": str(prompts)}, attempt=1,
                                    local=True, batch=8, bases={}, models_dir=str(tmp_path / "models"))
    assert "not known before its inputs exist" in asked().basis  # the plan, before make_prompts
    pd.DataFrame({"n_prompt_tokens": [10, 300, 20]}).to_parquet(prompts)
    settings = {**config["generation"], **config["datasets"][dataset].get("generation", {})}
    # 3 prompts: one batch of 3 (every batch as long as the longest prompt)
    work = {"prompts": 3, "batch": 3, "new_tokens": settings["max_new_tokens"], "prompt_tokens": 300}
    device = requests.job_device(settings["device"], True)
    assert asked().estimate == cost.estimate("generation", OLMO, work, requests.dtype_bytes("auto", device), device)


def test_scoring_asks_minutes_for_each_ablation(tmp_path):
    """Two ablations: each scores every head on the ranked prompts, so twice the fitted time."""
    config = _config_with_olmo(tmp_path)
    config["pruning"]["ablation"] = ["corrupted", "zero"]

    def asked(pruning):
        return requests.job_request("score_heads", {**config, "pruning": pruning}, {"model": "olmo-shaped", "task": "ioi"},
                                    {}, attempt=1, local=True, batch=2, bases={}, models_dir=str(tmp_path / "m"))
    two, one = asked(config["pruning"]), asked({**config["pruning"], "ablation": "corrupted"})
    if two.device == "cpu":
        margin, factor = requests.margins("heads", OLMO["model_type"])  # the larger of attribution's and exact's
        fits = [json.loads(cost.COEFFICIENTS.read_text())["stages"][name]["fit"] for name in ("heads", "head_attribution")]
        assert (margin, factor) == (max(fit["largest_memory_error"] for fit in fits),
                                    max(fit["largest_time_factor"] for fit in fits))
        assert two.runtime == math.ceil(two.estimate.seconds * 2 * factor / 60) > one.runtime
    assert two.estimate == one.estimate
    # exact patching: every layer's input of the clean and corrupted rows of one mini-batch of 2
    # (of 4 ranked prompts)
    ranked, _ = requests.prompt_split(config["pruning"], "ioi")
    work, _ = requests.heads_work(config["pruning"], "ioi", 2)
    exact = cost.estimate("heads", OLMO, work, 4, "cpu")
    fitted = cost.load_coefficients()["stages"]["heads"]["memory"]["recorded"]
    assert exact.terms["recorded"] == pytest.approx(fitted * 32 * 2 * 2 * 20 * 4096) and ranked == 4


def test_the_plan_shows_each_fitted_jobs_request(tmp_path):
    """A dry run of the tiny workflow with an OLMo-7B-shaped local model planned for IOI edge
    circuits: its score_heads and edge_circuit jobs show the requests the library gives; the
    embedded model's generate jobs, whose prompts do not exist yet, the rule's 16 GB."""
    config = _big_model_config(tmp_path)
    planned = dry_run(tmp_path, config)
    assert planned.returncode == 0, planned.stdout[-3000:]
    shown = _resources_by_job(planned.stdout)
    validated = _validated(yaml.safe_load(yaml.safe_dump(config)))
    for rule, wildcards, batch in (("score_heads", {"model": "olmo-shaped", "task": "ioi"},
                                    validated["pruning"]["batch_size"]),
                                   ("edge_circuit", {"model": "olmo-shaped", "task": "ioi"},
                                    validated["pruning"]["edges"]["batch_size"])):
        expected = requests.job_request(rule, validated, wildcards, {}, attempt=1, local=True, batch=batch,
                                        bases={}, models_dir=str(tmp_path / "resources/models"))
        assert expected.estimate is not None
        assert shown[(rule, "olmo-shaped")] == (expected.mem_mb, expected.runtime)
    assert shown[("score_heads", "olmo-shaped")][0] > 27_552 + 1000  # 27.6 GB of float32 weights, the process, more
    assert any(rule == "generate" and memory == 16000 for (rule, _), (memory, _) in shown.items())


def _resources_by_job(output: str) -> dict:
    """(rule, model) -> (mem_mb, runtime) of each job a dry run prints."""
    shown = {}
    for block in output.split("\nrule ")[1:]:
        rule = block.split(":", 1)[0]
        model = re.search(r"wildcards: .*?model=([^,\n]+)", block)
        resources = re.search(r"resources: .*?runtime=(\d+).*?mem_mb=(\d+)", block)
        if model and resources:
            shown[(rule, model.group(1))] = (int(resources.group(2)), int(resources.group(1)))
    return shown


@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2"])
def test_mediations_recorded_term_counts_what_a_run_records(arch):
    """cost.features' mediation "recorded" (both conditions) is twice what one real Run holds:
    every layer's head inputs and MLP output, and the residual stream of each patched layer."""
    from attnlab.mechanism.mediation.effects import record, recorded_parts
    from attnlab.mechanism.mediation.runs import directions
    from test_attention import TINY
    from test_mediation import _items

    model = TINY[arch]()
    items = _items()
    treated = directions(items)[1].recipient
    for layers, patched in ((None, 3), ([2], 2)):  # every layer; layer 2 (and layer 0, always)
        run = record(model, treated, len(items), recorded_parts(model, layers))
        held = sum(t.numel() for t in run.head_inputs) + sum(t.numel() for t in run.outputs.values())
        work = {"prompts": len(items), "tokens": int(treated.clean.shape[1]), "patched": patched}
        assert cost.features("mediation", cost.Shape.of(model.config.to_dict()), work)["recorded"] == 2 * held
    # the positions whose every logit the metric reads: the workload's "scored"
    sizes = requests.mediation_sizes(len(items), 4, 100, max(len(item.continuation) for item in items), 0, None)
    assert treated.read_positions == sizes["scored"]


def test_mediation_reads_its_items_prompts_and_generations(tmp_path):
    """mediate's workload: the treated prompts' items (max_items of them), the longest prompt plus
    the longest generation, the patched layers (0 always) and the ARM seeds."""
    section = {"max_items": 3, "arm_seeds": [0, 1], "patched_layers": [5, 9]}
    treated, generations = tmp_path / "treated.parquet", tmp_path / "generations.parquet"
    assert requests.mediation_work(section, {"treated": str(treated), "generations": str(generations)}, 8) is None
    pd.DataFrame({"n_prompt_tokens": [40, 52, 47, 50]}).to_parquet(treated)
    pd.DataFrame({"n_new_tokens": [100, 7, 300, 12]}).to_parquet(generations)
    work = requests.mediation_work(section, {"treated": str(treated), "generations": str(generations)}, 8)
    assert work == {"prompts": 3, "batch": 3, "tokens": 352, "scored": 301, "arm_seeds": 2, "patched": 3}
    assert requests.mediation_work({**section, "patched_layers": None, "max_items": None},
                                   {"treated": str(treated), "generations": str(generations)}, 2) == {
        "prompts": 4, "batch": 2, "tokens": 352, "scored": 301, "arm_seeds": 2}


def test_a_family_the_fit_has_not_seen_is_widened_by_its_held_out_errors():
    """Llama was fitted: its own largest errors. Mistral was not: the worst errors of a fit
    without each measured family, predicting it (for edges the larger of scoring's and the circuits')."""
    table = json.loads(cost.COEFFICIENTS.read_text())
    assert "llama" in table["model_types"] and "mistral" not in table["model_types"]
    fits = {stage: table["stages"][stage]["fit"] for stage in ("mediation", "edge_scores", "edge_circuit")}
    assert requests.margins("mediation", "llama") == (fits["mediation"]["largest_memory_error"],
                                                      fits["mediation"]["largest_time_factor"])
    held = {stage: fit["held_out_family"] for stage, fit in fits.items()}
    assert requests.margins("mediation", "mistral") == (held["mediation"]["largest_memory_error"],
                                                        held["mediation"]["largest_time_factor"])
    assert requests.margins("edges", "mistral") == (
        max(held["edge_scores"]["largest_memory_error"], held["edge_circuit"]["largest_memory_error"]),
        max(held["edge_scores"]["largest_time_factor"], held["edge_circuit"]["largest_time_factor"]))


def test_a_logged_estimate_beyond_the_measured_depth_says_it_is_extrapolated():
    work = {"batch": 1, "tokens": 64}
    assert "extrapolated: the fit measured 1 to 4 layers" in cost.described("extraction", OLMO, work, 4, "cpu")
    shallow = OLMO | {"num_hidden_layers": 4}
    assert "extrapolated" not in cost.described("extraction", shallow, work, 4, "cpu")


def test_an_edge_jobs_time_is_its_scoring_and_one_circuit_per_count_of_its_sweep():
    """config/paper.yaml's OLMo-7B IOI edge job on the CPU: EAP-IG once, then the sweep's circuits
    (under bisection: its coarse grid, the refined points and the interval's points)."""
    from attnlab.cost import budget

    config = _validated(yaml.safe_load((REPO / "config/paper.yaml").read_text()))
    pruning = config["pruning"]
    settings = {**pruning, **pruning["edges"]}
    counts = settings["refine_points"] + settings["interval_points"] + (
        settings["coarse_points"] if settings["search"] == "bisection" else settings["log_points"])
    tokens, points, _ = budget.TASK_TOKENS["ioi"]
    ranked, counted = budget.prompt_split(pruning, "ioi")
    scoring = cost.estimate("edge_scores", OLMO, {"batch": 4, "tokens": tokens, "points_per_batch": 4 * points,
                                                  "prompts": ranked, "steps": settings["steps"], "chunks": 1}, 4, "cpu")
    circuit = cost.estimate("edge_circuit", OLMO, {"batch": 4, "tokens": tokens, "points_per_batch": 4 * points,
                                                   "points": counted * points, "prompts": counted}, 4, "cpu")
    found = budget.edge_estimate(OLMO, "ioi", pruning, "cpu")
    assert found.seconds == pytest.approx(scoring.seconds + counts * circuit.seconds)


HAND = cost.Shape(depth=4, hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=8, vocab=10, gated_mlp=True,
                  tied=True)


def _resumed_by_hand(shape) -> int:
    """Parameters one row-token passes through when each head is ablated in turn, resumed at its
    layer: its layer's o_proj and MLP, every layer above whole; the last layer's MLP runs at the
    read positions only (none counted). Enumerated pass by pass."""
    attention = shape.hidden * shape.head_dim * (2 * shape.heads + 2 * shape.kv_heads)
    o, mlp = shape.heads * shape.head_dim * shape.hidden, 3 * shape.hidden * shape.intermediate
    last = shape.depth - 1
    total = 0
    for layer in range(shape.depth):
        for _ in range(shape.heads):
            total += o + (mlp if layer < last else 0)
            total += sum(attention + (mlp if above < last else 0) for above in range(layer + 1, shape.depth))
    return total


def test_exact_patchings_time_features_are_counted_pass_by_pass():
    """4 layers of 2 heads (attention 48, o_proj 16, MLP 96 parameters per layer): the whole
    forwards and every head's resumed pass, 3 prompts of 5 tokens in one batch and in two."""
    per_row_token = 2 * 4 * (48 + 96) + _resumed_by_hand(HAND)
    assert _resumed_by_hand(HAND) == 2 * (4 * 16 + 3 * 96 + 6 * 48 + 3 * 96)
    work = {"prompts": 3, "batch": 3, "tokens": 5, "forwards": 2}
    assert cost.time_features("heads", HAND, work) == {"multiply_adds": 3 * 5 * per_row_token,
                                                       "weights_read": per_row_token}
    assert cost.time_features("heads", HAND, work | {"batch": 2})["weights_read"] == 2 * per_row_token


def test_mediations_time_features_are_counted_pass_by_pass():
    """Mediation on the same shape: every head resumed in both directions, the whole forwards (the
    two recorded runs, one per ARM seed, and per direction a recording, two per patched layer and
    three groups), each pass reading every token's logit (10 x 4 parameters) at the 3 scored
    positions."""
    work = {"prompts": 2, "batch": 2, "tokens": 7, "scored": 3, "arm_seeds": 1, "patched": 2}
    forwards = 2 + 1 + 2 * (1 + 2 * 2 + 3)
    passes = forwards + 2 * 2 * 4
    per_row_token = forwards * 4 * (48 + 96) + 2 * _resumed_by_hand(HAND)
    assert cost.time_features("mediation", HAND, work) == {
        "multiply_adds": 2 * (7 * per_row_token + 3 * passes * 40), "weights_read": per_row_token + passes * 40}
    every_layer = cost.time_features("mediation", HAND, work | {"patched": 4})["weights_read"]
    assert every_layer - cost.time_features("mediation", HAND, work)["weights_read"] == 2 * 2 * 2 * (4 * 144 + 40)


def test_generation_and_extraction_time_every_batch_of_the_job():
    """A job of 10 prompts in batches of 4 runs 3 batches, each as long as the longest prompt."""
    one = {"prompts": 4, "batch": 4, "prompt_tokens": 30, "new_tokens": 8}
    job = one | {"prompts": 10}
    for stage, first in (("generation", one), ("extraction", {"prompts": 4, "batch": 4, "tokens": 30})):
        whole = cost.time_features(stage, HAND, first | {"prompts": 10})
        for name, value in cost.time_features(stage, HAND, first).items():
            assert whole[name] == (value if name == "runs" else 3 * value), (stage, name)
    # generation: the prefill reads the last position's logits, each step every row's
    assert cost.time_features("generation", HAND, job)["row_multiply_adds"] == 3 * 4 * 8 * (4 * 144 + 40)


def test_a_head_scoring_job_is_attribution_then_exact_patching(tmp_path):
    """score_heads ranks by attribution and (when asked for) exact patching, one after the other:
    the larger peak, both times; attribution alone where exact is off."""
    config = _config_with_olmo(tmp_path)

    def asked(pruning):
        return requests.job_request("score_heads", {**config, "pruning": pruning}, {"model": "olmo-shaped", "task": "ioi"},
                                    {}, attempt=1, local=True, batch=2, bases={}, models_dir=str(tmp_path / "m"))
    work, _ = requests.heads_work(config["pruning"] | {"exact": True}, "ioi", 2)
    attribution = cost.estimate("head_attribution", OLMO, work, 4, "cpu")
    exact = cost.estimate("heads", OLMO, work, 4, "cpu")
    both = asked(config["pruning"] | {"exact": True, "ranking": "exact"}).estimate
    assert both.seconds == pytest.approx(attribution.seconds + exact.seconds)
    assert both.memory_bytes == max(attribution.memory_bytes, exact.memory_bytes)
    alone = asked(config["pruning"] | {"exact": False, "ranking": "attribution"}).estimate
    assert alone.seconds == pytest.approx(attribution.seconds) and alone.memory_bytes == attribution.memory_bytes


def test_a_logged_estimate_of_several_runs_gives_their_whole_time():
    work = {"prompts": 8, "batch": 4, "tokens": 20}
    once = cost.estimate("heads", OLMO, work, 4, "cpu")
    logged = cost.described("heads", OLMO, work, 4, "cpu", repeats=3)
    assert ", 3 times)" in logged and f"{3 * once.seconds / 60:.1f} min" in logged
