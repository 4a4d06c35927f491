"""Backward kernels of the gated attention ``y_i = Σ_j p_ij g_ij v_j`` (p the ungated softmax).

With ``dP_ij = dy_i · v_j`` and ``Δ_i = dy_i · y_i`` (= Σ_j p_ij g_ij dP_ij), the gradient of the
scores is, per allowed edge,

    ds_ij = p_ij (g_ij dP_ij - Δ_i)                 through the softmax
          + p_ij dP_ij σ'(u_ij)                     through the straight-through gate (GATE 2)
          + c_i σ'(s_ij + b)                        through the expected-density penalty (GATE 2)

where ``u = s + b`` (``expected`` gradient) or ``s + b + L`` with the sample's own noise L
(``noisy``), and ``c_i`` is the gradient of row i's expected-density sum. The deterministic gate
(GATE 1) passes no gradient, as ``sparse.deterministic_gate``. Then ``dq = scale · ds k``,
``dk = scale · dsᵀ q``, ``dv = (p g)ᵀ dy``. As in flash attention's backward, one kernel walks
the queries of each key block (dk, dv: summed over the query heads that share a key/value head)
and one the keys of each query block (dq); both recompute p from the scores and the saved
log-sum-exp, so nothing of size queries × keys is stored. Each loop runs its full tiles without a
mask, then the masked ones (``tiles.key_block_split``, ``query_block_split``), as the forward does.
"""

import triton
import triton.language as tl

from attnlab.attention.kernels.tiles import (VARYING, allowed_tile, exp_below, full_tile_scores, gate_tile,
                                             key_block_split, load_rows, load_tile, masked_blocks,
                                             masked_start, query_block_split)


@triton.jit
def _score_gradient(q, k, v, dy, lse, delta, dexp, offs_m, offs_n, key_real, bh, scale, bias, seed,
                    M, N, OFFSET, WINDOW, GATE: tl.constexpr, NOISY: tl.constexpr,
                    HAS_KEY_REAL: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
                    MASKED: tl.constexpr):
    """(ds, p·g) of one tile: the score gradient (module docstring) and the gated weights. The
    scores are -inf on every closed edge (built edge by edge where ``MASKED``, by padding keys
    alone in a full tile), so p, the gate and σ are 0 there and so is ds: no mask after."""
    logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if MASKED:
        allowed = allowed_tile(offs_m, offs_n, M, N, OFFSET, WINDOW, key_real, HAS_KEY_REAL, HAS_WINDOW)
        scores = tl.where(allowed, logits, float("-inf"))
    else:
        scores, _ = full_tile_scores(logits, key_real, offs_n, N, HAS_KEY_REAL)
    p = exp_below(scores, lse)
    hard, gate_logit = gate_tile(scores, bias, seed, bh, offs_m, offs_n, M, N, GATE)
    d_weights = tl.dot(dy, tl.trans(v), input_precision=PRECISION)
    ds = p * (hard * d_weights - delta[:, None])
    if GATE == 2:
        expected = tl.sigmoid(scores + bias)
        surrogate = expected
        if NOISY:
            surrogate = tl.sigmoid(gate_logit)
        ds += p * d_weights * surrogate * (1 - surrogate) + dexp[:, None] * expected * (1 - expected)
    return ds, p * hard


@triton.jit
def _row_terms(LSE, DELTA, DEXP, bh, offs_m, M):
    """A row's log-sum-exp, Δ and density gradient; a row with no allowed key (log-sum-exp -inf)
    takes +inf, so its weights exp(s - lse) are 0 even where a full tile leaves s finite."""
    row = bh.to(tl.int64) * M + offs_m
    inside = offs_m < M
    lse = tl.load(LSE + row, mask=inside, other=0.0)
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(DELTA + row, mask=inside, other=0.0)
    dexp = tl.load(DEXP + row, mask=inside, other=0.0)
    return lse, delta, dexp


@triton.jit(do_not_specialize=VARYING)
def _backward_kv_kernel(
        Q, K, V, DY, LSE, DELTA, DEXP, DK, DV, KEY_REAL,
        sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
        sy_b, sy_h, sy_m, sy_d, sg_b, sg_h, sg_n, sg_d,
        H, HKV, GROUPS, M, N, D: tl.constexpr, OFFSET, WINDOW, scale, bias, seed,
        GATE: tl.constexpr, NOISY: tl.constexpr, HAS_KEY_REAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    n_start, bkv = tl.program_id(0) * BLOCK_N, tl.program_id(1)
    b, kv = (bkv // HKV).to(tl.int64), (bkv % HKV).to(tl.int64)
    offs_n, offs_d = n_start + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    k = load_rows(K + b * sk_b + kv * sk_h, offs_n, offs_d, sk_n, sk_d, N, D)
    v = load_rows(V + b * sv_b + kv * sv_h, offs_n, offs_d, sv_n, sv_d, N, D)
    key_real = KEY_REAL + b * N
    dk, dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32), tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # full query tiles without a mask, then those the diagonal, the window's edge or the queries'
    # end crosses, masked
    lo, full_lo, full_hi, hi = query_block_split(n_start, M, N, OFFSET, WINDOW, HAS_WINDOW, BLOCK_M, BLOCK_N, 0)
    for g in range(GROUPS):
        h = kv * GROUPS + g
        Qh, DYh, bh = Q + b * sq_b + h * sq_h, DY + b * sy_b + h * sy_h, b * H + h
        for m_start in range(full_lo, full_hi, BLOCK_M):
            dk, dv = _kv_tile(Qh, DYh, LSE, DELTA, DEXP, k, v, dk, dv, m_start, offs_n, offs_d, key_real, bh,
                              sq_m, sq_d, sy_m, sy_d, scale, bias, seed, M, N, D, OFFSET, WINDOW, GATE, NOISY,
                              HAS_KEY_REAL, HAS_WINDOW, BLOCK_M, PRECISION, False)
        for index in tl.range(0, masked_blocks(lo, full_lo, full_hi, hi, BLOCK_M), num_stages=1):
            m_start = masked_start(index, lo, full_lo, full_hi, BLOCK_M)
            dk, dv = _kv_tile(Qh, DYh, LSE, DELTA, DEXP, k, v, dk, dv, m_start, offs_n, offs_d, key_real, bh,
                              sq_m, sq_d, sy_m, sy_d, scale, bias, seed, M, N, D, OFFSET, WINDOW, GATE, NOISY,
                              HAS_KEY_REAL, HAS_WINDOW, BLOCK_M, PRECISION, True)
    grad_mask = (offs_n[:, None] < N) & (offs_d[None, :] < D)
    where = offs_n[:, None] * sg_n + offs_d[None, :] * sg_d
    tl.store(DK + b * sg_b + kv * sg_h + where, (dk * scale).to(DK.dtype.element_ty), mask=grad_mask)
    tl.store(DV + b * sg_b + kv * sg_h + where, dv.to(DV.dtype.element_ty), mask=grad_mask)


@triton.jit
def _kv_tile(Q, DY, LSE, DELTA, DEXP, k, v, dk, dv, m_start, offs_n, offs_d, key_real, bh, sq_m, sq_d, sy_m, sy_d,
             scale, bias, seed, M, N, D: tl.constexpr, OFFSET, WINDOW, GATE: tl.constexpr, NOISY: tl.constexpr,
             HAS_KEY_REAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr,
             MASKED: tl.constexpr):
    """One query tile's share of a key block's dk and dv."""
    offs_m = m_start + tl.arange(0, BLOCK_M)
    q = load_tile(Q, offs_m, offs_d, sq_m, sq_d, M, D, MASKED)
    dy = load_tile(DY, offs_m, offs_d, sy_m, sy_d, M, D, MASKED)
    lse, delta, dexp = _row_terms(LSE, DELTA, DEXP, bh, offs_m, M)
    ds, weighted = _score_gradient(q, k, v, dy, lse, delta, dexp, offs_m, offs_n, key_real, bh, scale, bias, seed,
                                   M, N, OFFSET, WINDOW, GATE, NOISY, HAS_KEY_REAL, HAS_WINDOW, PRECISION, MASKED)
    dv += tl.dot(tl.trans(weighted.to(dy.dtype)), dy, input_precision=PRECISION)
    dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=VARYING)
def _backward_q_kernel(
        Q, K, V, DY, LSE, DELTA, DEXP, DQ, KEY_REAL,
        sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
        sy_b, sy_h, sy_m, sy_d, sg_b, sg_h, sg_m, sg_d,
        H, GROUPS, M, N, D: tl.constexpr, OFFSET, WINDOW, scale, bias, seed,
        GATE: tl.constexpr, NOISY: tl.constexpr, HAS_KEY_REAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    m_start, bh = tl.program_id(0) * BLOCK_M, tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    kv = (h // GROUPS).to(tl.int64)
    offs_m, offs_d = m_start + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    q = load_rows(Q + b * sq_b + h * sq_h, offs_m, offs_d, sq_m, sq_d, M, D)
    dy = load_rows(DY + b * sy_b + h * sy_h, offs_m, offs_d, sy_m, sy_d, M, D)
    lse, delta, dexp = _row_terms(LSE, DELTA, DEXP, bh, offs_m, M)
    K, V = K + b * sk_b + kv * sk_h, V + b * sv_b + kv * sv_h
    key_real = KEY_REAL + b * N
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # full key tiles without a mask, then those the window's edge, the diagonal or the keys' end
    # crosses, masked
    lo, full_lo, full_hi, hi = key_block_split(m_start, M, N, OFFSET, WINDOW, HAS_WINDOW, BLOCK_M, BLOCK_N)
    for n_start in range(full_lo, full_hi, BLOCK_N):
        dq = _q_tile(q, dy, lse, delta, dexp, K, V, dq, n_start, offs_m, offs_d, key_real, bh, sk_n, sk_d, sv_n,
                     sv_d, scale, bias, seed, M, N, D, OFFSET, WINDOW, GATE, NOISY, HAS_KEY_REAL, HAS_WINDOW,
                     BLOCK_N, PRECISION, False)
    for index in tl.range(0, masked_blocks(lo, full_lo, full_hi, hi, BLOCK_N), num_stages=1):
        n_start = masked_start(index, lo, full_lo, full_hi, BLOCK_N)
        dq = _q_tile(q, dy, lse, delta, dexp, K, V, dq, n_start, offs_m, offs_d, key_real, bh, sk_n, sk_d, sv_n,
                     sv_d, scale, bias, seed, M, N, D, OFFSET, WINDOW, GATE, NOISY, HAS_KEY_REAL, HAS_WINDOW,
                     BLOCK_N, PRECISION, True)
    grad_mask = (offs_m[:, None] < M) & (offs_d[None, :] < D)
    tl.store(DQ + b * sg_b + h * sg_h + offs_m[:, None] * sg_m + offs_d[None, :] * sg_d,
             (dq * scale).to(DQ.dtype.element_ty), mask=grad_mask)


@triton.jit
def _q_tile(q, dy, lse, delta, dexp, K, V, dq, n_start, offs_m, offs_d, key_real, bh, sk_n, sk_d, sv_n, sv_d,
            scale, bias, seed, M, N, D: tl.constexpr, OFFSET, WINDOW, GATE: tl.constexpr, NOISY: tl.constexpr,
            HAS_KEY_REAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
            MASKED: tl.constexpr):
    """One key tile's share of a query block's dq."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    k = load_tile(K, offs_n, offs_d, sk_n, sk_d, N, D, MASKED)
    v = load_tile(V, offs_n, offs_d, sv_n, sv_d, N, D, MASKED)
    ds, _ = _score_gradient(q, k, v, dy, lse, delta, dexp, offs_m, offs_n, key_real, bh, scale, bias, seed,
                            M, N, OFFSET, WINDOW, GATE, NOISY, HAS_KEY_REAL, HAS_WINDOW, PRECISION, MASKED)
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
