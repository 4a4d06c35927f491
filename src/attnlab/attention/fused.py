"""The attention function's fused path: when its kernels run, and what it records from them.

On a GPU, the attention function of ``attnlab.interventions`` hands a layer to the Triton kernels
of ``attnlab.attention.kernels`` (dense or edge-gated attention, the received-attention reduction, the
gated backward pass) instead of its eager blocks, which hold queries × keys probabilities (and,
for training, the noise and the gates) per head. The results are the same quantities: the
output, a sparse copy's gates (sampled with the straight-through estimator and the
expected-density penalty when training, ``1[s + b > 0]`` otherwise, counted per head), and
received attention and λ as ``reduction.METRIC_DEFINITION`` defines them.

``ATTNLAB_FUSED_ATTENTION`` chooses: ``auto`` (the default) runs the kernels on CUDA tensors in 16
bits only (on a CPU the eager blocks are faster than anything Triton offers there; float32 kernels
spill registers: ``float32_kernels``); ``off`` never; ``on`` also float32 on CUDA, and CPU tensors, which needs Triton's interpreter (``TRITON_INTERPRET=1``): the tests' way
of checking the kernels against the eager path. A layer the kernels cannot take (logit
soft-capping, a mask other than causal ∧ sliding window ∧ padding, a full map asked for, a head
larger than 256) stays on the eager path, and the log says why once per reason.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from attnlab.attention import reduction, sparse
from attnlab.config.checks import FUSED_LARGEST_HEAD, FUSED_MODE_VARIABLE, fused_mode

log = logging.getLogger(__name__)

MODE_VARIABLE = FUSED_MODE_VARIABLE  # read by config.checks.fused_mode, which the config check shares
LARGEST_HEAD = FUSED_LARGEST_HEAD


@functools.cache
def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def enabled(device: torch.device) -> bool:
    """Whether tensors on ``device`` go through the kernels (module docstring)."""
    chosen = fused_mode()
    if chosen == "off" or triton_version() is None:
        return False
    if device.type == "cuda":
        return True
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return chosen == "on" and device.type == "cpu" and interpreting


@functools.cache
def _say_once(reason: str) -> None:
    log.info("fused attention not used (%s): eager attention blocks instead", reason)


def float32_kernels(device_type: str) -> bool:
    """Whether float32 layers on ``device_type`` go through the kernels: not on CUDA unless asked
    (``on``). Compiled for sm_80 and sm_90, every float32 variant spills 15-37 KB of registers per
    thread (FMA, no tensor cores; benchmarks/gpu/README.md, "Kernel resources"), and the eager blocks
    scored SmolLM2's 270 heads on 32 prompts in 2.1 s on an H200: float32 stays eager there until a
    GPU measures the kernels faster. The CPU interpreter (tests) runs them in float32."""
    return device_type != "cuda" or fused_mode() == "on"


def unfused_reason(query, softcap, layer: int, reduce, dtype: torch.dtype | None = None) -> str | None:
    """Why a layer cannot go through the kernels (besides its mask), or None; ``dtype``: the one
    the kernels would compute it in (``kernel_dtype``)."""
    dtype = dtype or query.dtype
    if softcap is not None:
        return "attention logit soft-capping"
    if query.shape[-1] > LARGEST_HEAD:
        return f"head dimension {query.shape[-1]} > {LARGEST_HEAD}"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {dtype}"
    if dtype == torch.float32 and not float32_kernels(query.device.type):
        return "float32 on CUDA (its kernels spill registers: eager until measured faster; ATTNLAB_FUSED_ATTENTION=on forces them)"
    if reduce is not None and layer in reduce.map_layers:
        return "a full attention map is kept for this layer"
    return None


def attend(module, query, key, value, attention_mask, scaling: float, softcap, bias: float | None,
           tracker: sparse.GateTracker | None, reduce: reduction.BatchReduction | None,
           sliding_window: int | None) -> torch.Tensor | None:
    """The layer's attention output [batch, queries, heads, head_dim] from the kernels, recording
    gates and reductions as the eager blocks do; None where the kernels do not apply."""
    if not enabled(query.device):
        return None
    from attnlab.attention.kernels import launch
    from attnlab.attention.kernels.layout import layout_of

    dtype = kernel_dtype(query, key, value)
    reason = unfused_reason(query, softcap, module.layer_idx, reduce, dtype)
    layout = None
    if reason is None:
        layout = layout_of(attention_mask, query.shape[-2], key.shape[-2], sliding_window)
        reason = None if layout is not None else "a mask other than causal, sliding window and padding"
    if reason is not None:
        _say_once(reason)
        return None
    gate, recomputing = _gate(launch, module.layer_idx, bias, tracker)
    inserted = reduce.inserted_keys if reduce is not None else None
    query, key, value = (x.to(dtype) for x in (query, key, value))
    out, expected, lse, stats = launch.attention(query, key, value, layout, gate, scaling, inserted)
    if tracker is not None:
        # The penalty's sum is taken in the replay too: a checkpointed layer must save the same
        # tensors when it is recomputed as when it first ran. Only the first run records it.
        penalty = expected.sum()
        if not recomputing:
            _count(tracker, module.layer_idx, gate, penalty, stats, launch)
    if reduce is not None:
        later_sums = launch.received_columns(query, key, lse, layout, gate, scaling)
        mass = launch.ROW_STATS
        total = stats[mass.index("gated_mass")] if bias is not None else 1.0
        reduction.store(reduce, module.layer_idx, later_sums, total - stats[mass.index("inserted_mass")])
    return out


def kernel_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.dtype:
    """The one dtype the kernels compute a layer in. Under autocast, its dtype, as the eager
    attention's matrix products would run: a model's own q, k and v can differ there (Llama's
    rotary embedding returns float32 queries and keys beside bfloat16 values), and a kernel's
    ``tl.dot`` takes operands of one dtype only. Elsewhere the widest of the three."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)


def _gate(launch, layer: int, bias: float | None, tracker: sparse.GateTracker | None):
    """(the kernels' Gate, whether this call recomputes a checkpointed layer)."""
    if bias is None:
        return launch.Gate(), False
    if tracker is None or not tracker.training:
        return launch.Gate(launch.DETERMINISTIC, bias), False
    seed, recomputing = tracker.layer_seed(layer)
    return launch.Gate(launch.SAMPLED, bias, seed, tracker.gradient == "noisy"), recomputing


def _count(tracker: sparse.GateTracker, layer: int, gate, penalty, stats, launch) -> None:
    """The tracker's records of one call: the penalty and sampled counts when training, open and
    allowed edges per head at inference (as ``sparse.training_gate`` / ``count_open_edges``)."""
    names = launch.ROW_STATS
    opened, allowed = stats[names.index("opened")], stats[names.index("allowed")]
    if gate.kind == launch.SAMPLED:
        tracker.expected_sum.append(penalty)
        tracker.sampled_open = tracker.sampled_open + opened.double().sum()
        tracker.edges = tracker.edges + allowed.double().sum()
    elif gate.kind == launch.DETERMINISTIC:
        # left on the device (read once, after the forward): a copy per layer would stall a GPU
        sparse.add_open_edges(tracker, layer, opened.double().sum(dim=(0, 2)), allowed.double().sum(dim=(0, 2)))
