"""The fused kernels compiled ahead of time for GPUs this machine does not have (sm_90, sm_80):
with the dtypes the models really hand them, and without spilled registers where the launcher's
tiles promise none (attnlab.attention.kernels.compiled; the full table: benchmarks/gpu/kernel_resources.py);
and every tile shape those tables pick run in the interpreter against the eager formula.

Under bfloat16 autocast Llama's rotary embedding returns float32 queries and keys beside bfloat16
values: the kernels' dot products take one dtype, so a layer compiled with the three as they come
fails to compile on a GPU. The interpreter tests cannot see this (they pass one dtype)."""

import functools
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from attnlab.attention import fused  # noqa: E402
from attnlab.attention.kernels import compiled, launch  # noqa: E402
from test_attention import TINY  # noqa: E402


def _dtypes_under_autocast(arch: str) -> set[tuple]:
    """(query, key, value dtypes, the dtype ``fused.kernel_dtype`` gives them) of every call of the
    attention function in bfloat16 CPU autocast forwards of a tiny model of ``arch``'s family,
    without and with a KV cache."""
    seen = set()
    original = fused.attend

    def record(module, query, key, value, *args, **kwargs):
        seen.add((query.dtype, key.dtype, value.dtype, fused.kernel_dtype(query, key, value)))
        return None  # the eager blocks compute the layer

    model = TINY[arch]()
    fused.attend = record
    try:
        from attnlab.attention import sparse

        sparse.make_sparse(model, 0.0)  # the gated attention: every layer goes through attend
        for use_cache in (False, True):  # training's forward, and generation's (the cache casts values)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                model(torch.randint(3, 101, (2, 9)), use_cache=use_cache)
    finally:
        fused.attend = original
    return seen


@functools.cache
def _compiles(kernel: str, dtypes: tuple) -> bool:
    """Whether ``kernel`` (sampled gates: training) compiles for sm_90 with tensors of ``dtypes``:
    queries, keys and their gradients in the first, values in the second, the output and its
    gradient in the query's (as the autograd function gives them)."""
    query, value = dtypes
    tensor_dtypes = dict(Q=query, K=query, O=query, DY=query, DQ=query, DK=query, V=value, DV=value)
    asked = compiled.request(compiled.Variant(kernel, "sampled", False, 64, query), 90, tensor_dtypes)
    return "error" not in compiled.compile_elsewhere([asked])[0]


@pytest.mark.slow  # compiles for sm_90 in another interpreter: 3-9 s a family
@pytest.mark.parametrize("arch", list(TINY))
def test_what_each_family_hands_the_kernels_under_autocast_compiles_once_unified(arch):
    seen = _dtypes_under_autocast(arch)
    assert seen and {unified for *_, unified in seen} == {torch.bfloat16}
    for query, key, value, unified in seen:
        assert query == key  # rotary embeddings or none: queries and keys alike
        for kernel in ("forward", "backward_kv", "backward_q"):
            assert _compiles(kernel, (unified, unified)), (arch, kernel)


@pytest.mark.slow  # compiles for sm_90 in another interpreter
def test_the_mixed_dtypes_llama_passes_would_not_compile_unless_unified():
    """What the kernels got before ``fused.kernel_dtype``: float32 queries, bfloat16 values."""
    assert (torch.float32, torch.float32, torch.bfloat16, torch.bfloat16) in _dtypes_under_autocast("llama-gqa")
    assert not _compiles("backward_q", (torch.float32, torch.bfloat16))


REPRESENTATIVE = [compiled.Variant("forward", "dense", False, 64, torch.bfloat16),
                  compiled.Variant("forward", "sampled", True, 128, torch.float16),
                  compiled.Variant("backward_kv", "sampled", False, 64, torch.bfloat16),
                  compiled.Variant("backward_q", "sampled", True, 128, torch.bfloat16),
                  compiled.Variant("received", "deterministic", False, 128, torch.bfloat16),
                  compiled.Variant("forward", "deterministic", True, 256, torch.bfloat16)]


@functools.cache
def _representative_reports() -> dict:
    """The representative set compiled for sm_90 and sm_80, in one other interpreter."""
    asked = [(variant, arch) for variant in REPRESENTATIVE for arch in (90, 80)]
    answers = compiled.compile_elsewhere([compiled.request(variant, arch) for variant, arch in asked])
    return dict(zip(asked, answers))


@pytest.mark.slow  # the representative set compiled for sm_90 and sm_80: about 20 s
@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("variant", REPRESENTATIVE, ids=lambda variant: variant.name)
def test_a_representative_set_compiles_without_spills_in_16_bits(variant, arch):
    """No spilled register at any head dimension (Gemma-3's 256 included), training kernels
    included; wgmma on sm_90 wherever the tile has the 64 rows a warpgroup's instruction takes
    (mma elsewhere)."""
    report = _representative_reports()[(variant, arch)]
    assert "error" not in report, report
    assert report["spill_store_bytes"] == 0 and report["stack_bytes"] == 0, report
    block_m = compiled.constants(variant, arch)[0]["BLOCK_M"]
    assert report["mma"] == ("wgmma" if arch == 90 and block_m >= 64 else "mma"), report


def test_a_compile_is_specialised_as_the_launch_it_stands_for_would_be():
    """``compiled`` compiles from the launcher's own arguments, with Triton's specialisation: a
    head dimension's stride of 1 a constant, pointers and sizes divisible by 16 marked so, the
    head dimension a constant of the kernel; the per-call integers never, though here divisible
    by 16 (they would compile again per call)."""
    from attnlab.attention.kernels.tiles import VARYING

    call = compiled.representative_launch(compiled.Variant("forward", "sampled", False, 64, torch.bfloat16), 90)
    signature, constexprs, attrs, options = compiled.specialised(call)
    index = {name: (position,) for position, name in enumerate(call.kernel.arg_names)}
    assert signature["sq_d"] == signature["sv_d"] == "constexpr" and constexprs[index["sq_d"]] == 1
    assert signature["D"] == "constexpr" and constexprs[index["D"]] == 64
    assert signature["Q"] == "*bf16" and attrs[index["Q"]] == [["tt.divisibility", 16]]
    assert attrs[index["sq_m"]] == [["tt.divisibility", 16]] and attrs[index["H"]] == []  # 576; 9 heads
    for name in VARYING:
        assert signature[name] == "i32" and index[name] not in attrs, name
    assert {call.args[call.kernel.arg_names.index(name)] for name in ("M", "N")} == {compiled.TOKENS}
    assert options == {"num_warps": 4, "num_stages": 2}


def test_launch_parameters_that_would_recompile_or_waste_rows():
    """The per-call integers are not specialised on (a new seed per layer and step, a growing
    decode); a one-row decoding query runs on a 16-row block, not a 64-row one."""
    import ast

    from attnlab.attention.kernels import launch, tiles

    assert sorted(tiles.VARYING) == ["M", "N", "OFFSET", "seed"]
    # the decorators as written (the interpreter's functions here do not keep the option)
    for module in ("forward", "backward", "received"):
        source = (Path(launch.__file__).parent / f"{module}.py").read_text()
        decorators = [ast.unparse(d) for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)
                      and node.name.endswith("_kernel") for d in node.decorator_list]
        assert decorators and all("do_not_specialize=VARYING" in d for d in decorators), (module, decorators)
    cuda = torch.device("cuda")
    assert launch.blocks(64, cuda, torch.bfloat16, "forward", queries=1, arch=90)[0] == 16
    assert launch.blocks(64, cuda, torch.bfloat16, "forward", queries=512, arch=90)[0] == 64


def test_triton_3_6_takes_its_own_tiles(monkeypatch):
    """The GPU machines' Triton 3.6 spills with 3.7.1's tiles: before 3.7 the launcher reads the
    target's ``TRITON36_TILES`` where they have an entry; 3.7 and later keep ``TILES`` (and
    ``SM80_TILES`` on sm_80). (The 3.6 tables' resource report: benchmarks/gpu/kernel_resources.py
    under 3.6.)"""
    from attnlab.attention.kernels import launch

    cuda = torch.device("cuda")

    def tile(kernel, head_dim, arch):
        block_m, block_n, _, options = launch.blocks(head_dim, cuda, torch.bfloat16, kernel, arch=arch)
        return block_m, block_n, options["num_warps"], options["num_stages"]

    monkeypatch.setattr(launch, "TRITON_VERSION", (3, 6))
    assert tile("backward_kv", 128, 90) == (32, 32, 8, 2) != launch.TILES[("backward_kv", "16bit")][128]
    assert tile("forward", 64, 90) == (64, 16, 4, 2) != launch.TILES[("forward", "16bit")][64]
    assert tile("backward_kv", 64, 80) == (32, 32, 4, 2) != launch.SM80_TILES[("backward_kv", "16bit")][64]
    assert tile("received", 64, 80) == launch.SM80_TILES[("received", "16bit")][64]  # no 3.6 entry on sm_80
    monkeypatch.setattr(launch, "TRITON_VERSION", (3, 7))
    assert tile("backward_kv", 128, 90) == launch.TILES[("backward_kv", "16bit")][128]
    assert tile("backward_kv", 64, 80) == launch.SM80_TILES[("backward_kv", "16bit")][64] == (64, 32, 8, 2)


REPORT_36 = Path(__file__).resolve().parents[1] / "benchmarks/results/kernel_resources_triton36_2026-12-05.json"
# The variants the 3.6 report finds spilling, with their spilled bytes (stores = loads; 8 of stack
# each): none since 2026-12-05 (before: the deterministic forward at head dimension 256 on sm_90).
SPILLING_UNDER_36: dict[tuple[str, str], int] = {}


def _report_36() -> list[dict]:
    import json

    rows = json.loads(REPORT_36.read_text())
    assert len(rows) == 216 and {row["triton"] for row in rows} == {"3.6.0"}
    return rows


def test_every_triton_3_6_tile_is_the_one_its_resource_report_measured_without_spills():
    """Each entry of ``TRITON36_TILES`` (target × kernel × head-dimension bound) against the
    committed 3.6 report: every variant measured there (gates, windows, bf16 and fp16) ran on that
    tile (BLOCK_M, BLOCK_N, warps, stages) and spilled nothing, but for the variants named in
    ``SPILLING_UNDER_36``, which spill exactly the bytes named there; no other row spills."""
    rows = _report_36()
    for arch, table in launch.TRITON36_TILES.items():
        for (kernel, kind), by_bound in table.items():
            assert kind == "16bit"
            for bound, tile in by_bound.items():
                measured = [row for row in rows if row["arch"] == f"sm_{arch}"
                            and row["variant"].startswith(f"{kernel}/") and f"/d{bound}/" in row["variant"]]
                assert len(measured) == (12 if kernel == "forward" else 8), (arch, kernel, bound)  # 3 or 2 gates
                for row in measured:
                    assert (row["block_m"], row["block_n"], row["num_warps"], row["num_stages"]) == tile, \
                        (row["variant"], row["arch"], tile)
    for row in rows:
        allowed = SPILLING_UNDER_36.get((row["variant"], row["arch"]), 0)
        assert (row["spill_store_bytes"], row["spill_load_bytes"]) == (allowed, allowed), (row["variant"], row["arch"])
        assert row["stack_bytes"] == (8 if allowed else 0), (row["variant"], row["arch"])


def test_under_triton_3_6_the_launcher_picks_the_tile_of_every_variant_in_its_report(monkeypatch):
    """Every row of the 3.6 report (all four kernels, the received one on sm_80 from ``SM80_TILES``, both
    targets and 16-bit dtypes): ``launch.blocks`` under Triton 3.6 gives its measured tile."""
    monkeypatch.setattr(launch, "TRITON_VERSION", (3, 6))
    dtypes, cuda = {"bf16": torch.bfloat16, "fp16": torch.float16}, torch.device("cuda")
    for row in _report_36():
        kernel, *_, dim, dtype = row["variant"].split("/")
        block_m, block_n, _, options = launch.blocks(int(dim[1:]), cuda, dtypes[dtype], kernel,
                                                     arch=int(row["arch"][3:]), sampled="/sampled/" in row["variant"])
        assert (block_m, block_n, options["num_warps"], options["num_stages"]) == (
            row["block_m"], row["block_n"], row["num_warps"], row["num_stages"]), (row["variant"], row["arch"])


REPORT_37 = Path(__file__).resolve().parents[1] / "benchmarks/results/kernel_resources_2026-12-05.json"


def test_under_triton_3_7_every_16_bit_variant_runs_the_tile_its_report_measured_without_spills(monkeypatch):
    """Every row of the committed 3.7.1 report (216 16-bit variants, both targets): the launcher
    under 3.7 picks its tile, and none of them spilled."""
    import json

    rows = json.loads(REPORT_37.read_text())
    assert len(rows) == 216 and {row["triton"] for row in rows} == {"3.7.1"}
    monkeypatch.setattr(launch, "TRITON_VERSION", (3, 7))
    dtypes, cuda = {"bf16": torch.bfloat16, "fp16": torch.float16}, torch.device("cuda")
    for row in rows:
        kernel, *_, dim, dtype = row["variant"].split("/")
        block_m, block_n, _, options = launch.blocks(int(dim[1:]), cuda, dtypes[dtype], kernel,
                                                     arch=int(row["arch"][3:]), sampled="/sampled/" in row["variant"])
        assert (block_m, block_n, options["num_warps"], options["num_stages"]) == (
            row["block_m"], row["block_n"], row["num_warps"], row["num_stages"]), (row["variant"], row["arch"])
        assert (row["spill_store_bytes"], row["spill_load_bytes"], row["stack_bytes"]) == (0, 0, 0), row["variant"]


# Every tile shape (BLOCK_M, BLOCK_N) the launcher picks on a GPU, any target or Triton version.
GPU_TILES = sorted({tile[:2] for table in (launch.TILES, launch.SM80_TILES, *launch.TRITON36_TILES.values())
                    for by_bound in table.values() for tile in by_bound.values()})


# The interpreter's own 16 x 16 tiles run in the fast suite (test_kernels.py and the first shape
# here); the larger shapes, 4-10 s each in the interpreter, in the full suite.
@pytest.mark.parametrize("tile", [pytest.param(tile, marks=() if tile == (16, 16) else pytest.mark.slow)
                                  for tile in GPU_TILES], ids=lambda tile: f"{tile[0]}x{tile[1]}")
def test_the_kernels_equal_the_eager_formula_on_every_gpu_tile_shape(tile, monkeypatch):
    """The interpreter otherwise runs 16 × 16 blocks: here every kernel runs on a tile shape a GPU
    would, over three query blocks and a partial fourth, so that each loop meets every kind of tile
    (test_kernel_tiles.py): full tiles (no mask; some of padding keys alone, some holding padding
    rows with no allowed key at all), tiles the window's edge crosses, tiles the diagonal crosses
    and padded rows. A sampled gate with a window (training), a deterministic gate without one
    (inference, received attention); one batch row left-padded past the second query block."""
    from test_kernel_tiles import _allowed, _tile
    from test_kernels import _compare_with_eager

    original = launch.blocks

    def gpu_tile(head_dim, device, dtype=torch.float32, kernel="forward", queries=None, arch=None, sampled=False):
        return (*tile, original(head_dim, device, dtype, kernel, queries, arch)[2], {})

    block_m, block_n = tile
    length, window, pad = 3 * block_m + 6, block_m + block_n + block_n // 2, block_m + block_m // 2 + 3
    last_block = [_tile(_allowed(length, length, 0, window), 2 * block_m, n, block_m, block_n)
                  for n in range(0, length, block_n)]
    assert any(t.all() for t in last_block) and sum(t.any() and not t.all() for t in last_block) >= 2
    padded_full = _tile(_allowed(length, length, 0, None), block_m, 0, block_m, block_n)
    assert padded_full.all() and pad > block_m and pad >= block_n  # padding rows over padding keys, no mask
    monkeypatch.setattr(launch, "blocks", gpu_tile)
    for gate_name, gate_window in (("sampled", window), ("deterministic", None)):
        _compare_with_eager(gate_name, gate_window, pads=(pad,), batch=1, length=length, heads=2, kv_heads=1)


def test_float32_stays_off_the_kernels_on_cuda_unless_forced(monkeypatch):
    monkeypatch.setenv(fused.MODE_VARIABLE, "auto")
    assert not fused.float32_kernels("cuda") and fused.float32_kernels("cpu")
    monkeypatch.setenv(fused.MODE_VARIABLE, "on")
    assert fused.float32_kernels("cuda")


def test_the_keys_flags_are_converted_once_per_layout():
    from attnlab.attention.kernels import launch
    from attnlab.attention.kernels.layout import MaskLayout

    layout = MaskLayout(torch.tensor([[False, True, True]]), 0, None)
    first, flags = launch._flags(layout, torch.device("cpu"))
    again, _ = launch._flags(layout, torch.device("cpu"))
    assert again is first and first.dtype == torch.int8 and first.tolist() == [[0, 1, 1]]
    assert flags == {"HAS_KEY_REAL": True, "HAS_WINDOW": False}
