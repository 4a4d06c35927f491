"""ACDC and Edge Pruning (``attnlab.patching.acdc``, ``attnlab.patching.edge_pruning``) against
references written here: edge weights against the float64 hand forward (its metric and its
autograd gradient in the weights), ACDC against a plain loop over the hand forward, and both
methods against circuits known by construction (the compiled programs of data/groundtruth)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.groundtruth import pairs, truth
from attnlab.models import load_model
from attnlab.patching.acdc import acdc, sends_nothing
from attnlab.patching.edge_pruning import INITIAL_LOG_ALPHA, PruningSchedule, prune_edges
from attnlab.patching.edges import EdgeCircuits
from attnlab.patching.faithfulness import Faithfulness
from attnlab.patching.heads import build_batch
from attnlab.tokenization import load_tokenizer
from hand_forward import HandForward
from test_attention import TINY
from test_edges_references import _batch, _model, _pads, _partial_mask

FOLDER = Path(__file__).resolve().parents[1] / "data" / "groundtruth"


def _names(graph, kept: torch.Tensor) -> set:
    senders, receivers = graph.sender_names(), graph.receiver_names()
    return {(senders[s], receivers[r]) for s, r in kept.nonzero().tolist()}


# ---- edge weights: the patch Edge Pruning trains through ----
@pytest.mark.parametrize("arch", [*TINY, "olmo-clip_qkv"])
def test_weighted_edges_give_the_hand_forwards_metric_and_gradient(arch):
    """Random weights in [0, 1] on every edge of every family: each receiver reads w · live +
    (1 − w) · corrupted of each sender; the metric and its gradient in every weight against the
    hand forward's autograd (float64)."""
    model = _model(arch)
    batch = _batch(padding=_pads(arch))
    circuits = EdgeCircuits(model, batch, batch_size=6)
    valid = circuits.graph.valid()
    weights = torch.rand(valid.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * valid
    mine = weights.clone().requires_grad_(True)
    got = batch.metric(circuits.patched_logits(0, weights=mine), slice(0, batch.n_prompts))
    got.sum().backward()
    hand = HandForward(model)
    with torch.no_grad():
        _, corrupted = hand.run(batch, batch.corrupted)
        clean, _ = hand.run(batch, batch.clean)
    theirs = weights.clone().requires_grad_(True)
    want, _ = hand.run(batch, batch.clean, kept=theirs, corrupted=corrupted)
    want.sum().backward()
    scale = max(1.0, float(want.detach().abs().max()))
    np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), atol=1e-6 * scale, rtol=0)
    assert float((want.detach() - clean).abs().max()) > 1e-2  # the weights move the metric: the comparison can fail
    gradient = float(theirs.grad[valid].abs().max())
    assert gradient > 1e-3 and bool((mine.grad[~valid] == 0).all())
    torch.testing.assert_close(mine.grad[valid], theirs.grad[valid], atol=1e-6 * gradient, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2", "gemma3-sliding"])
def test_weights_of_zero_and_one_are_the_kept_edges_patch(arch):
    model = _model(arch)
    batch = _batch()
    circuits = EdgeCircuits(model, batch, batch_size=4)  # two mini-batches
    kept = _partial_mask(circuits.graph, seed=2)
    with torch.no_grad():
        weighted = [batch.metric(circuits.patched_logits(index, weights=kept.double()), batch.prompts_of(rows))
                    for index, rows in enumerate(batch.chunks(4))]
    np.testing.assert_allclose(torch.cat(weighted).numpy(), circuits.per_prompt(kept)[1], atol=1e-6, rtol=0)


def test_weights_are_refused_beside_kept_edges_or_of_the_wrong_shape():
    from attnlab.interventions.edges import EdgePatch, Recording

    graph = EdgeCircuits(_model("llama-gqa"), _batch(), batch_size=6).graph
    with pytest.raises(ValueError, match="replace kept="):
        EdgePatch(graph, kept=graph.valid(), weights=graph.valid().double(), corrupted=Recording())
    with pytest.raises(ValueError, match=r"\[senders, receivers\]"):
        EdgePatch(graph, weights=torch.ones(2, 2), corrupted=Recording())


def test_the_kl_is_the_full_models_against_the_circuits():
    """``Faithfulness('kl')``'s distance of a partial circuit: KL(full ‖ circuit) at each row's last
    position over every token, the mean over rows, against the hand forward's logits (float64)."""
    model = _model("llama-gqa")
    batch = _batch()
    circuits = EdgeCircuits(model, batch, batch_size=4)
    kept = _partial_mask(circuits.graph, seed=4)
    hand = HandForward(model)
    with torch.no_grad():
        embeds = {name: model.get_input_embeddings()(ids) for name, ids in (("clean", batch.clean),
                                                                             ("corrupted", batch.corrupted))}
        full, _ = hand.forward(embeds["clean"], batch.mask, batch.positions)
        _, corrupted = hand.forward(embeds["corrupted"], batch.mask, batch.positions)
        circuit, _ = hand.forward(embeds["clean"], batch.mask, batch.positions, kept=kept, corrupted=corrupted)
    p, q = (torch.log_softmax(logits[:, -1], -1) for logits in (full, circuit))
    want = float((p.exp() * (p - q)).sum(-1).mean())
    reverse = float((q.exp() * (q - p)).sum(-1).mean())
    assert want > 1e-4 and abs(want - reverse) > 1e-3 * want  # the two directions differ here
    assert Faithfulness(circuits, "kl").distance(kept) == pytest.approx(want, rel=1e-4)


# ---- ACDC ----
def _acdc_by_hand(hand: HandForward, batch, graph, threshold: float) -> torch.Tensor:
    """ACDC written plainly on the hand forward: every edge tried (none skipped), receivers from the
    logits back, senders from the latest; the distance |1 − explained effect| of the mean metric."""
    with torch.no_grad():
        clean = float(hand.run(batch, batch.clean)[0].mean())
        corrupted_metric, corrupted = hand.run(batch, batch.corrupted)
        low = float(corrupted_metric.mean())

        def distance(kept):
            metric = float(hand.run(batch, batch.clean, kept=kept, corrupted=corrupted)[0].mean())
            return abs(1 - (metric - low) / (clean - low))
        kept = graph.valid().clone()
        current = distance(kept)
        for receiver in reversed(range(graph.n_receivers)):
            for sender in reversed(range(graph.upstream(receiver))):
                kept[sender, receiver] = False
                found = distance(kept)
                if found - current < threshold:
                    current = found
                else:
                    kept[sender, receiver] = True
    return kept


@pytest.mark.parametrize("arch,threshold,skips", [("llama-gqa", 0.03, False), ("gpt2", 0.05, True)])
def test_acdc_keeps_the_edges_a_plain_loop_over_the_hand_forward_keeps(arch, threshold, skips):
    """The library skips the edges into components that send nothing; the plain loop tries them
    (each moves nothing): the same circuit, neither empty nor everything."""
    model = _model(arch)
    batch = _batch()
    circuits = EdgeCircuits(model, batch, batch_size=4)
    found = acdc(Faithfulness(circuits, "metric"), threshold, progress=False)
    want = _acdc_by_hand(HandForward(model), batch, circuits.graph, threshold)
    assert torch.equal(found.kept, want)
    assert 0 < int(want.sum()) < circuits.graph.n_edges // 2
    assert (found.skipped > 0) == skips and found.forwards == found.tried + 1
    assert found.tried + found.skipped == circuits.graph.n_edges
    assert bool((found.scores[found.kept] >= threshold).all()) and bool((found.scores[~found.kept] < threshold).all())


def _compiled(name: str):
    folder = FOLDER / name
    model = load_model(folder, torch.device("cpu"), torch.float64)
    tokenizer = load_tokenizer(folder)
    prompts = pairs.generate("program", tokenizer, 24, 1, folder)
    known = truth.derive(pairs.read_spec(folder), pairs.token_pairs(prompts))
    return EdgeCircuits(model, build_batch(prompts, tokenizer), 24), set(known.edges)


@pytest.mark.parametrize("name", ["tracr-reverse", "tracr-stack-frac-prevs", "tracr-stack-hist"])
@pytest.mark.parametrize("kind", ["metric", "kl"])
def test_acdc_recovers_each_compiled_programs_circuit_edge_by_edge(name, kind):
    circuits, known = _compiled(name)
    found = acdc(Faithfulness(circuits, kind), 1e-3, progress=False)
    assert _names(circuits.graph, found.kept) == known


def test_a_component_that_sends_nothing_is_found_for_each_kind_of_receiver():
    graph = EdgeCircuits(_model("llama-gqa"), _batch(), batch_size=6).graph  # 4 query heads, 2 key/value heads
    kept = torch.zeros(graph.n_senders, graph.n_receivers, dtype=torch.bool)
    first = graph.attention_slice(1).start
    kept[graph.head_sender(1, 3), graph.logits_receiver] = True  # only head 3 of layer 1 sends
    assert not sends_nothing(graph, kept, first + 3) and sends_nothing(graph, kept, first + 2)
    key_of_3 = first + graph.n_heads + 1  # heads 2 and 3 share key/value head 1
    assert not sends_nothing(graph, kept, key_of_3) and not sends_nothing(graph, kept, key_of_3 + graph.n_kv_heads)
    assert sends_nothing(graph, kept, first + graph.n_heads) and sends_nothing(graph, kept, graph.mlp_receiver(1))
    assert not sends_nothing(graph, kept, graph.logits_receiver)


# ---- Edge Pruning ----
@pytest.mark.parametrize("name", ["tracr-reverse", "tracr-frac-prevs"])
def test_edge_pruning_finds_the_circuit_when_told_its_size(name):
    circuits, known = _compiled(name)
    schedule = PruningSchedule(sparsity=1 - len(known) / circuits.graph.n_edges, steps=200, warmup=100)
    found = prune_edges(Faithfulness(circuits, "metric"), schedule, progress=False)
    assert _names(circuits.graph, found.kept) == known
    ranked = found.scores[circuits.graph.valid()].sort(descending=True).values
    assert float(ranked[len(known) - 1]) > float(ranked[len(known)])  # the circuit heads the sweep's order


def test_edge_pruning_settings_out_of_range_are_refused():
    for bad in ({"sparsity": 1.0}, {"sparsity": 0.0}, {"warmup": 20}, {"steps": 0, "warmup": 0}, {"read_at": 1.0}):
        with pytest.raises(ValueError, match="Edge Pruning"):
            PruningSchedule(**{"sparsity": 0.5, "steps": 10, "warmup": 5, **bad})


@pytest.mark.parametrize("arch", list(TINY))
def test_both_methods_take_a_step_on_every_familys_tiny_model(arch):
    """ACDC at a threshold that removes the logits' edges (every component then sends nothing: the
    rest is removed without a forward), and one Edge Pruning step: Adam moves by at most lr the gates
    whose draw fell inside (0, 1) (a gate drawn at its clamp of 1 has no gradient), others not."""
    model = TINY[arch]()
    batch = _batch(padding=_pads(arch))
    circuits = EdgeCircuits(model, batch, batch_size=6)
    graph = circuits.graph
    faithfulness = Faithfulness(circuits, "kl")
    found = acdc(faithfulness, 1.0, progress=False)
    assert found.tried == graph.n_senders and found.skipped == graph.n_edges - graph.n_senders
    assert not bool(found.kept.any()) and bool(found.increases[:, graph.logits_receiver].isfinite().all())
    pruned = prune_edges(faithfulness, PruningSchedule(sparsity=0.5, steps=1, warmup=0, lr=0.01, seed=3),
                         progress=False)
    # the initial locations as prune_edges draws them; Adam's first step moves each by about lr
    initial = INITIAL_LOG_ALPHA + 0.01 * torch.randn(graph.n_edges, generator=torch.Generator().manual_seed(3),
                                                     dtype=torch.float64)
    moved = (pruned.log_alpha[graph.valid()] - initial).abs()
    assert bool(torch.isfinite(pruned.log_alpha).all()) and np.isfinite(pruned.history[0]["loss"])
    stepped = moved > 1e-9
    assert 0 < int(stepped.sum()) < graph.n_edges and float(moved.max()) <= 0.01 * (1 + 1e-6)


# ---- refusals before any job ----
def _edge_config(**edges):
    import yaml

    from conftest import REPO

    config = yaml.safe_load((REPO / "tests/configs/tiny.yaml").read_text())
    config["pruning"]["edges"] = {"tasks": ["ioi"], **edges}
    return config


@pytest.mark.parametrize("edges,needles", [
    ({"method": "eap"}, ["pruning.edges.method", "'eap'", "acdc"]),
    ({"method": "acdc", "acdc": {"threshold": 0}}, ["pruning.edges.acdc.threshold", "0"]),
    ({"method": "acdc", "acdc": {"threshold": 1.5}}, ["pruning.edges.acdc.threshold", "1.5"]),
    ({"method": "edge_pruning", "edge_pruning": {"sparsity": 1}}, ["pruning.edges.edge_pruning.sparsity", "1"]),
    ({"method": "edge_pruning", "edge_pruning": {"steps": 10, "warmup": 20}},
     ["pruning.edges.edge_pruning.warmup = 20", "steps = 10"]),
    ({"faithfulness": "mse"}, ["pruning.edges.faithfulness", "'mse'"]),
])
def test_an_edge_method_or_its_setting_out_of_range_is_refused_naming_the_key(tmp_path, edges, needles):
    from conftest import refusal

    message = refusal(_edge_config(**edges), tmp_path)
    assert message is not None
    for needle in needles:
        assert needle in message, (needle, message)


def test_acdc_on_a_graph_too_large_for_its_declared_time_is_refused_before_any_job(tmp_path):
    """OLMo-7B's IOI graph (about 1.4 million edges on its config: one patched forward each) against
    an hour; a compiled program's graph fits."""
    import yaml

    from conftest import REPO, dry_run
    from test_cost import _big_model_config

    config = _big_model_config(tmp_path)
    config["pruning"]["edges"].update(method="acdc", acdc={"max_minutes": 60})
    refused = dry_run(tmp_path, config)
    assert refused.returncode != 0, refused.stdout[-2000:]
    for needle in ("pruning.edges.acdc.max_minutes = 60", "olmo-shaped/ioi", "edges, estimated", "min on the cpu",
                   "use method eap_ig or edge_pruning"):
        assert needle in refused.stdout, (needle, refused.stdout[-3000:])
    assert not (tmp_path / "results").exists()
    config = yaml.safe_load((REPO / "config" / "groundtruth.yaml").read_text())
    config["models"] = {"tracr-reverse": {**config["models"]["tracr-reverse"],
                                          "source": {"local": str(FOLDER / "tracr-reverse")}}}
    config["groundtruth"]["models"] = ["tracr-reverse"]
    config["pruning"].update(compare=None)
    config["pruning"]["edges"].update(method="acdc", acdc={"max_minutes": 60})
    accepted = dry_run(tmp_path, config)
    assert accepted.returncode == 0, accepted.stdout[-3000:]


# ---- the workflow's edge step ----
@pytest.mark.parametrize("method", ["acdc", "edge_pruning"])
def test_the_edge_step_writes_each_methods_circuit_beside_the_sweep(tmp_path, method):
    """``steps.edge_circuit`` (the edge_circuit rule's step) on a compiled program: the same files as
    EAP-IG's, the method's own circuit marked in edges.parquet and measured in summary.json."""
    import dataclasses

    import pandas as pd
    import yaml

    from attnlab import io
    from attnlab.config.schema import validate_config
    from attnlab.config.settings import edge_params
    from attnlab.config.validate import SCHEMA
    from attnlab.patching.tasks import split_for_ranking
    from attnlab.steps.edges import edge_circuit
    from conftest import REPO

    folder = FOLDER / "tracr-reverse"
    config = yaml.safe_load((REPO / "config" / "groundtruth.yaml").read_text())
    config["pruning"]["edges"].update(method=method, faithfulness="metric", acdc={"threshold": 1e-3},
                                      edge_pruning={"sparsity": 1 - 2 / 77, "steps": 200, "warmup": 100})
    validate_config(config, SCHEMA)
    prompts = pairs.generate("program", load_tokenizer(folder), 24, 0, folder)
    ranked_on, counted_on = split_for_ranking(24, 0.5, 0)
    io.write_json(dataclasses.asdict(prompts), tmp_path / "prompts.json")
    io.write_json({"ranked_on": ranked_on, "counted_on": counted_on, "rank_share": 0.5}, tmp_path / "scores.json")
    outputs = {name: str(tmp_path / f"{name}.{ext}") for name, ext in (("edges", "parquet"), ("curve", "csv"),
                                                                      ("per_prompt", "parquet"), ("summary", "json"))}
    edge_circuit(str(folder), "program", edge_params(config["pruning"]), str(tmp_path / "prompts.json"),
                 str(tmp_path / "scores.json"), outputs, threads=1)
    summary, edges = io.read_json(outputs["summary"]), pd.read_parquet(outputs["edges"])
    own = set(zip(edges.loc[edges["in_circuit"], "sender_name"], edges.loc[edges["in_circuit"], "receiver_name"]))
    assert own == {("embed", "L3.KV0.v"), ("L3.H0", "logits")} and summary["method"] == method
    assert summary["method_circuit"] == 2 and summary["edges_to_reach_threshold"] == 2
    low, high = summary["method_circuit_effect_interval"]
    assert low <= summary["method_circuit_effect"] <= high and abs(summary["method_circuit_effect"] - 1) < 1e-6
    assert set(edges.sort_values("rank").head(2)["in_circuit"]) == {True}
    assert summary["ranking"].startswith({"acdc": "ACDC", "edge_pruning": "Edge Pruning"}[method])


def test_acdc_is_refused_at_the_jobs_start_when_its_own_prompts_exceed_the_declared_time():
    """The job checks again on its own prompts (a model whose config.json the plan could not read)."""
    from types import SimpleNamespace

    from attnlab.config.checks import ConfigError
    from attnlab.steps.edge_methods import acdc_time_check

    circuits, _ = _compiled("tracr-reverse")
    settings = SimpleNamespace(acdc={"max_minutes": 1e-6})
    with pytest.raises(ConfigError, match=r"(?s)pruning.edges.acdc.max_minutes = 1e-06.*77 edges, estimated"):
        acdc_time_check(str(FOLDER / "tracr-reverse"), circuits, settings, 24)
    assert 0 < acdc_time_check(str(FOLDER / "tracr-reverse"), circuits, SimpleNamespace(acdc={"max_minutes": 60}), 24) < 60


def test_edge_prunings_metric_loss_is_the_mean_squared_gap_over_the_span():
    """Faithfulness 'metric' with weights: the mean over prompts of ((m_circuit − m_clean) /
    (m̄_clean − m̄_corrupted))², from per-prompt metrics of the kept-edges patch (weights 0 and 1)."""
    model = _model("llama-gqa")
    batch = _batch()
    circuits = EdgeCircuits(model, batch, batch_size=4)
    kept = _partial_mask(circuits.graph, seed=5)
    faithfulness = Faithfulness(circuits, "metric")
    clean, circuit = circuits.per_prompt(None)[1], circuits.per_prompt(kept)[1]
    span = clean.mean() - circuits.corrupted_metric()
    want = float((((circuit - clean) / span) ** 2).mean())
    with torch.no_grad():
        got = sum(float(faithfulness.batch_term(i, weights=kept.double())) for i in range(faithfulness.batches))
    assert want > 1e-3 and got == pytest.approx(want, rel=1e-5)
    assert faithfulness.clean == pytest.approx(circuits.metric(), rel=1e-9)


def test_the_target_sparsity_rises_linearly_over_the_warmup_and_the_gates_follow_the_hard_concrete():
    import math

    from attnlab.patching.edge_pruning import deterministic_gates, open_probability

    schedule = PruningSchedule(sparsity=0.9, steps=10, warmup=4)
    assert [schedule.target(step) for step in (0, 1, 2, 4, 9)] == pytest.approx([0, 0.225, 0.45, 0.9, 0.9])
    log_alpha = torch.tensor([-3.0, 0.0, 3.0], dtype=torch.float64)
    sigmoid = 1 / (1 + torch.exp(-log_alpha))
    torch.testing.assert_close(deterministic_gates(log_alpha), (sigmoid * 1.2 - 0.1).clamp(0, 1))
    torch.testing.assert_close(open_probability(log_alpha),
                               1 / (1 + torch.exp(-(log_alpha - 2 / 3 * math.log(0.1 / 1.1)))))
