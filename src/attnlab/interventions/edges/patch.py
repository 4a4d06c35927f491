"""``EdgePatch``: what ``intervened(model, edges=...)`` installs (the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnlab.interventions.edges.gradients import ReceiverGradients
from attnlab.interventions.edges.graph import Graph
from attnlab.interventions.edges.install import Installed
from attnlab.interventions.edges.plan import Plan
from attnlab.interventions.edges.recording import Recording


@dataclass(eq=False)
class EdgePatch:
    """The edge part of ``intervened`` (the package docstring, ``attnlab.interventions.edges``). ``kept`` needs ``corrupted``;
    ``record`` works alone or with either; ``gradients`` are taken on unpatched passes (EAP-IG
    interpolates the inputs, not the edges). ``weights`` [senders, receivers] in [0, 1] (with
    ``corrupted``, instead of ``kept``): each edge carries w · live + (1 − w) · corrupted of its
    sender, every receiver reading the corrupted residual plus Σ w (live − corrupted) of its
    senders; differentiable in ``weights`` (Edge Pruning's masks). At 0 and 1 it is the patch
    ``kept`` gives to float rounding (tested)."""

    graph: Graph
    kept: torch.Tensor | None = None
    corrupted: Recording | None = None
    record: Recording | None = None
    gradients: ReceiverGradients | None = None
    plan: Plan | None = None  # of ``kept`` (made from it when not given)
    weights: torch.Tensor | None = None

    def __post_init__(self):
        if self.kept is not None and self.corrupted is None:
            raise ValueError("patching edges (kept=) needs the corrupted run's Recording (corrupted=)")
        if self.kept is not None and self.gradients is not None:
            raise ValueError("receiver gradients (gradients=) are taken on unpatched passes: drop kept= "
                             "(EAP-IG moves the inputs from the corrupted to the clean prompt, not the edges)")
        if self.plan is not None and self.kept is None:
            raise ValueError("plan= is the plan of the kept edges: give kept= with it")
        if self.weights is not None:
            self._check_weights()
        if self.plan is None and self.kept is not None:
            self.plan = Plan.of(self.graph, self.kept)

    def _check_weights(self) -> None:
        shape = (self.graph.n_senders, self.graph.n_receivers)
        if self.kept is not None or self.gradients is not None or self.corrupted is None:
            raise ValueError("edge weights (weights=) replace kept=, need the corrupted run's Recording "
                             "(corrupted=) and take their gradients by autograd (no gradients=)")
        if tuple(self.weights.shape) != shape:
            raise ValueError(f"edge weights: a [senders, receivers] = {shape} tensor, not {tuple(self.weights.shape)}")
        # every receiver sums its senders on the corrupted residual (ReceiverHooks._weighted)
        self.plan = Plan.of(self.graph, self.graph.valid(), base="corrupted")

    def install(self, model) -> Installed:
        return Installed(self, model)
