"""Edge circuits' bookkeeping: the graph of a model (every edge once, none backwards), each plan's
sums over exactly its senders, the ranking by |score| and the refined sweep's first crossing."""

import numpy as np
import pytest
import torch

from attnlab.circuits.curves import refined_sweep
from attnlab.interventions.edges import Graph
from attnlab.patching.edges import ranked_edges


def test_the_graph_of_smollm2_has_every_edge_once_and_none_backwards():
    graph = Graph(n_layers=30, n_heads=9, n_kv_heads=3)
    assert graph.n_senders == 1 + 30 * 10 and graph.n_receivers == 30 * 16 + 1
    edges = graph.edges()
    # a layer's query/key/value receivers hear the embeddings and every earlier layer;
    # its MLP also hears its own heads; the logits hear everything
    per_layer = sum(15 * (1 + 10 * layer) + (1 + 10 * layer + 9) for layer in range(30))
    assert len(edges) == graph.n_edges == per_layer + 301
    assert not edges.duplicated(["sender", "receiver"]).any()
    assert (edges["sender_layer"] < edges["receiver_layer"]).sum() + \
        ((edges["sender_layer"] == edges["receiver_layer"]) & edges["receiver_name"].str.endswith("MLP")).sum() \
        == len(edges)
    same_layer = edges[edges["sender_layer"] == edges["receiver_layer"]]
    assert set(same_layer["sender_name"].str.split(".").str[1].str[0]) == {"H"}  # heads into their own MLP


@pytest.mark.parametrize("density", [0.02, 0.3, 0.7])
def test_each_receiver_of_a_plan_sums_exactly_its_own_senders(density):
    """Replaying a plan's sums symbolically: every receiver's input is its base plus (live −
    corrupted) of exactly its kept senders (corrupted base) or minus that of its dropped ones
    (live base), from whichever base sums fewer; a receiver keeping all reads the live residual
    as it is, one keeping none the corrupted one."""
    from attnlab.interventions.edges import Plan

    graph = Graph(n_layers=4, n_heads=4, n_kv_heads=2)
    valid = graph.valid()
    kept = valid & (torch.rand(valid.shape, generator=torch.Generator().manual_seed(1)) < density)
    kept[:, 3], kept[:, 4] = valid[:, 3], False
    n, live_row, corrupted_row = graph.n_senders, graph.n_senders, graph.n_senders + 1
    plan = Plan.of(graph, kept)
    read = torch.zeros(n, dtype=torch.bool)
    for point in graph.reading_points():
        mix = plan.mixes.get(point.start)
        summing = [] if mix is None else mix.receivers
        starts = [] if mix is None else (torch.cumsum(mix.counts, 0) - mix.counts).tolist()
        for receiver in range(point.start, point.stop):
            n_kept, n_dropped = int(kept[:, receiver].sum()), int((valid & ~kept)[:, receiver].sum())
            on_live = bool(plan.live_base[receiver])
            assert on_live == (n_dropped <= n_kept)
            if receiver not in summing:
                assert not bool(plan.mixing[receiver])
                assert (n_dropped == 0 and not bool(plan.patched[receiver])) or (n_kept == 0 and not on_live)
                continue
            i = summing.index(receiver)
            entries = slice(starts[i], starts[i] + int(mix.counts[i]))
            rows, coefs = mix.rows[entries].tolist(), mix.coefs[entries].tolist()
            assert rows[0] == (live_row if on_live else corrupted_row) and coefs[0] == 1
            total = torch.zeros(n, dtype=torch.float64)
            for row, coef in zip(rows[1:], coefs[1:]):
                total[row] += coef
                read[row] = True
            own = kept[:, receiver].double()
            assert torch.equal(total, own - valid[:, receiver].double() if on_live else own)
    assert torch.equal(read, plan.used)
    assert plan.terms == sum(int(c.sum()) for c in (m.counts for m in plan.mixes.values()))
    assert not bool(plan.patched[3]) and bool(plan.patched[4]) and not bool(plan.mixing[4])


def test_ranked_edges_order_by_absolute_score():
    graph = Graph(n_layers=1, n_heads=2, n_kv_heads=1)
    scores = torch.zeros(graph.n_senders, graph.n_receivers)
    scores[0, graph.logits_receiver], scores[1, graph.logits_receiver] = 0.5, -2.0
    edges = ranked_edges(graph, scores)
    top = edges.sort_values("rank").head(2)
    assert top["sender_name"].tolist() == ["L0.H0", "embed"]
    assert top["score"].tolist() == [-2.0, 0.5]


def test_log_refinement_finds_the_first_crossing_to_the_edge_in_few_passes():
    calls = []

    def metric_at(k):
        calls.append(k)
        return k ** 0.5

    n = 70_000
    grid = [0, *np.unique(np.geomspace(1, n, 40).round().astype(int)).tolist()]
    sweep = refined_sweep(metric_at, n, sorted(set(grid) | {n}), threshold=0.9, refine_points=12)
    reached = sweep[sweep["explained_effect"] >= 0.9]["heads_kept"].min()
    assert reached == int(np.ceil((0.9 * n ** 0.5) ** 2))
    assert reached - 1 in set(sweep["heads_kept"])  # found to the edge
    assert len(calls) < 40 + 4 * 12


class _Engine:
    """A patching engine's sweep interface over a metric of k alone (k kept of 1,000)."""

    def __init__(self, refine_points=None):
        self.measured = []
        if refine_points is not None:
            self.refine_points = refine_points

    def kept(self, order, k):
        return k

    def per_prompt(self, k):
        self.measured.append(k)
        return k / 1000, np.array([k / 1000])


def test_the_sweep_refines_as_its_engine_says():
    """circuits.sweeps.sweep hands the engine's refine_points (the edges') to the refinement: a
    bracket of 1,000 edges closes in a few log-spaced rounds; the heads' engine, which has none,
    measures every k inside it."""
    from attnlab.circuits.sweeps import sweep

    edges, heads = _Engine(refine_points=12), _Engine()
    for engine in (edges, heads):
        curve, per_prompt = sweep(engine, list(range(1000)), [0, 1000], threshold=0.5)
        assert curve[curve["explained_effect"] >= 0.5]["heads_kept"].min() == 500
        assert sorted(per_prompt) == sorted(engine.measured)
    assert len(edges.measured) <= 2 + 4 * 12  # the grid's two ends, then rounds of at most 12
    assert sorted(heads.measured) == list(range(1001))
