"""Which tiles the fused kernels mask (attnlab.attention.kernels.tiles): the split of each loop into
tiles that build the mask edge by edge and full tiles that skip it, against a brute-force count of
every tile's allowed edges written here. A full tile must have every edge allowed (but for padding
keys, closed by a bias per column); every tile with every edge allowed must run as full (the mask
is built only where needed); and the full loop and the masked loop together must visit the same
blocks as the single loop they replace, each once.

In Triton's interpreter (TRITON_INTERPRET=1, conftest.py); the kernels' values on such tiles are
checked against the eager formula in test_kernel_compiles.py and test_kernels.py."""

import itertools

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton import jit  # noqa: E402

from attnlab.attention.kernels.tiles import (key_block_split, masked_blocks, masked_start,  # noqa: E402
                                            query_block_split)


SLOTS = 40  # per outer block: lo, full_lo, full_hi, hi, then the masked loop's block starts (-1 after)


@jit
def _write_split(OUT, block, lo, full_lo, full_hi, hi, BLOCK: tl.constexpr):
    """The split as the kernels' loops use it: its bounds, and each start the masked loop visits."""
    for k, value in enumerate((lo, full_lo, full_hi, hi)):
        tl.store(OUT + block * SLOTS + k, value)
    for index in range(0, masked_blocks(lo, full_lo, full_hi, hi, BLOCK)):
        tl.store(OUT + block * SLOTS + 4 + index, masked_start(index, lo, full_lo, full_hi, BLOCK))


@jit
def _key_splits(OUT, M, N, OFFSET, WINDOW, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    block = tl.program_id(0)
    lo, full_lo, full_hi, hi = key_block_split(block * BLOCK_M, M, N, OFFSET, WINDOW, HAS_WINDOW, BLOCK_M, BLOCK_N)
    _write_split(OUT, block, lo, full_lo, full_hi, hi, BLOCK_N)


@jit
def _query_splits(OUT, M, N, OFFSET, WINDOW, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, STRICT: tl.constexpr):
    block = tl.program_id(0)
    lo, full_lo, full_hi, hi = query_block_split(block * BLOCK_N, M, N, OFFSET, WINDOW, HAS_WINDOW, BLOCK_M, BLOCK_N,
                                                 STRICT)
    _write_split(OUT, block, lo, full_lo, full_hi, hi, BLOCK_M)


def _allowed(queries, keys, offset, window, strict=False):
    """[M, N] bool, edge by edge: key j seen by the query at position i + offset."""
    position = np.arange(queries)[:, None] + offset
    key = np.arange(keys)[None, :]
    allowed = key < position if strict else key <= position
    if window is not None:
        allowed &= position - key < window
    return allowed


def _tile(allowed, m_start, n_start, block_m, block_n):
    """The tile's allowed edges, padded with closed ones past the tensor's ends (as the kernels' tiles)."""
    tile = np.zeros((block_m, block_n), bool)
    part = allowed[m_start:m_start + block_m, n_start:n_start + block_n]
    tile[:part.shape[0], :part.shape[1]] = part
    return tile


def _check_split(split, starts, blocks_of, tile_of, outer):
    lo, full_lo, full_hi, hi = (int(x) for x in split[:4])
    masked = [int(x) for x in split[4:] if x >= 0]
    # the full loop and the masked one together visit range(lo, hi) once each, as the single loop did
    visited = [*range(full_lo, full_hi, blocks_of), *masked]
    assert sorted(visited) == list(range(lo, hi, blocks_of)), (outer, split[:4].tolist(), masked)
    for start in starts:
        tile = tile_of(start)
        if tile.any():
            assert start in visited, (outer, start, split[:4].tolist())  # no allowed edge is skipped
        assert (start in range(full_lo, full_hi, blocks_of)) == bool(tile.all()), (outer, start, split[:4].tolist())


CASES = [  # (queries, keys, window): a prefill, one with a cache (fewer queries than keys), a decoding step
    (70, 70, None), (70, 70, 7), (200, 200, 130), (150, 150, 40), (37, 101, None), (37, 101, 50), (1, 90, None),
    (1, 90, 33), (130, 130, 64),
    # offsets that are no multiple of a tile: a tile's first query can sit on its last key
    (37, 100, None), (40, 100, 50), (20, 83, None)]
TILES = [(16, 16), (32, 16), (32, 32), (64, 16), (64, 32), (64, 64)]


@pytest.mark.parametrize("queries,keys,window", CASES)
def test_the_loops_mask_exactly_the_tiles_an_edge_of_which_is_closed(queries, keys, window):
    offset = keys - queries
    for (block_m, block_n), strict in itertools.product(TILES, (0, 1)):
        allowed = _allowed(queries, keys, offset, window, strict=bool(strict))
        key_starts, query_starts = range(0, keys, block_n), range(0, queries, block_m)
        args = (queries, keys, offset, window or 0)
        if not strict:  # key loops (forward, backward_q): the diagonal is kept
            splits = torch.full((len(query_starts), SLOTS), -1, dtype=torch.int32)
            _key_splits[(len(query_starts),)](splits, *args, HAS_WINDOW=window is not None, BLOCK_M=block_m,
                                              BLOCK_N=block_n)
            for m_start, split in zip(query_starts, splits):
                _check_split(split, key_starts, block_n,
                             lambda n_start: _tile(allowed, m_start, n_start, block_m, block_n), ("keys", m_start))
        splits = torch.full((len(key_starts), SLOTS), -1, dtype=torch.int32)
        _query_splits[(len(key_starts),)](splits, *args, HAS_WINDOW=window is not None, BLOCK_M=block_m,
                                          BLOCK_N=block_n, STRICT=strict)
        for n_start, split in zip(key_starts, splits):
            _check_split(split, query_starts, block_m,
                         lambda m_start: _tile(allowed, m_start, n_start, block_m, block_n), ("queries", n_start))


def test_the_cases_hold_full_tiles_and_tiles_the_window_and_diagonal_cross():
    """The cases above are not vacuous: on 64 x 32 tiles the 200-token case with a window has full
    tiles, tiles the window's edge crosses and tiles the diagonal crosses in one query block."""
    allowed = _allowed(200, 200, 0, 130)
    kinds = {("full" if t.all() else "crossed" if t.any() else "empty")
             for t in (_tile(allowed, 128, n, 64, 32) for n in range(0, 200, 32))}
    assert kinds == {"full", "crossed", "empty"}


def test_tiles_whose_inference_gates_are_all_closed_are_skipped_exactly():
    """A deterministic gate at bias -3 leaves most 16 × 16 tiles with every gate closed (the
    forward skips their product with V, received attention their exponentials) and some with an
    open one: values, statistics, received attention and gradients still equal the eager formula."""
    from attnlab.attention.kernels import launch
    from attnlab.attention.kernels.layout import allowed_by
    from test_kernels import _compare_with_eager, _hard, _inputs, _padded_layout

    gate = launch.Gate(launch.DETERMINISTIC, -3.0)
    shape = dict(batch=2, heads=2, kv_heads=1, length=54)
    q, k, _ = _inputs(**shape)
    layout = _padded_layout(2, 54, None, (5, 24))
    hard = _hard(q, k, gate, None) * allowed_by(layout, 2, 54, 54, "cpu")
    tiles = hard.reshape(2, 2, 54, 54)[..., :48, :48].reshape(2, 2, 3, 16, 3, 16).amax((3, 5))
    visited = torch.ones(3, 3).tril().bool()  # the causal loops' tiles of the first 48 positions
    assert (tiles[..., visited] == 0).any() and (tiles[..., visited] == 1).any()
    _compare_with_eager("deterministic", None, pads=(5, 24), gate=gate, **shape)


def test_a_head_dimension_short_of_its_block_loads_no_column_past_it():
    """Head dimension 24 runs in 32-wide blocks: full tiles load without a row mask but keep the
    column mask. Here queries, keys and values are views of rows 32 wide whose last 8 numbers are
    NaN (as a fused projection's slices sit in memory): a load past column 24 would bring them in,
    and NaN · 0 is NaN (values, statistics and gradients against the eager formula, over full
    tiles: 54 positions on 16 × 16)."""
    from test_kernels import _compare_with_eager, _inputs

    for gate_name, window in (("sampled", 40), ("deterministic", None)):
        wide = _inputs(batch=2, heads=2, kv_heads=1, length=54, head_dim=32)
        with torch.no_grad():
            for x in wide:
                x[..., 24:] = float("nan")
        inputs = [x[..., :24] for x in wide]
        _compare_with_eager(gate_name, window, pads=(5, 24), inputs=inputs)


def test_received_attention_leaves_out_right_padding_rows_in_full_tiles():
    """A right-padded row (a padding token after real ones) attends to the real keys before it:
    its weights are finite, and received attention must leave the row out in full tiles as in
    masked ones (against the eager weights summed over real, strictly later rows)."""
    from attnlab.attention.kernels import launch
    from attnlab.attention.kernels.layout import MaskLayout, allowed_by
    from test_kernels import SCALE, _eager, _inputs

    q, k, v = (x.detach() for x in _inputs(batch=1, heads=2, kv_heads=1, length=54))
    key_real = torch.arange(54)[None, :] < 30  # rows and keys 30-53 pad the right end
    layout, gate = MaskLayout(key_real, 0, None), launch.Gate(launch.DETERMINISTIC, 0.3)
    _, _, lse, _ = launch.attention(q, k, v, layout, gate, SCALE)
    columns = launch.received_columns(q, k, lse, layout, gate, SCALE)
    _, _, weights = _eager(q, k, v, allowed_by(layout, 1, 54, 54, "cpu"), gate)
    later = torch.ones(54, 54).tril(-1).bool()
    torch.testing.assert_close(columns, (weights * later * key_real[:, None, :, None]).sum(-2), atol=1e-5, rtol=0)
    assert weights[0, :, 40, :30].sum() > 0  # the padding rows do weigh real keys
