"""Received-attention kernel: per key ``j``, ``Σ over real queries i > j of A[i, j]``.

Column sums of the (gated) attention weights, recomputed tile by tile from the scores and each
query row's log-sum-exp (written by the forward kernel), ``p_ij = exp(s_ij - lse_i)``: about one
more attention's worth of work and no weight matrix in memory. The strict ``i > j`` leaves the
diagonal out, as ``reduction.METRIC_DEFINITION`` does; padding rows are left out.
"""

import triton
import triton.language as tl

from attnlab.attention.kernels.tiles import VARYING, allowed_tile, load_rows, query_blocks


@triton.jit(do_not_specialize=VARYING[1:])
def _received_kernel(
        Q, K, LSE, COLUMNS, KEY_REAL,
        sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d,
        H, GROUPS, M, N, D, OFFSET, WINDOW, scale, bias,
        GATE: tl.constexpr, HAS_KEY_REAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr):
    n_start, bh = tl.program_id(0) * BLOCK_N, tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    kv = (h // GROUPS).to(tl.int64)
    offs_n, offs_d = n_start + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    k = load_rows(K + b * sk_b + kv * sk_h, offs_n, offs_d, sk_n, sk_d, N, D)
    Q = Q + b * sq_b + h * sq_h
    key_real = KEY_REAL + b * N
    columns = tl.zeros([BLOCK_N], tl.float32)
    lo, hi = query_blocks(n_start, M, OFFSET, WINDOW, HAS_WINDOW, BLOCK_M, BLOCK_N)
    for m_start in range(lo, hi, BLOCK_M):
        offs_m = m_start + tl.arange(0, BLOCK_M)
        q = load_rows(Q, offs_m, offs_d, sq_m, sq_d, M, D)
        lse = tl.load(LSE + bh.to(tl.int64) * M + offs_m, mask=offs_m < M, other=0.0)
        logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        allowed = allowed_tile(offs_m, offs_n, M, N, OFFSET, WINDOW, key_real, HAS_KEY_REAL, HAS_WINDOW)
        later = allowed & (offs_m[:, None] + OFFSET > offs_n[None, :])
        if HAS_KEY_REAL:  # padding rows are no queries
            real_row = tl.load(key_real + offs_m + OFFSET, mask=offs_m < M, other=0)
            later = later & (real_row[:, None] != 0)
        if GATE == 1:
            later = later & (logits + bias > 0)
        columns += tl.sum(tl.where(later, tl.exp(logits - lse[:, None]), 0.0), 0)
    tl.store(COLUMNS + bh.to(tl.int64) * N + offs_n, columns, mask=offs_n < N)
