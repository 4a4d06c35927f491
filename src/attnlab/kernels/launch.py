"""Launchers of the fused attention kernels and the autograd function that joins them.

``attention(...)`` is what the rest of the library calls: queries ``[B, H, M, D]``, keys and
values ``[B, H_kv, N, D]`` (grouped-query heads are mapped, never repeated in memory), the mask's
structure (``layout.MaskLayout``) and the gate (``Gate``). It returns the output
``[B, M, H, D]`` (the layout the decoder's o_proj reads) and per-row statistics; the expected
density rows carry a gradient, so the density penalty trains through the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attnlab.kernels.backward import _backward_kv_kernel, _backward_q_kernel
from attnlab.kernels.forward import ROW_STATS, _forward_kernel
from attnlab.kernels.layout import MaskLayout
from attnlab.kernels.received import _received_kernel
from attnlab.kernels.tiles import logistic_noise

DENSE, DETERMINISTIC, SAMPLED = 0, 1, 2


@dataclass(frozen=True)
class Gate:
    """Which gate the kernels apply: none (a dense model), ``1[s + b > 0]`` or a sampled one."""

    kind: int = DENSE
    bias: float = 0.0
    seed: int = 0  # Philox seed of a sampled gate's noise
    noisy_gradient: bool = False  # straight-through surrogate σ(s + b + L) instead of σ(s + b)


def blocks(head_dim: int, device: torch.device) -> tuple[int, int, int, dict]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, launch options) for this head size: tiles that fit the
    registers and shared memory of current GPUs; 16 × 16 in Triton's CPU interpreter."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if device.type != "cuda":
        return 16, 16, block_d, {}
    if block_d <= 64:
        return 64, 64, block_d, {"num_warps": 4, "num_stages": 2}
    if block_d <= 128:
        return 64, 32, block_d, {"num_warps": 4, "num_stages": 2}
    return 32, 32, block_d, {"num_warps": 4, "num_stages": 1}


def _precision(dtype: torch.dtype) -> str:
    # float32 inputs: exact products (no TF32), as the eager float32 path computes them.
    return "ieee" if dtype == torch.float32 else "tf32"


def _flags(layout: MaskLayout, device) -> tuple[torch.Tensor, dict]:
    # int8, not bool: one byte per key, loaded as a number in every Triton version
    key_real = (layout.key_real.to(torch.int8) if layout.key_real is not None
                else torch.ones(1, device=device, dtype=torch.int8))
    return key_real, {"HAS_KEY_REAL": layout.key_real is not None, "HAS_WINDOW": layout.window is not None}


def _strides(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.stride())


def forward(query, key, value, layout: MaskLayout, gate: Gate, scale: float,
            inserted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output [B, M, H, D], log-sum-exp [B, H, M], statistics [len(ROW_STATS), B, H, M])."""
    batch, heads, queries, head_dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    out = torch.empty(batch, queries, heads, head_dim, device=query.device, dtype=query.dtype)
    lse = torch.empty(batch, heads, queries, device=query.device, dtype=torch.float32)
    stats = torch.empty(len(ROW_STATS), batch, heads, queries, device=query.device, dtype=torch.float32)
    key_real, flags = _flags(layout, query.device)
    block_m, block_n, block_d, options = blocks(head_dim, query.device)
    has_inserted = inserted is not None
    grid = (triton.cdiv(queries, block_m), batch * heads)
    _forward_kernel[grid](
        query, key, value, out.transpose(1, 2), lse, stats, key_real,
        inserted.to(torch.int8) if has_inserted else key_real,
        *_strides(query), *_strides(key), *_strides(value), *_strides(out.transpose(1, 2)),
        batch, heads, heads // kv_heads, queries, keys, head_dim, layout.offset, layout.window or 0,
        scale, gate.bias, gate.seed, GATE=gate.kind, HAS_INSERTED=has_inserted,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=_precision(query.dtype),
        **flags, **options)
    return out, lse, stats


def received_columns(query, key, lse, layout: MaskLayout, gate: Gate, scale: float) -> torch.Tensor:
    """[B, H, N]: per key, the (gated) attention it receives summed over real, strictly later queries
    (a dense model's, or a sparse copy's under its inference gates ``1[s + b > 0]``)."""
    if gate.kind == SAMPLED:
        raise ValueError("received attention is defined under the inference gates, not sampled ones")
    batch, heads, queries, head_dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    columns = torch.empty(batch, heads, keys, device=query.device, dtype=torch.float32)
    key_real, flags = _flags(layout, query.device)
    block_m, block_n, block_d, options = blocks(head_dim, query.device)
    grid = (triton.cdiv(keys, block_n), batch * heads)
    _received_kernel[grid](
        query, key, lse, columns, key_real, *_strides(query), *_strides(key),
        heads, heads // kv_heads, queries, keys, head_dim, layout.offset, layout.window or 0,
        scale, gate.bias, GATE=gate.kind,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=_precision(query.dtype),
        **flags, **options)
    return columns


def backward(saved, d_out, d_expected, layout: MaskLayout, gate: Gate, scale: float):
    """(dq, dk, dv) of the gated attention (backward.py)."""
    query, key, value, out, lse = saved
    batch, heads, queries, head_dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    d_out = d_out.transpose(1, 2)  # [B, H, M, D] view of the [B, M, H, D] gradient
    delta = (d_out.float() * out.transpose(1, 2).float()).sum(-1).contiguous()
    d_expected = (torch.zeros_like(lse) if d_expected is None else d_expected.float()).contiguous()
    # contiguous gradients: dk and dv share one set of strides in the kernel
    dq, dk, dv = (torch.empty(x.shape, device=x.device, dtype=x.dtype) for x in (query, key, value))
    key_real, flags = _flags(layout, query.device)
    block_m, block_n, block_d, options = blocks(head_dim, query.device)
    common = dict(GATE=gate.kind, NOISY=gate.noisy_gradient, BLOCK_M=block_m, BLOCK_N=block_n,
                  BLOCK_D=block_d, PRECISION=_precision(query.dtype), **flags, **options)
    shapes = (queries, keys, head_dim, layout.offset, layout.window or 0, scale, gate.bias, gate.seed)
    _backward_kv_kernel[(triton.cdiv(keys, block_n), batch * kv_heads)](
        query, key, value, d_out, lse, delta, d_expected, dk, dv, key_real,
        *_strides(query), *_strides(key), *_strides(value), *_strides(d_out), *_strides(dk),
        heads, kv_heads, heads // kv_heads, *shapes, **common)
    _backward_q_kernel[(triton.cdiv(queries, block_m), batch * heads)](
        query, key, value, d_out, lse, delta, d_expected, dq, key_real,
        *_strides(query), *_strides(key), *_strides(value), *_strides(d_out), *_strides(dq),
        heads, heads // kv_heads, *shapes, **common)
    return dq, dk, dv


class _GatedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, layout, gate, scale, inserted):
        out, lse, stats = forward(query, key, value, layout, gate, scale, inserted)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.layout, ctx.gate, ctx.scale = layout, gate, scale
        expected = stats[ROW_STATS.index("expected")]
        ctx.mark_non_differentiable(lse, stats)
        return out, expected.clone(), lse, stats

    @staticmethod
    def backward(ctx, d_out, d_expected, _lse, _stats):
        dq, dk, dv = backward(ctx.saved_tensors, d_out.contiguous(), d_expected, ctx.layout, ctx.gate,
                              ctx.scale)
        return dq, dk, dv, None, None, None, None


def attention(query, key, value, layout: MaskLayout, gate: Gate, scale: float,
              inserted: torch.Tensor | None = None):
    """(output [B, M, H, D], expected-density rows [B, H, M] (differentiable), log-sum-exp
    [B, H, M], statistics [len(ROW_STATS), B, H, M])."""
    return _GatedAttention.apply(query, key, value, layout, gate, scale, inserted)


@triton.jit
def _noise_kernel(OUT, seed, H, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    m_start, n_start, bh = tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_N, tl.program_id(2)
    offs_m, offs_n = m_start + tl.arange(0, BLOCK_M), n_start + tl.arange(0, BLOCK_N)
    noise = logistic_noise(seed, bh, offs_m, offs_n, M, N)
    where = bh.to(tl.int64) * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(OUT + where, noise, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def sampled_noise(seed: int, batch: int, heads: int, queries: int, keys: int, device) -> torch.Tensor:
    """[B, H, M, N]: the logistic noise a sampled gate with this seed draws for every edge (the
    kernels' own draw, for checking them against the eager computation)."""
    out = torch.empty(batch, heads, queries, keys, device=device, dtype=torch.float32)
    grid = (triton.cdiv(queries, 16), triton.cdiv(keys, 16), batch * heads)
    _noise_kernel[grid](out, seed, heads, queries, keys, BLOCK_M=16, BLOCK_N=16)
    return out
