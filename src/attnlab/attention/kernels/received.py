"""Received-attention kernel: per key ``j``, ``Σ over real queries i > j of A[i, j]``.

Column sums of the (gated) attention weights, recomputed tile by tile from the scores and each
query row's log-sum-exp (written by the forward kernel), ``p_ij = exp(s_ij - lse_i)``: about one
more attention's worth of work and no weight matrix in memory. The strict ``i > j`` leaves the
diagonal out, as ``reduction.METRIC_DEFINITION`` does; padding rows are left out. Full query
tiles (every query strictly after every key) run without a mask, the others with one; under
inference gates a tile whose gates are all closed skips its exponentials.
"""

import triton
import triton.language as tl

from attnlab.attention.kernels.tiles import (VARYING, allowed_tile, exp_below, load_rows, load_tile, masked_blocks,
                                             masked_start, query_block_split)


@triton.jit(do_not_specialize=VARYING[1:])
def _received_kernel(
        Q, K, LSE, COLUMNS, KEY_REAL,
        sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d,
        H, GROUPS, M, N, D: tl.constexpr, OFFSET, WINDOW, scale, bias,
        GATE: tl.constexpr, HAS_KEY_REAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        PRECISION: tl.constexpr):
    n_start, bh = tl.program_id(0) * BLOCK_N, tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    kv = (h // GROUPS).to(tl.int64)
    offs_n, offs_d = n_start + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    k = load_rows(K + b * sk_b + kv * sk_h, offs_n, offs_d, sk_n, sk_d, N, D)
    Q, LSE = Q + b * sq_b + h * sq_h, LSE + bh.to(tl.int64) * M
    key_real = KEY_REAL + b * N
    columns = tl.zeros([BLOCK_N], tl.float32)
    # full query tiles (every query strictly after every key) without a mask, then those the
    # diagonal, the window's edge or the queries' end crosses, masked
    lo, full_lo, full_hi, hi = query_block_split(n_start, M, N, OFFSET, WINDOW, HAS_WINDOW, BLOCK_M, BLOCK_N, 1)
    for m_start in range(full_lo, full_hi, BLOCK_M):
        columns = _received_tile(Q, LSE, k, columns, m_start, offs_n, offs_d, key_real, sq_m, sq_d, M, N, D, OFFSET,
                                 WINDOW, scale, bias, GATE, HAS_KEY_REAL, HAS_WINDOW, BLOCK_M, PRECISION, False)
    for index in tl.range(0, masked_blocks(lo, full_lo, full_hi, hi, BLOCK_M), num_stages=1):
        m_start = masked_start(index, lo, full_lo, full_hi, BLOCK_M)
        columns = _received_tile(Q, LSE, k, columns, m_start, offs_n, offs_d, key_real, sq_m, sq_d, M, N, D, OFFSET,
                                 WINDOW, scale, bias, GATE, HAS_KEY_REAL, HAS_WINDOW, BLOCK_M, PRECISION, True)
    if HAS_KEY_REAL:  # a padding key receives nothing (full tiles summed its column all the same)
        columns = tl.where(tl.load(key_real + offs_n, mask=offs_n < N, other=0) != 0, columns, 0.0)
    tl.store(COLUMNS + bh.to(tl.int64) * N + offs_n, columns, mask=offs_n < N)


@triton.jit
def _received_tile(Q, LSE, k, columns, m_start, offs_n, offs_d, key_real, sq_m, sq_d, M, N, D: tl.constexpr,
                   OFFSET, WINDOW, scale, bias, GATE: tl.constexpr, HAS_KEY_REAL: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """One query tile's weights summed into the key block's columns. Padding rows take a
    log-sum-exp of +inf: their weights exp(s - lse) are 0 without a mask (a real row sees at least
    its own key)."""
    offs_m = m_start + tl.arange(0, BLOCK_M)
    q = load_tile(Q, offs_m, offs_d, sq_m, sq_d, M, D, MASKED)
    lse = tl.load(LSE + offs_m, mask=offs_m < M, other=float("inf"))
    if HAS_KEY_REAL:  # padding rows are no queries (and the only rows with nothing allowed: -inf)
        real_row = tl.load(key_real + offs_m + OFFSET, mask=offs_m < M, other=0)
        lse = tl.where(real_row != 0, lse, float("inf"))
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if MASKED:
        allowed = allowed_tile(offs_m, offs_n, M, N, OFFSET, WINDOW, key_real, HAS_KEY_REAL, HAS_WINDOW)
        scores = tl.where(allowed & (offs_m[:, None] + OFFSET > offs_n[None, :]), scores, float("-inf"))
    if GATE == 1:  # inference gates 1[s + b > 0]; a tile whose gates are all closed adds nothing
        if tl.max(tl.max(scores, 1), 0) + bias > 0:
            columns += tl.sum(tl.where(scores + bias > 0, exp_below(scores, lse), 0.0), 0)
    else:
        columns += tl.sum(exp_below(scores, lse), 0)
    return columns
