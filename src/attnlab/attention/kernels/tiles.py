"""Tile helpers shared by the fused attention kernels (``forward``, ``received``, ``backward``).

Every kernel sees one (batch, head) and a tile of queries × keys. Queries are the last ``M`` of
``N`` positions (``OFFSET = N - M``: a KV cache holds the earlier ones), so query row ``i``
sits at position ``i + OFFSET``. An edge (i, j) is allowed when key ``j`` is not later than the
query, within the sliding window (``pos - j < WINDOW``, as transformers' masks build it) and a
real (non-padding) token; this is the structure ``layout.layout_of`` verified against the
model's own mask.
"""

import triton
import triton.language as tl


# Integer arguments whose values change from call to call: the gate's noise seed (per layer and
# step), the cached keys before the queries (a decoding step's) and the query and key counts
# (growing while decoding). Triton specialises an int equal to 1 or divisible by 16 by default:
# these would compile the kernel again and again.
VARYING = ["seed", "OFFSET", "M", "N"]


@triton.jit
def load_rows(ptr, rows, cols, stride_row, stride_col, n_rows, n_cols):
    """A [rows, cols] tile, zero outside the tensor."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * stride_row + cols[None, :] * stride_col, mask=mask, other=0.0)


@triton.jit
def allowed_tile(offs_m, offs_n, M, N, OFFSET, WINDOW, key_real_ptr,
                 HAS_KEY_REAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """[BLOCK_M, BLOCK_N] bool: the edges the model's mask lets through."""
    position = offs_m[:, None] + OFFSET
    allowed = (offs_n[None, :] <= position) & (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if HAS_WINDOW:
        allowed = allowed & (position - offs_n[None, :] < WINDOW)
    if HAS_KEY_REAL:
        real = tl.load(key_real_ptr + offs_n, mask=offs_n < N, other=0)
        allowed = allowed & (real[None, :] != 0)
    return allowed


@triton.jit
def logistic_noise(seed, bh, offs_m, offs_n, M, N):
    """Logistic noise of edge (i, j) of head ``bh``: the same draw wherever it is recomputed
    (forward, backward, a checkpointed layer's replay), from Philox counters, not from state.

    One Philox call gives four 32-bit numbers, and the generator's integer work bound the sampled
    kernels (benchmarks/gpu/kernel_work.py): the four edges 4c..4c+3 of a row share counter c and
    each takes one of the four numbers, chosen by j mod 4 alone, so every tile shape (``offs_n``
    starts at a multiple of 4) draws the same number for the same edge."""
    quarter: tl.constexpr = offs_n.shape[0] // 4
    quad = tl.max(tl.reshape(offs_n, (quarter, 4)), 1) // 4  # c of each group of four columns
    counter = (bh.to(tl.int64) * M + offs_m[:, None]) * ((N + 3) // 4) + quad[None, :]
    first, second, third, fourth = tl.randint4x(seed, counter)
    # [rows, quarter, 2, 2] -> [rows, 4 * quarter]: column 4c + 2k + o takes number 2o + k
    bits = tl.reshape(tl.join(tl.join(first, second), tl.join(third, fourth)), (offs_m.shape[0], offs_n.shape[0]))
    uniform = tl.random.uint_to_uniform_float(bits)
    uniform = tl.minimum(tl.maximum(uniform, 1e-6), 1 - 1e-6)
    return tl.log(uniform) - tl.log(1 - uniform)


@triton.jit
def gate_tile(logits, bias, seed, bh, offs_m, offs_n, M, N, GATE: tl.constexpr):
    """(hard gate, gate logit the straight-through surrogate differentiates): GATE 0 dense (every
    edge open), 1 deterministic ``1[s + b > 0]``, 2 sampled ``1[s + b + L > 0]``, L logistic."""
    gate_logit = logits + bias
    if GATE == 2:
        gate_logit = gate_logit + logistic_noise(seed, bh, offs_m, offs_n, M, N)
    if GATE == 0:
        hard = tl.full(logits.shape, 1.0, tl.float32)
    else:
        hard = tl.where(gate_logit > 0, 1.0, 0.0)
    return hard, gate_logit


@triton.jit
def key_blocks(m_start, N, OFFSET, WINDOW, HAS_WINDOW: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi): the keys any query of the block [m_start, m_start + BLOCK_M) may see."""
    hi = tl.minimum(N, m_start + BLOCK_M + OFFSET)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, m_start + OFFSET - WINDOW + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    return lo, hi


@triton.jit
def query_blocks(n_start, M, OFFSET, WINDOW, HAS_WINDOW: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi): the queries that may see some key of the block [n_start, n_start + BLOCK_N)."""
    lo = tl.maximum(0, n_start - OFFSET)
    lo = (lo // BLOCK_M) * BLOCK_M
    hi = M
    if HAS_WINDOW:
        hi = tl.minimum(M, n_start + BLOCK_N - 1 + WINDOW - OFFSET)
    return lo, hi
