"""Tile helpers shared by the fused attention kernels (``forward``, ``received``, ``backward``).

Every kernel sees one (batch, head) and a tile of queries × keys. Queries are the last ``M`` of
``N`` positions (``OFFSET = N - M``: a KV cache holds the earlier ones), so query row ``i``
sits at position ``i + OFFSET``. An edge (i, j) is allowed when key ``j`` is not later than the
query, within the sliding window (``pos - j < WINDOW``, as transformers' masks build it) and a
real (non-padding) token; this is the structure ``layout.layout_of`` verified against the
model's own mask.

Most tiles of a long sequence lie wholly inside that structure. As in FlashAttention, the loops
split their blocks (``key_block_split``, ``query_block_split``) into tiles the diagonal, the
window's edge or the tensor's end crosses, which build the mask edge by edge (``allowed_tile``),
and full tiles, which skip it: there padding keys alone are closed, by a -inf per column
(``full_tile_scores``), and nothing else is per edge. The model of the compiled loops
(benchmarks/gpu/kernel_work.py) found the per-edge mask among the dense kernels' largest costs,
beside ``tl.exp``'s range fix-up (``exp_below``) and the tiles' masked loads (``load_tile``).
"""

import triton
import triton.language as tl


# Integer arguments whose values change from call to call: the gate's noise seed (per layer and
# step), the cached keys before the queries (a decoding step's) and the query and key counts
# (growing while decoding). Triton specialises an int equal to 1 or divisible by 16 by default:
# these would compile the kernel again and again.
VARYING = ["seed", "OFFSET", "M", "N"]

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def exp_below(x, shift):
    """exp(x - shift) of a [rows, columns] tile and a shift per row, as the hardware's base-2
    exponential of one fused multiply-add per element. ``tl.exp`` adds three instructions of range
    fix-up per element on sm_90 (for results below 2^-126, which weights of at most 1 may flush to
    zero); with a shift of +inf (a row that sees nothing) every weight is 0."""
    return tl.math.exp2(x * LOG2E - (shift * LOG2E)[:, None])


@triton.jit
def load_rows(ptr, rows, cols, stride_row, stride_col, n_rows, n_cols):
    """A [rows, cols] tile, zero outside the tensor."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * stride_row + cols[None, :] * stride_col, mask=mask, other=0.0)


@triton.jit
def load_tile(ptr, rows, cols, stride_row, stride_col, n_rows, n_cols: tl.constexpr, MASKED: tl.constexpr):
    """``load_rows`` in a loop over tiles: a full tile's rows all lie inside the tensor, so it
    loads without a row mask, and without a column mask too where the head dimension ``n_cols``
    fills its block (address and predicate work per element that the compiled loops spent)."""
    where = ptr + rows[:, None] * stride_row + cols[None, :] * stride_col
    if MASKED:
        tile = tl.load(where, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
    elif n_cols == cols.shape[0]:
        tile = tl.load(where)
    else:
        tile = tl.load(where, mask=cols[None, :] < n_cols, other=0.0)
    return tile


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
def full_tile_scores(logits, key_real_ptr, offs_n, N, HAS_KEY_REAL: tl.constexpr):
    """(scores, real keys): a full tile's scores with its padding keys at -inf, and how many of
    its keys are real (a scalar). A full tile's only mask: one addition per edge, by a bias per
    column, instead of ``allowed_tile``'s comparisons."""
    if HAS_KEY_REAL:
        real = tl.load(key_real_ptr + offs_n)  # a full tile's keys all lie inside the tensor
        return logits + tl.where(real != 0, 0.0, float("-inf"))[None, :], tl.sum(tl.where(real != 0, 1.0, 0.0), 0)
    return logits, offs_n.shape[0] * 1.0


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
def _round_up(x, block: tl.constexpr):
    """The smallest multiple of ``block`` at or above ``x`` (x ≥ 0: no rounding toward zero)."""
    return (tl.maximum(x, 0) + block - 1) // block * block


@triton.jit
def key_block_split(m_start, M, N, OFFSET, WINDOW, HAS_WINDOW: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(lo, full_lo, full_hi, hi): the key blocks of ``key_blocks`` split for the query block at
    ``m_start`` into [lo, full_lo) (the window's edge crosses them), [full_lo, full_hi) (full:
    every edge of the tile allowed but for padding keys) and [full_hi, hi) (the diagonal or the
    keys' end crosses them). A query block with rows past ``M`` has no full tile."""
    lo, hi = key_blocks(m_start, N, OFFSET, WINDOW, HAS_WINDOW, BLOCK_M, BLOCK_N)
    hi = tl.maximum(hi, lo)
    first, last = m_start + OFFSET, m_start + BLOCK_M - 1 + OFFSET  # the block's query positions
    full_lo = lo
    if HAS_WINDOW:  # every key of the tile within the window of the last query: j > last - WINDOW
        full_lo = tl.minimum(tl.maximum(lo, _round_up(last - WINDOW + 1, BLOCK_N)), hi)
    # every key of the tile at or before the first query, and inside the tensor
    full_hi = tl.maximum(tl.minimum(first + 1, N), 0) // BLOCK_N * BLOCK_N
    full_hi = tl.where(m_start + BLOCK_M <= M, tl.maximum(full_hi, full_lo), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def query_block_split(n_start, M, N, OFFSET, WINDOW, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, STRICT: tl.constexpr):
    """(lo, full_lo, full_hi, hi): the query blocks of ``query_blocks`` split for the key block at
    ``n_start`` into [lo, full_lo) (the diagonal crosses them), [full_lo, full_hi) (full) and
    [full_hi, hi) (the window's edge or the queries' end crosses them). ``STRICT``: a full tile's
    queries lie strictly after its keys (received attention leaves the diagonal out). A key block
    with columns past ``N`` has no full tile."""
    lo, hi = query_blocks(n_start, M, OFFSET, WINDOW, HAS_WINDOW, BLOCK_M, BLOCK_N)
    hi = tl.maximum(hi, lo)  # a key block the window puts out of every query's reach: nothing to visit
    # the tile's first query at or after (strictly after) its last key, n_start + BLOCK_N - 1
    full_lo = tl.minimum(tl.maximum(lo, _round_up(n_start + BLOCK_N - 1 + STRICT - OFFSET, BLOCK_M)), hi)
    end = M  # the tile's rows inside the tensor, and its last query within the window of its first key
    if HAS_WINDOW:
        end = tl.minimum(M, n_start + WINDOW - OFFSET)
    full_hi = tl.maximum(end, 0) // BLOCK_M * BLOCK_M
    full_hi = tl.where(n_start + BLOCK_N <= N, tl.maximum(full_hi, full_lo), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def masked_blocks(lo, full_lo, full_hi, hi, BLOCK: tl.constexpr):
    """How many blocks of a split are masked: those of [lo, full_lo) and of [full_hi, hi). The
    kernels walk them in one loop, unpipelined (``masked_start``), and the full ones in another:
    two copies of a loop body instead of three, and no prefetch for a loop of a block or two
    (the compiled backward kernels spilled registers with three pipelined copies)."""
    return tl.cdiv(full_lo - lo, BLOCK) + tl.cdiv(hi - full_hi, BLOCK)


@triton.jit
def masked_start(index, lo, full_lo, full_hi, BLOCK: tl.constexpr):
    """The start of the ``index``-th masked block: [lo, full_lo)'s, then [full_hi, hi)'s."""
    before = tl.cdiv(full_lo - lo, BLOCK)
    return tl.where(index < before, lo + index * BLOCK, full_hi + (index - before) * BLOCK)


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
