"""Edge Pruning (Bhaskar et al. 2024) on attnlab's edge graph: a hard-concrete mask on every
edge, learned by gradient descent to keep the circuit's output near the full model's
(``patching.faithfulness``) under a target sparsity.

- **Masks.** Edge e has a location log α_e. Each step samples u ~ U(0, 1) per edge and the gate
  z_e = clamp(sigmoid((log u − log(1 − u) + log α_e) / β) · (r − l) + l, 0, 1), with β = 2/3,
  l = −0.1, r = 1.1 (Louizos et al.'s hard concrete, as Edge Pruning's code): every edge carries
  z_e · live + (1 − z_e) · corrupted of its sender into its receiver (``edges.EdgePatch``'s
  weights), so the loss is differentiable in every log α.
- **Sparsity.** The expected share of edges closed is s = 1 − mean_e P(z_e > 0), P(z_e > 0) =
  sigmoid(log α_e − β log(−l / r)). Edge Pruning's Lagrangian λ₁ (s − t) + λ₂ (s − t)² is added
  to the loss, with λ₁, λ₂ raised by gradient ascent, and the target t rises linearly from 0 to
  ``sparsity`` over the first ``warmup`` steps (the paper's schedule), then stays.
- **Steps.** One mini-batch of the prompts per step, in turn; Adam on log α (``lr``) and on the
  λs (``lambda_lr``, ascending).
- **The circuit** is read at the mask's threshold: the edges whose deterministic gate
  clamp(sigmoid(log α) (r − l) + l, 0, 1) exceeds ``read_at`` (0.5). Each edge's score is
  sigmoid(log α), so the sweep's order passes through the circuit read.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from attnlab.patching.faithfulness import Faithfulness

BETA, LEFT, RIGHT = 2 / 3, -0.1, 1.1
INITIAL_LOG_ALPHA = 3.0  # every gate open at the start: its deterministic value 1, P(z > 0) ≈ 0.999


@dataclass(frozen=True)
class PruningSchedule:
    sparsity: float  # the target share of edges closed
    steps: int
    warmup: int  # steps over which the target rises from 0
    lr: float = 0.1
    lambda_lr: float = 0.1
    read_at: float = 0.5
    seed: int = 0

    def __post_init__(self):
        if not 0 < self.sparsity < 1:
            raise ValueError(f"Edge Pruning's sparsity: the share of edges closed, in (0, 1), not {self.sparsity}")
        if self.steps < 1 or not 0 <= self.warmup <= self.steps:
            raise ValueError(f"Edge Pruning: steps ≥ 1 and 0 ≤ warmup ≤ steps, not steps {self.steps}, "
                             f"warmup {self.warmup}")
        if not 0 < self.read_at < 1:
            raise ValueError(f"Edge Pruning's read_at: a gate value in (0, 1), not {self.read_at}")

    def target(self, step: int) -> float:
        return self.sparsity if self.warmup == 0 else self.sparsity * min(1.0, step / self.warmup)


@dataclass
class PruningResult:
    log_alpha: torch.Tensor  # [senders, receivers] (0 where there is no edge)
    valid: torch.Tensor  # [senders, receivers] bool: the edges
    kept: torch.Tensor  # [senders, receivers] bool: the circuit read at read_at
    history: list[dict]  # per step: loss, expected sparsity, target, lambdas
    steps: int
    seconds: float

    @property
    def scores(self) -> torch.Tensor:
        """[senders, receivers]: sigmoid(log α) on the edges, 0 elsewhere."""
        return torch.where(self.valid, torch.sigmoid(self.log_alpha), 0.0).float()


def sample_gates(log_alpha: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw of every hard-concrete gate (module docstring)."""
    u = torch.rand(log_alpha.shape, generator=generator, dtype=log_alpha.dtype).clamp(1e-6, 1 - 1e-6)
    s = torch.sigmoid((torch.log(u) - torch.log1p(-u) + log_alpha) / BETA)
    return (s * (RIGHT - LEFT) + LEFT).clamp(0.0, 1.0)


def deterministic_gates(log_alpha: torch.Tensor) -> torch.Tensor:
    return (torch.sigmoid(log_alpha) * (RIGHT - LEFT) + LEFT).clamp(0.0, 1.0)


def open_probability(log_alpha: torch.Tensor) -> torch.Tensor:
    """P(z > 0) of each gate."""
    return torch.sigmoid(log_alpha - BETA * math.log(-LEFT / RIGHT))


def prune_edges(faithfulness: Faithfulness, schedule: PruningSchedule, progress: bool = True) -> PruningResult:
    """Edge Pruning's masks trained on ``faithfulness``' prompts (module docstring)."""
    graph = faithfulness.circuits.graph
    valid = graph.valid()
    generator = torch.Generator().manual_seed(schedule.seed)
    log_alpha = (INITIAL_LOG_ALPHA + 0.01 * torch.randn(int(valid.sum()), generator=generator,
                                                        dtype=torch.float64)).requires_grad_(True)
    lambdas = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    optimiser = torch.optim.Adam([log_alpha], lr=schedule.lr)
    ascent = torch.optim.Adam([lambdas], lr=schedule.lambda_lr, maximize=True)
    history, started = [], time.perf_counter()
    for step in tqdm(range(schedule.steps), desc="Edge Pruning", unit="step", mininterval=10, disable=not progress):
        optimiser.zero_grad()
        ascent.zero_grad()
        gates = sample_gates(log_alpha, generator)
        weights = torch.zeros(valid.shape, dtype=torch.float64).masked_scatter(valid, gates)
        loss = faithfulness.batch_term(step % faithfulness.batches, weights=weights) * faithfulness.batches
        gap = (1 - open_probability(log_alpha).mean()) - schedule.target(step)
        penalty = lambdas[0] * gap + lambdas[1] * gap ** 2
        (loss + penalty).backward()
        optimiser.step()
        ascent.step()
        target = schedule.target(step)
        history.append({"step": step, "loss": float(loss.detach()), "expected_sparsity": float(gap.detach()) + target,
                        "target": target, "lambda_1": float(lambdas[0].detach()), "lambda_2": float(lambdas[1].detach())})
    with torch.no_grad():
        located = torch.zeros(valid.shape, dtype=torch.float64).masked_scatter(valid, log_alpha.detach())
        kept = valid & (deterministic_gates(located) > schedule.read_at)
    return PruningResult(located, valid, kept, history, schedule.steps, time.perf_counter() - started)
