"""Forward kernel: ``y_i = Σ_j softmax(s)_ij · g_ij · v_j`` in one pass over the keys.

The softmax is over every allowed key and is not renormalised after gating (docs/sparsify.md), so
the online rescaling of flash attention carries two sums under one running maximum: the ungated
normaliser ``l_i = Σ_j exp(s_ij - m_i)`` and the gated numerator ``Σ_j exp(s_ij - m_i) g_ij v_j``.
With every gate open (GATE 0) it is flash attention. Per query row the same pass also gives the
log-sum-exp (for the backward pass and the received-attention pass), the gated mass
``Σ_j p_ij g_ij`` and the mass on inserted keys (λ), the expected density ``Σ_j σ(s_ij + b)``
and the open and allowed edge counts. Nothing of size queries × keys is ever stored.
"""

import triton
import triton.language as tl

from attnlab.attention.kernels.tiles import VARYING, allowed_tile, gate_tile, key_blocks, load_rows

# Per-row statistics, in this order along the first axis of the kernel's ``stats`` output.
ROW_STATS = ("gated_mass", "inserted_mass", "expected", "opened", "allowed")


@triton.jit
def _rescaled(old, alpha, added):
    return old * alpha + added


@triton.jit(do_not_specialize=VARYING)
def _forward_kernel(
        Q, K, V, O, LSE, STATS, KEY_REAL, INSERTED,
        sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
        so_b, so_h, so_m, so_d,
        B, H, GROUPS, M, N, D, OFFSET, WINDOW, scale, bias, seed,
        GATE: tl.constexpr, HAS_KEY_REAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
        HAS_INSERTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    m_start, bh = tl.program_id(0) * BLOCK_M, tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    kv = (h // GROUPS).to(tl.int64)
    offs_m, offs_d = m_start + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    q = load_rows(Q + b * sq_b + h * sq_h, offs_m, offs_d, sq_m, sq_d, M, D)
    K, V = K + b * sk_b + kv * sk_h, V + b * sv_b + kv * sv_h
    key_real = KEY_REAL + b * N
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    normaliser = tl.zeros([BLOCK_M], tl.float32)
    gated, inserted = tl.zeros([BLOCK_M], tl.float32), tl.zeros([BLOCK_M], tl.float32)
    expected, opened, allowed_n = (tl.zeros([BLOCK_M], tl.float32), tl.zeros([BLOCK_M], tl.float32),
                                   tl.zeros([BLOCK_M], tl.float32))
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = key_blocks(m_start, N, OFFSET, WINDOW, HAS_WINDOW, BLOCK_M, BLOCK_N)
    for n_start in range(lo, hi, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        k = load_rows(K, offs_n, offs_d, sk_n, sk_d, N, D)
        v = load_rows(V, offs_n, offs_d, sv_n, sv_d, N, D)
        logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        allowed = allowed_tile(offs_m, offs_n, M, N, OFFSET, WINDOW, key_real, HAS_KEY_REAL, HAS_WINDOW)
        masked = tl.where(allowed, logits, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(masked, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with nothing allowed yet
        alpha = tl.exp(running_max - safe_max)
        p = tl.exp(masked - safe_max[:, None])
        hard, gate_logit = gate_tile(logits, bias, seed, bh, offs_m, offs_n, M, N, GATE)
        weighted = p * hard
        normaliser = _rescaled(normaliser, alpha, tl.sum(p, 1))
        gated = _rescaled(gated, alpha, tl.sum(weighted, 1))
        acc = acc * alpha[:, None] + tl.dot(weighted.to(v.dtype), v, input_precision=PRECISION)
        if HAS_INSERTED:
            flag = tl.load(INSERTED + b * N + offs_n, mask=offs_n < N, other=0)
            inserted = _rescaled(inserted, alpha, tl.sum(tl.where(flag[None, :] != 0, weighted, 0.0), 1))
        if GATE == 2:  # the density penalty's terms, for training only
            expected += tl.sum(tl.where(allowed, tl.sigmoid(logits + bias), 0.0), 1)
        if GATE > 0:
            opened += tl.sum(tl.where(allowed & (hard > 0), 1.0, 0.0), 1)
        allowed_n += tl.sum(tl.where(allowed, 1.0, 0.0), 1)
        running_max = new_max
    _store_rows(O + b * so_b + h * so_h, LSE, STATS, acc, running_max, normaliser, gated, inserted,
                expected, opened, allowed_n, bh, offs_m, offs_d, so_m, so_d, B, H, M, D)


@triton.jit
def _store_rows(O, LSE, STATS, acc, running_max, normaliser, gated, inserted, expected, opened,
                allowed_n, bh, offs_m, offs_d, so_m, so_d, B, H, M, D):
    """Normalise by the ungated sum and write the output rows, their log-sum-exp and statistics;
    a row with no allowed key (left padding) gets zeros and a log-sum-exp of -inf."""
    empty = normaliser == 0
    inverse = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, normaliser))
    out = acc * inverse[:, None]
    rows = offs_m < M
    o_mask = rows[:, None] & (offs_d[None, :] < D)
    tl.store(O + offs_m[:, None] * so_m + offs_d[None, :] * so_d, out.to(O.dtype.element_ty), mask=o_mask)
    safe_max = tl.where(running_max == float("-inf"), 0.0, running_max)
    lse = tl.where(empty, float("-inf"), safe_max + tl.log(tl.where(empty, 1.0, normaliser)))
    row = bh.to(tl.int64) * M + offs_m
    plane = B * H * M
    tl.store(LSE + row, lse, mask=rows)
    tl.store(STATS + row, gated * inverse, mask=rows)
    tl.store(STATS + plane + row, inserted * inverse, mask=rows)
    tl.store(STATS + 2 * plane + row, expected, mask=rows)
    tl.store(STATS + 3 * plane + row, opened, mask=rows)
    tl.store(STATS + 4 * plane + row, allowed_n, mask=rows)
