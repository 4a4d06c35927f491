"""ACDC (Conmy et al. 2023) on attnlab's edge graph: edges tried one at a time from the logits
back, each removed for good when removing it moves the circuit's distance from the full model
(``patching.faithfulness``) by less than a threshold.

Every edge starts kept (the circuit is the full model). Receivers are visited in reverse
topological order (the logits, then each layer's MLP and its query/key/value heads, from the last
layer to the first), and each receiver's senders from the latest to the embeddings. For each edge
still kept: remove it (its receiver reads the sender's corrupted activation, as every removed
edge in ``edges.EdgePatch``), measure the distance d; if d − d_current < threshold the edge stays
removed and d_current = d, else it is put back. A receiver whose component (its head, the heads
sharing its key/value head, or its MLP) sends no kept edge is not tried: nothing reads that
component's output, so its inputs cannot move the output; its edges are removed without a
forward (ACDC removes such nodes the same way). Cost: one patched forward of the batch per edge
tried, plus the clean and corrupted references.

Each edge's score is the increase in distance measured when it was tried, clipped at 0 (0 for
edges not tried): the kept edges (≥ threshold) rank above every removed one (< threshold), so the
sweep over the edges kept in this order passes through ACDC's own circuit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from attnlab.interventions.edges import Graph
from attnlab.patching.faithfulness import Faithfulness


@dataclass
class AcdcResult:
    kept: torch.Tensor  # [senders, receivers] bool: ACDC's circuit
    increases: torch.Tensor  # [senders, receivers] float64: d − d_current when tried (NaN: not tried)
    distance: float  # the circuit's distance at the end
    forwards: int  # patched forwards of the whole batch (the references excluded)
    tried: int
    skipped: int  # edges removed without a forward (their component sends nothing)
    seconds: float

    @property
    def scores(self) -> torch.Tensor:
        """[senders, receivers]: the increase clipped at 0, 0 where not tried."""
        return torch.nan_to_num(self.increases, nan=0.0).clamp(min=0.0).float()


def sends_nothing(graph: Graph, kept: torch.Tensor, receiver: int) -> bool:
    """Whether the component ``receiver`` belongs to sends no kept edge (the logits: never)."""
    if receiver == graph.logits_receiver:
        return False
    layer, within = divmod(receiver, graph.per_layer)
    if within == graph.attention_receivers:
        senders = [graph.mlp_sender(layer)]
    elif within < graph.n_heads:
        senders = [graph.head_sender(layer, within)]
    else:  # a key or value head: every query head of its group
        group = (within - graph.n_heads) % graph.n_kv_heads
        per_group = graph.n_heads // graph.n_kv_heads
        senders = [graph.head_sender(layer, head) for head in range(group * per_group, (group + 1) * per_group)]
    return not bool(kept[senders].any())


def acdc(faithfulness: Faithfulness, threshold: float, progress: bool = True) -> AcdcResult:
    """ACDC's circuit on ``faithfulness``' prompts at ``threshold`` (module docstring)."""
    if not threshold > 0:
        raise ValueError(f"ACDC's threshold: above 0, not {threshold}")
    graph = faithfulness.circuits.graph
    kept = graph.valid().clone()
    increases = torch.full(kept.shape, float("nan"), dtype=torch.float64)
    started = time.perf_counter()
    current, forwards, skipped = faithfulness.distance(kept), 1, 0
    bar = tqdm(total=graph.n_edges, desc="ACDC", unit="edge", mininterval=10, disable=not progress)
    for receiver in reversed(range(graph.n_receivers)):
        senders = range(graph.upstream(receiver))
        if sends_nothing(graph, kept, receiver):
            skipped += int(kept[:, receiver].sum())
            kept[:, receiver] = False
            bar.update(len(senders))
            continue
        for sender in reversed(senders):
            kept[sender, receiver] = False
            distance = faithfulness.distance(kept)
            forwards += 1
            increases[sender, receiver] = distance - current
            if distance - current < threshold:
                current = distance
            else:
                kept[sender, receiver] = True
            bar.update(1)
    bar.close()
    tried = int((~increases.isnan()).sum())
    return AcdcResult(kept, increases, current, forwards, tried, skipped, time.perf_counter() - started)
