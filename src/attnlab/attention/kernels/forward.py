"""Forward kernel: ``y_i = Σ_j softmax(s)_ij · g_ij · v_j`` in one pass over the keys.

The softmax is over every allowed key and is not renormalised after gating (docs/sparsify.md), so
the online rescaling of flash attention carries two sums under one running maximum: the ungated
normaliser ``l_i = Σ_j exp(s_ij - m_i)`` and the gated numerator ``Σ_j exp(s_ij - m_i) g_ij v_j``.
With every gate open (GATE 0) it is flash attention. Per query row the same pass also gives the
log-sum-exp (for the backward pass and the received-attention pass), the gated mass
``Σ_j p_ij g_ij`` and the mass on inserted keys (λ), the expected density ``Σ_j σ(s_ij + b)``
and the open and allowed edge counts. Nothing of size queries × keys is ever stored.

As in FlashAttention, the keys of a query block run in two loops (``tiles.key_block_split``):
full tiles, with no mask but a -inf on padding keys, then the tiles the diagonal, the window's
edge or the keys' end crosses, which build the mask edge by edge. Weights are base-2 exponentials
of one fused multiply-add (``tiles.exp_below``). Under inference gates a tile whose gates are all
closed skips its product with V.
"""

import triton
import triton.language as tl

from attnlab.attention.kernels.tiles import (LOG2E, VARYING, allowed_tile, exp_below, full_tile_scores, gate_tile,
                                             key_block_split, load_rows, load_tile, masked_blocks,
                                             masked_start)

# Per-row statistics, in this order along the first axis of the kernel's ``stats`` output.
ROW_STATS = ("gated_mass", "inserted_mass", "expected", "opened", "allowed")


@triton.jit(do_not_specialize=VARYING)
def _forward_kernel(
        Q, K, V, O, LSE, STATS, KEY_REAL, INSERTED,
        sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
        so_b, so_h, so_m, so_d,
        B, H, GROUPS, M, N, D: tl.constexpr, OFFSET, WINDOW, scale, bias, seed,
        GATE: tl.constexpr, HAS_KEY_REAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
        HAS_INSERTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    m_start, bh = tl.program_id(0) * BLOCK_M, tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    kv = (h // GROUPS).to(tl.int64)
    offs_m, offs_d = m_start + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    q = load_rows(Q + b * sq_b + h * sq_h, offs_m, offs_d, sq_m, sq_d, M, D)
    K, V = K + b * sk_b + kv * sk_h, V + b * sv_b + kv * sv_h
    key_real, inserted_keys = KEY_REAL + b * N, INSERTED + b * N
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    normaliser = tl.zeros([BLOCK_M], tl.float32)
    gated, inserted = tl.zeros([BLOCK_M], tl.float32), tl.zeros([BLOCK_M], tl.float32)
    expected, opened, allowed_n = (tl.zeros([BLOCK_M], tl.float32), tl.zeros([BLOCK_M], tl.float32),
                                   tl.zeros([BLOCK_M], tl.float32))
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, full_lo, full_hi, hi = key_block_split(m_start, M, N, OFFSET, WINDOW, HAS_WINDOW, BLOCK_M, BLOCK_N)
    # as FlashAttention's: full tiles without a mask, then the tiles the window's edge, the diagonal
    # or the keys' end crosses, masked; the same body, its mask a constant of each loop
    for n_start in range(full_lo, full_hi, BLOCK_N):
        running_max, normaliser, gated, inserted, expected, opened, allowed_n, acc = _forward_tile(
            q, K, V, key_real, inserted_keys, n_start, offs_m, offs_d, sk_n, sk_d, sv_n, sv_d, M, N, D, OFFSET,
            WINDOW, scale, bias, seed, bh, running_max, normaliser, gated, inserted, expected, opened,
            allowed_n, acc, GATE, HAS_KEY_REAL, HAS_WINDOW, HAS_INSERTED, BLOCK_N, PRECISION, False)
    for index in tl.range(0, masked_blocks(lo, full_lo, full_hi, hi, BLOCK_N), num_stages=1):
        n_start = masked_start(index, lo, full_lo, full_hi, BLOCK_N)
        running_max, normaliser, gated, inserted, expected, opened, allowed_n, acc = _forward_tile(
            q, K, V, key_real, inserted_keys, n_start, offs_m, offs_d, sk_n, sk_d, sv_n, sv_d, M, N, D, OFFSET,
            WINDOW, scale, bias, seed, bh, running_max, normaliser, gated, inserted, expected, opened,
            allowed_n, acc, GATE, HAS_KEY_REAL, HAS_WINDOW, HAS_INSERTED, BLOCK_N, PRECISION, True)
    _store_rows(O + b * so_b + h * so_h, LSE, STATS, acc, running_max, normaliser, gated, inserted,
                expected, opened, allowed_n, bh, offs_m, offs_d, so_m, so_d, B, H, M, D, GATE)


@triton.jit
def _forward_tile(q, K, V, key_real, inserted_keys, n_start, offs_m, offs_d, sk_n, sk_d, sv_n, sv_d, M, N,
                  D: tl.constexpr, OFFSET, WINDOW, scale, bias, seed, bh, running_max, normaliser, gated, inserted, expected, opened,
                  allowed_n, acc, GATE: tl.constexpr, HAS_KEY_REAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  HAS_INSERTED: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                  MASKED: tl.constexpr):
    """One key tile of the online softmax. Scores are -inf on every edge the mask closes (built
    edge by edge where ``MASKED``, by padding keys alone in a full tile), so the exponential, the
    gate (closed at -inf) and the density term need no mask of their own."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    k = load_tile(K, offs_n, offs_d, sk_n, sk_d, N, D, MASKED)
    v = load_tile(V, offs_n, offs_d, sv_n, sv_d, N, D, MASKED)
    logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if MASKED:
        allowed = allowed_tile(offs_m, offs_n, M, N, OFFSET, WINDOW, key_real, HAS_KEY_REAL, HAS_WINDOW)
        scores = tl.where(allowed, logits, float("-inf"))
        allowed_n += tl.sum(tl.where(allowed, 1.0, 0.0), 1)
    else:
        scores, real_keys = full_tile_scores(logits, key_real, offs_n, N, HAS_KEY_REAL)
        allowed_n += real_keys
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with nothing allowed yet
    alpha = tl.math.exp2((running_max - safe_max) * LOG2E)
    p = exp_below(scores, safe_max)
    normaliser = normaliser * alpha + tl.sum(p, 1)
    acc, gated, inserted = acc * alpha[:, None], gated * alpha, inserted * alpha
    hard, _ = gate_tile(scores, bias, seed, bh, offs_m, offs_n, M, N, GATE)
    weighted = p * hard
    if GATE > 0:
        tile_open = tl.sum(hard, 1)
        opened += tile_open
    if GATE == 2:  # the density penalty's terms, for training only
        expected += tl.sum(tl.sigmoid(scores + bias), 1)
    if GATE == 1:
        if tl.max(tile_open, 0) > 0:  # inference gates: a tile whose gates are all closed adds nothing
            acc, gated, inserted = _add_gated(weighted, v, acc, gated, inserted, inserted_keys, offs_n, N,
                                              GATE, HAS_INSERTED, PRECISION)
    else:
        acc, gated, inserted = _add_gated(weighted, v, acc, gated, inserted, inserted_keys, offs_n, N, GATE,
                                          HAS_INSERTED, PRECISION)
    return new_max, normaliser, gated, inserted, expected, opened, allowed_n, acc


@triton.jit
def _add_gated(weighted, v, acc, gated, inserted, inserted_keys, offs_n, N, GATE: tl.constexpr,
               HAS_INSERTED: tl.constexpr, PRECISION: tl.constexpr):
    """The tile's gated weights into the output, the gated mass and the mass on inserted keys."""
    acc += tl.dot(weighted.to(v.dtype), v, input_precision=PRECISION)
    if GATE > 0:  # with every gate open the gated mass is the normaliser: _store_rows takes it
        gated += tl.sum(weighted, 1)
    if HAS_INSERTED:  # a weight times a 0/1 flag per column: one fused multiply-add per edge in the sum
        flag = tl.load(inserted_keys + offs_n, mask=offs_n < N, other=0).to(tl.float32)
        inserted += tl.sum(weighted * flag[None, :], 1)
    return acc, gated, inserted


@triton.jit
def _store_rows(O, LSE, STATS, acc, running_max, normaliser, gated, inserted, expected, opened,
                allowed_n, bh, offs_m, offs_d, so_m, so_d, B, H, M, D, GATE: tl.constexpr):
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
    if GATE == 0:
        gated = normaliser
    tl.store(STATS + row, gated * inverse, mask=rows)
    tl.store(STATS + plane + row, inserted * inverse, mask=rows)
    tl.store(STATS + 2 * plane + row, expected, mask=rows)
    tl.store(STATS + 3 * plane + row, opened, mask=rows)
    tl.store(STATS + 4 * plane + row, allowed_n, mask=rows)
