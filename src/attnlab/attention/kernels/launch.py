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

from attnlab.attention.kernels.backward import _backward_kv_kernel, _backward_q_kernel
from attnlab.attention.kernels.forward import ROW_STATS, _forward_kernel
from attnlab.attention.kernels.layout import MaskLayout
from attnlab.attention.kernels.received import _received_kernel
from attnlab.attention.kernels.tiles import logistic_noise

DENSE, DETERMINISTIC, SAMPLED = 0, 1, 2


@dataclass(frozen=True)
class Gate:
    """Which gate the kernels apply: none (a dense model), ``1[s + b > 0]`` or a sampled one."""

    kind: int = DENSE
    bias: float = 0.0
    seed: int = 0  # Philox seed of a sampled gate's noise
    noisy_gradient: bool = False  # straight-through surrogate σ(s + b + L) instead of σ(s + b)


# Tiles per (kernel, 16-bit or float32 operands, head-dimension bound): (BLOCK_M, BLOCK_N, warps,
# stages) on CUDA. Chosen from the compiler's resource report for sm_90 and sm_80 under Triton
# 3.7.1 (benchmarks/gpu/kernel_resources.py; benchmarks/results/kernel_resources_summary_2026-12-05.md):
# no spilled register in 16 bits at any head dimension, training kernels included. Re-chosen 2026-12-05, when the
# report first compiled the kernels as a launch specialises them (``compiled.specialised``): the
# code before already spilled 12-100 bytes in 12 backward variants so compiled, and the masks
# built only where the diagonal runs moved registers; each spilling entry took the first
# spill-free tile of a short list, largest first (forward 128 and 256, received 256,
# backward_kv 128 here; backward_kv 128 and received 256 on sm_80).
TILES = {
    ("forward", "16bit"): {64: (64, 32, 4, 2), 128: (64, 16, 8, 2), 256: (32, 16, 8, 1)},
    ("received", "16bit"): {64: (64, 64, 4, 2), 128: (64, 32, 4, 2), 256: (32, 32, 8, 1)},
    ("backward_kv", "16bit"): {64: (64, 32, 4, 2), 128: (32, 16, 4, 1), 256: (32, 16, 8, 1)},
    # at head dimension 128 no tile with wgmma's 64 rows stays spill-free: mma on 32 × 32 instead
    ("backward_q", "16bit"): {64: (64, 16, 4, 2), 128: (32, 32, 4, 2), 256: (32, 16, 8, 1)},
}
# sm_80 (A100) spills a few bytes with some of those: its own where it does
SM80_TILES = {
    ("forward", "16bit"): {64: (64, 32, 8, 2), 128: (32, 32, 4, 2), 256: (32, 16, 8, 1)},
    ("received", "16bit"): {64: (64, 64, 4, 2), 128: (64, 32, 4, 2), 256: (32, 32, 4, 1)},
    ("backward_kv", "16bit"): {64: (64, 32, 8, 2), 128: (32, 16, 4, 2), 256: (32, 16, 8, 1)},
    # the noise drawn once per four edges (2026-11-29) spilled 12 bytes in the sampled windowed
    # backward_q at 256 on 32 × 16
    ("backward_q", "16bit"): {64: (64, 16, 4, 2), 128: (32, 32, 4, 2), 256: (16, 16, 8, 1)},
}
# Triton 3.6 (the one beside torch 2.11, as on the borrowed GPU machines) allocates registers
# otherwise: 3.7.1's tiles spill in 34 of its 72 16-bit sm_90 variants up to head dimension 128
# (4–336 bytes), and in 28 of 72 on sm_80 (8–268). Its own per target where they differ, from
# the same report under 3.6 (re-chosen 2026-12-05 as ``TILES``: forward 256 and received 256 on
# sm_90, forward 64 on sm_80, backward_kv 256 on both; no variant spills now). Before:
# spill-free but for 4 bytes in the deterministic forward at head dimension 256 on sm_90;
# backward_kv at 128 on mma there, as no 64-row tile stays spill-free. With the noise drawn once
# per four edges (2026-11-29) the sampled backward kernels spilled 8-32 bytes on three of these
# tiles under 3.6: backward_q at 256 now runs 16 × 16 on both targets, backward_kv at 128 on
# sm_80 one stage (benchmarks/results/kernel_resources_triton36_2026-11-29.json).
TRITON36_TILES = {
    90: {("forward", "16bit"): {64: (64, 16, 4, 2), 128: (64, 16, 8, 2), 256: (32, 16, 8, 1)},
         ("received", "16bit"): {64: (64, 64, 4, 2), 128: (64, 32, 4, 2), 256: (32, 32, 4, 1)},
         ("backward_kv", "16bit"): {64: (64, 16, 8, 1), 128: (32, 32, 8, 2), 256: (16, 16, 4, 1)},
         ("backward_q", "16bit"): {64: (64, 16, 4, 2), 128: (64, 16, 8, 2), 256: (16, 16, 8, 1)}},
    80: {("forward", "16bit"): {64: (64, 16, 8, 2), 128: (32, 32, 8, 2), 256: (32, 16, 8, 1)},
         ("backward_kv", "16bit"): {64: (32, 32, 4, 2), 128: (32, 32, 8, 1), 256: (32, 16, 8, 1)},
         ("backward_q", "16bit"): {64: (64, 16, 4, 2), 128: (32, 32, 8, 2), 256: (16, 16, 8, 1)}},
}
# A sampled gate's noise holds more registers than a dense model's backward: where the sampled
# kernel spills on the dense one's tile, its own (per target, Triton 3.7 and later). backward_kv at
# head dimension 64 on sm_90 spilled 56-68 bytes on 64 x 32, in the code before 2026-12-05 too.
SAMPLED_TILES = {90: {("backward_kv", "16bit"): {64: (64, 16, 4, 2)}}, 80: {}}
TRITON_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2])
# float32 never runs on CUDA unless forced (``fused.float32_kernels``): the tiles of before
FLOAT32_TILES = {64: (64, 64, 4, 2), 128: (64, 32, 4, 2), 256: (32, 32, 4, 1)}
for _kernel in ("forward", "received", "backward_kv", "backward_q"):
    TILES[(_kernel, "float32")] = FLOAT32_TILES
SMALL_QUERIES = 16  # fewer query rows than this (a decoding step: one) run on 16-row blocks


def blocks(head_dim: int, device: torch.device, dtype: torch.dtype = torch.float32, kernel: str = "forward",
           queries: int | None = None, arch: int | None = None, sampled: bool = False) -> tuple[int, int, int, dict]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, launch options) of ``kernel`` for this head size and dtype on
    ``device`` (``TILES``; sm_80 and older: ``SM80_TILES`` where they differ; Triton before 3.7:
    ``TRITON36_TILES`` of the target where they differ; a ``sampled`` gate: ``SAMPLED_TILES``
    first; ``arch``: the compute capability's major × 10, else the device's); 16 × 16 in Triton's
    CPU interpreter. With few ``queries`` (a decoding step) the query block shrinks to 16 rows: a
    64-row block would leave 63 of 64 rows idle."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if device.type != "cuda":
        return 16, 16, block_d, {}
    if arch is None:
        arch = 10 * torch.cuda.get_device_capability(device)[0]
    kind = "float32" if dtype == torch.float32 else "16bit"
    bound = next(bound for bound in (64, 128, 256) if block_d <= bound)
    block_m, block_n, warps, stages = _tile(kernel, kind, arch, bound, sampled)
    if queries is not None and queries < SMALL_QUERIES:
        block_m = SMALL_QUERIES
    return block_m, block_n, block_d, {"num_warps": warps, "num_stages": stages}


def _tile(kernel: str, kind: str, arch: int, bound: int, sampled: bool) -> tuple[int, int, int, int]:
    """The first table with an entry for the kernel: the Triton version's and the gate's own
    before the target's, before ``TILES``."""
    target = 90 if arch >= 90 else 80
    tables = [TRITON36_TILES[target]] if TRITON_VERSION < (3, 7) else [SAMPLED_TILES[target]] if sampled else []
    tables += [SM80_TILES] if arch < 90 else []
    for table in (*tables, TILES):
        if bound in table.get((kernel, kind), {}):
            return table[(kernel, kind)][bound]
    raise KeyError((kernel, kind, bound))


def precision(dtype: torch.dtype) -> str:
    """The dot products' input precision: float32 inputs exact (no TF32), as the eager float32 path
    computes them; 16-bit inputs need none (their products are exact in the float32 accumulator)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _flags(layout: MaskLayout, device) -> tuple[torch.Tensor, dict]:
    """The keys' flags as the kernels read them (int8, not bool: one byte per key, loaded as a
    number in every Triton version), converted once per layout, not once per layer and call."""
    key = ("key_real", str(device))
    if key not in layout.derived:
        layout.derived[key] = (layout.key_real.to(torch.int8) if layout.key_real is not None
                               else torch.ones(1, device=device, dtype=torch.int8))
    return layout.derived[key], {"HAS_KEY_REAL": layout.key_real is not None, "HAS_WINDOW": layout.window is not None}


def _strides(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.stride())


@dataclass(frozen=True)
class Launch:
    """One kernel launch as a launcher makes it: the kernel, its grid, its positional arguments
    and its keyword constants (constexprs and launch options). ``compiled`` compiles a variant from
    the very arguments a launch passes (attnlab.attention.kernels.compiled)."""

    kernel: object
    grid: tuple
    args: tuple
    constants: dict

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.constants)


def _tiles(head_dim, device, dtype, kernel, gate: Gate, queries=None, arch=None):
    """``blocks`` on ``device``, or for a CUDA card of compute capability ``arch`` (a compile
    for a card this machine need not have)."""
    target = torch.device("cuda") if arch is not None else device
    return blocks(head_dim, target, dtype, kernel, queries, arch, sampled=gate.kind == SAMPLED)


def forward_launch(query, key, value, layout: MaskLayout, gate: Gate, scale: float,
                   inserted: torch.Tensor | None = None, arch: int | None = None):
    """(the forward kernel's ``Launch``, (output [B, M, H, D], log-sum-exp [B, H, M], statistics
    [len(ROW_STATS), B, H, M]) it writes)."""
    batch, heads, queries, head_dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    out = torch.empty(batch, queries, heads, head_dim, device=query.device, dtype=query.dtype)
    lse = torch.empty(batch, heads, queries, device=query.device, dtype=torch.float32)
    stats = torch.empty(len(ROW_STATS), batch, heads, queries, device=query.device, dtype=torch.float32)
    key_real, flags = _flags(layout, query.device)
    block_m, block_n, block_d, options = _tiles(head_dim, query.device, query.dtype, "forward", gate, queries, arch)
    has_inserted = inserted is not None
    args = (query, key, value, out.transpose(1, 2), lse, stats, key_real,
            inserted.to(torch.int8) if has_inserted else key_real,
            *_strides(query), *_strides(key), *_strides(value), *_strides(out.transpose(1, 2)),
            batch, heads, heads // kv_heads, queries, keys, head_dim, layout.offset, layout.window or 0,
            scale, gate.bias, gate.seed)
    constants = dict(GATE=gate.kind, HAS_INSERTED=has_inserted, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                     PRECISION=precision(query.dtype), **flags, **options)
    return Launch(_forward_kernel, (triton.cdiv(queries, block_m), batch * heads), args, constants), (out, lse, stats)


def forward(query, key, value, layout: MaskLayout, gate: Gate, scale: float,
            inserted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output [B, M, H, D], log-sum-exp [B, H, M], statistics [len(ROW_STATS), B, H, M])."""
    launch, outputs = forward_launch(query, key, value, layout, gate, scale, inserted)
    launch()
    return outputs


def received_launch(query, key, lse, layout: MaskLayout, gate: Gate, scale: float, arch: int | None = None):
    """(the received-attention kernel's ``Launch``, the columns [B, H, N] it writes)."""
    if gate.kind == SAMPLED:
        raise ValueError("received attention is defined under the inference gates, not sampled ones")
    batch, heads, queries, head_dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    columns = torch.empty(batch, heads, keys, device=query.device, dtype=torch.float32)
    key_real, flags = _flags(layout, query.device)
    block_m, block_n, block_d, options = _tiles(head_dim, query.device, query.dtype, "received", gate, arch=arch)
    args = (query, key, lse, columns, key_real, *_strides(query), *_strides(key),
            heads, heads // kv_heads, queries, keys, head_dim, layout.offset, layout.window or 0, scale, gate.bias)
    constants = dict(GATE=gate.kind, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                     PRECISION=precision(query.dtype), **flags, **options)
    return Launch(_received_kernel, (triton.cdiv(keys, block_n), batch * heads), args, constants), columns


def received_columns(query, key, lse, layout: MaskLayout, gate: Gate, scale: float) -> torch.Tensor:
    """[B, H, N]: per key, the (gated) attention it receives summed over real, strictly later queries
    (a dense model's, or a sparse copy's under its inference gates ``1[s + b > 0]``)."""
    launch, columns = received_launch(query, key, lse, layout, gate, scale)
    launch()
    return columns


def backward_launches(saved, d_out, d_expected, layout: MaskLayout, gate: Gate, scale: float,
                      arch: int | None = None):
    """(the ``Launch`` of backward_kv and of backward_q, (dq, dk, dv) they write) (backward.py)."""
    query, key, value, out, lse = saved
    batch, heads, queries, head_dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    d_out = d_out.transpose(1, 2)  # [B, H, M, D] view of the [B, M, H, D] gradient
    delta = (d_out.float() * out.transpose(1, 2).float()).sum(-1).contiguous()
    d_expected = (torch.zeros_like(lse) if d_expected is None else d_expected.float()).contiguous()
    # contiguous gradients: dk and dv share one set of strides in the kernel
    dq, dk, dv = (torch.empty(x.shape, device=x.device, dtype=x.dtype) for x in (query, key, value))
    key_real, flags = _flags(layout, query.device)
    shapes = (queries, keys, head_dim, layout.offset, layout.window or 0, scale, gate.bias, gate.seed)
    launches = []
    for kernel, out, grid_of in (("backward_kv", (dk, dv), lambda bm, bn: (triton.cdiv(keys, bn), batch * kv_heads)),
                                 ("backward_q", (dq,), lambda bm, bn: (triton.cdiv(queries, bm), batch * heads))):
        block_m, block_n, block_d, options = _tiles(head_dim, query.device, query.dtype, kernel, gate, arch=arch)
        constants = dict(GATE=gate.kind, NOISY=gate.noisy_gradient, BLOCK_M=block_m, BLOCK_N=block_n,
                         BLOCK_D=block_d, PRECISION=precision(query.dtype), **flags, **options)
        heads_args = (heads, kv_heads, heads // kv_heads) if kernel == "backward_kv" else (heads, heads // kv_heads)
        function = _backward_kv_kernel if kernel == "backward_kv" else _backward_q_kernel
        args = (query, key, value, d_out, lse, delta, d_expected, *out, key_real,
                *_strides(query), *_strides(key), *_strides(value), *_strides(d_out), *_strides(out[0]),
                *heads_args, *shapes)
        launches.append(Launch(function, grid_of(block_m, block_n), args, constants))
    return launches, (dq, dk, dv)


def backward(saved, d_out, d_expected, layout: MaskLayout, gate: Gate, scale: float):
    """(dq, dk, dv) of the gated attention (backward.py)."""
    launches, gradients = backward_launches(saved, d_out, d_expected, layout, gate, scale)
    for launch in launches:
        launch()
    return gradients


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
