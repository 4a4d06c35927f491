"""The eager training gate drawing the kernels' own noise: the reference a fused training step is
checked against (tests/test_kernels.py, benchmarks/gpu/node.py). The eager path draws its noise from
a torch.Generator, the kernels from Philox counters (``launch.sampled_noise``); with this gate in
place of ``sparse.training_gate`` both paths sample the very same gates, so a step's loss,
densities and gradients must agree to float rounding."""

from __future__ import annotations

import torch

from attnlab.attention import sparse
from attnlab.attention.kernels import launch


def training_gate_with_kernel_noise(tracker: sparse.GateTracker, layer: int, logits: torch.Tensor,
                                    bias: float, allowed: torch.Tensor) -> torch.Tensor:
    """``sparse.training_gate`` with the noise the kernels draw for this tracker and layer."""
    seed, recomputing = tracker.layer_seed(layer)
    noise = launch.sampled_noise(seed, *logits.shape, logits.device)
    gate_logits = logits.float() + bias
    expected = torch.sigmoid(gate_logits)
    surrogate = torch.sigmoid(gate_logits + noise) if tracker.gradient == "noisy" else expected
    hard = (gate_logits + noise > 0).float()
    allowed = allowed.expand_as(hard)
    penalty = (expected * allowed).sum()  # in a checkpointed replay too: the same saved tensors
    if not recomputing:
        tracker.expected_sum.append(penalty)
        tracker.sampled_open += float((hard.bool() & allowed).sum())
        tracker.edges += float(allowed.sum())
    return (hard + surrogate - surrogate.detach()).to(logits.dtype)
