"""The pure helpers of the ACDC / Edge Pruning peer benchmark (benchmarks/peers/circuits.py): no
model, no auto-circuit."""

import pytest
import torch

from attnlab.interventions.edges import Graph
from benchmarks.peers.circuits import autocircuit_size, copies, jaccard, mask_of, names_of, tau_parts


def test_jaccard_of_two_edge_sets():
    a = {("embed", "logits"), ("L0.H1", "L1.MLP"), ("L0.MLP", "L1.KV0.k")}
    b = {("embed", "logits"), ("L0.MLP", "L1.KV0.k"), ("L1.H2", "logits")}
    assert jaccard(a, b) == pytest.approx(2 / 4)
    assert jaccard(a, a) == 1.0 and jaccard(a, set()) == 0.0 and jaccard(set(), set()) == 1.0


def test_a_key_value_edge_counts_once_per_query_head_of_its_group_in_autocircuit():
    assert copies("L1.KV2.v", 3) == 3 and copies("L1.KV0.k", 3) == 3
    assert copies("L1.H4.q", 3) == 1 and copies("L0.MLP", 3) == 1 and copies("logits", 3) == 1
    circuit = {("embed", "L0.KV1.k"), ("embed", "L0.H0.q"), ("L0.H3", "logits")}
    assert autocircuit_size(circuit, 3) == 5


def test_the_whole_graph_counts_as_autocircuit_counts_it():
    """SmolLM2's first 2 layers: 231 edges in attnlab's graph, 375 in auto-circuit's."""
    graph = Graph(n_layers=2, n_heads=9, n_kv_heads=3)
    every = names_of(graph, graph.valid())
    assert len(every) == graph.n_edges == 231
    assert autocircuit_size(every, 3) == 375
    assert torch.equal(mask_of(graph, every), graph.valid())


def test_a_pair_that_is_no_edge_is_refused():
    graph = Graph(n_layers=2, n_heads=9, n_kv_heads=3)
    with pytest.raises(ValueError):
        mask_of(graph, {("L1.H0", "L0.MLP")})


def test_acdc_thresholds_split_into_autocircuit_base_and_exponent():
    assert tau_parts(1e-5) == (1, -5)
    assert tau_parts(3e-6) == (3, -6)
    assert tau_parts(0.01) == (1, -2)
    with pytest.raises(SystemExit):
        tau_parts(1.5e-5)


def _autocircuit_edges(layers: int = 2, heads: int = 9) -> list[tuple[str, str]]:
    """auto-circuit's edge names of a factorized Llama graph: (src, dest)."""
    def senders_before(layer: int, with_heads_of_layer: bool) -> list[str]:
        names = ["Resid Start"]
        for earlier in range(layer + (1 if with_heads_of_layer else 0)):
            names += [f"A{earlier}.{h}" for h in range(heads)]
            names += [f"MLP {earlier}"] if earlier < layer else []
        return names
    edges = []
    for layer in range(layers):
        for h in range(heads):
            edges += [(s, f"A{layer}.{h}.{letter}") for letter in "QKV" for s in senders_before(layer, False)]
        edges += [(s, f"MLP {layer}") for s in senders_before(layer, True)]
    return edges + [(s, "Resid End") for s in senders_before(layers, False)]


def _attnlab_receiver(dest: str) -> str:
    if dest == "Resid End":
        return "logits"
    if dest.startswith("MLP "):
        return f"L{dest.split()[1]}.MLP"
    layer, head, letter = dest[1:].split(".")
    return f"L{layer}.H{head}.q" if letter == "Q" else f"L{layer}.KV{int(head) // 3}.{letter.lower()}"


def test_autocircuit_edges_in_attnlabs_acdc_order():
    """Sorted by ``visiting_key``, auto-circuit's edges come receiver by receiver from the logits
    back as attnlab's ACDC visits them (a key/value receiver's copies together), each receiver's
    senders from the latest; and in the order of auto-circuit's layers, which its ACDC sorts by."""
    from benchmarks.peers.circuits_worker import visiting_key

    edges = _autocircuit_edges()
    assert len(edges) == 375
    ordered = sorted(edges, key=lambda edge: visiting_key(*edge, kv_group=3))
    receivers = list(dict.fromkeys(_attnlab_receiver(dest) for _, dest in ordered))
    graph = Graph(n_layers=2, n_heads=9, n_kv_heads=3)
    assert receivers == graph.receiver_names()[::-1]
    into_logits = [src for src, dest in ordered if dest == "Resid End"]
    assert into_logits == ["MLP 1", *[f"A1.{h}" for h in range(8, -1, -1)], "MLP 0",
                           *[f"A0.{h}" for h in range(8, -1, -1)], "Resid Start"]
    layer = {"Resid End": 5, "MLP 1": 4, "MLP 0": 2}
    layers = [layer.get(dest, 3 if dest.startswith("A1") else 1) for _, dest in ordered]
    assert layers == sorted(layers, reverse=True)
    assert [dest for _, dest in ordered if dest.startswith("A1.")][:3] == ["A1.8.V"] * 3
