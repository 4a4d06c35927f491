"""What each fused kernel's inner loop asks of an sm_90 card per attention edge, counted from the
machine code: which unit the sampled gate's extra work lands on, against the dense kernel of the
same shape (FlashAttention's work: two matrix products and one exponential per edge).

    .venv/bin/python -m benchmarks.gpu.kernel_work [--arch 90] [--head-dim 64] [--dtype bfloat16]

No GPU is needed. Each variant is compiled for the target as the launcher picks it
(attnlab.attention.kernels.compiled), its SASS read with Triton's bundled cuobjdump, and its inner
loop found (the shortest backward branch around a matrix instruction: the loop over key blocks,
or query blocks in backward_kv). Two micro-kernels isolate the gate's parts on the forward's tile:
``noise`` (the logistic noise of ``tiles.logistic_noise``: a Philox draw per four edges and two
logarithms per edge) and ``density`` (the expected-density term, a sigmoid per edge), each summed over the tile.

Per edge: the loop's instructions × 32 lanes × warps / (BLOCK_M × BLOCK_N), by unit, and a
modelled cost in SM cycles: those lane-instructions divided by the unit's lanes per clock per SM
(``LANES_PER_CLOCK``, the CUDA C++ Programming Guide's throughput table for compute capability
9.0; "alu" lumps integer, logic, compare and select instructions at 64, though sm_90 issues
IMAD to its FMA pipe, so the ALU figure is an upper bound), every instruction against the
schedulers' issue rate (``issue``: 128 lanes per clock), the matrix products as FLOPs over the
card's dense 16-bit tensor rate. It is a static model: no latencies, stalls, occupancy or
memory; it ranks where the time can go, it does not time anything. ``benchmarks/gpu/README.md`` ("Kernel work") keeps its table.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

from attnlab.attention.kernels import compiled
from attnlab.attention.kernels.tiles import logistic_noise
from benchmarks.tools.harness import OUT

# lanes per clock per SM, compute capability 9.0 (CUDA C++ Programming Guide, "Arithmetic
# Instructions"); "alu": integer add, multiply, logic, shifts, compare, min/max, select
LANES_PER_CLOCK = {"fp32": 128, "alu": 64, "mufu": 16, "conversion": 16, "shuffle": 32}
TENSOR_FLOPS_PER_CLOCK = 4096  # H100 SXM dense bf16: 989 TFLOPS / (132 SMs × 1.83 GHz)
UNIT_OF = {"FFMA": "fp32", "FADD": "fp32", "FMUL": "fp32", "MUFU": "mufu", "SHFL": "shuffle",
           "F2F": "conversion", "F2FP": "conversion", "I2F": "conversion", "I2FP": "conversion", "F2I": "conversion"}
ALU = {"IMAD", "IADD3", "LOP3", "SHF", "ISETP", "LEA", "VIADD", "IMNMX", "FSEL", "FMNMX", "FSETP", "FSET",
       "SEL", "PRMT", "PLOP3", "P2R", "R2P", "SGXT", "IABS", "VIMNMX", "LOP", "BMSK"}
ISSUE_LANES_PER_CLOCK = 128  # four schedulers, one warp instruction each per clock: any instruction
TENSOR = {"HGMMA", "HMMA"}
# matrix-product FLOPs per edge and head-dimension unit: forward QKᵀ and PV; backward_kv
# recomputes QKᵀ and forms dV, dP, dK; backward_q QKᵀ, dP, dQ; received QKᵀ
MATMULS_PER_EDGE = {"forward": 2, "backward_kv": 4, "backward_q": 3, "received": 1}


def _loops(sass: str, around: set[str] | None) -> tuple[list[tuple[int, str]], list[tuple[int, int]]]:
    """(every instruction as (address, opcode), the address span of every loop: a branch back to an
    earlier address, holding one of the instructions ``around`` unless that is None)."""
    instructions = []
    for line in sass.splitlines():
        found = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*);", line)
        if found:
            instructions.append((int(found.group(1), 16), found.group(2), found.group(3)))
    spans = []
    for address, opcode, arguments in instructions:
        target = re.match(r"\s*0x([0-9a-f]+)", arguments)
        if opcode == "BRA" and target and int(target.group(1), 16) < address:
            span = (int(target.group(1), 16), address)
            if around is None or any(op.split(".")[0] in around for at, op, _ in instructions
                                     if span[0] <= at <= span[1]):
                spans.append(span)
    return [(at, op) for at, op, _ in instructions], spans


def _body(instructions: list[tuple[int, str]], span: tuple[int, int]) -> list[str]:
    return [op for at, op in instructions if span[0] <= at <= span[1]]


def loop_body(sass: str, around: set[str] | None = TENSOR) -> list[str]:
    """The opcodes of the shortest loop (a branch back to an earlier address) that holds one of the
    instructions ``around`` (None: the longest loop)."""
    instructions, spans = _loops(sass, around)
    loops = [_body(instructions, span) for span in spans]
    if not loops:
        raise ValueError(f"no loop around {sorted(around or [])} in this SASS")
    return min(loops, key=len) if around is not None else max(loops, key=len)


def innermost_loops(sass: str, around: set[str] = TENSOR) -> list[list[str]]:
    """The opcodes of every loop that holds one of the instructions ``around`` and no other such
    loop: a kernel's inner loops, one per loop of its source (the fused kernels' full tiles and
    their masked ones), in address order."""
    instructions, spans = _loops(sass, around)
    inner = [span for span in spans if not any(other != span and span[0] <= other[0] and other[1] <= span[1]
                                               for other in spans)]
    return [_body(instructions, span) for span in sorted(inner)]


def unit(opcode: str) -> str:
    base = opcode.split(".")[0]
    if base in TENSOR:
        return "tensor"
    if base in UNIT_OF:
        return UNIT_OF[base]
    return "alu" if base in ALU else "other"  # memory, barriers, moves, branches


def per_edge(body: list[str], edges_per_iteration: int, warps: int, matmul_flops: float = 0.0) -> dict:
    """Lane-instructions per edge by unit, and the modelled SM cycles per edge of each unit."""
    counts = collections.Counter(unit(op) for op in body)
    lanes = {name: n * 32 * warps / edges_per_iteration for name, n in counts.items() if name != "tensor"}
    cycles = {name: value / LANES_PER_CLOCK[name] for name, value in lanes.items() if name in LANES_PER_CLOCK}
    cycles["issue"] = len(body) * 32 * warps / edges_per_iteration / ISSUE_LANES_PER_CLOCK
    if matmul_flops:
        cycles["tensor"] = matmul_flops / TENSOR_FLOPS_PER_CLOCK
    return {"lane_instructions_per_edge": lanes, "cycles_per_edge": cycles,
            "bound_by": max(cycles, key=cycles.get) if cycles else None,
            "mufu_ops": dict(collections.Counter(op for op in body if op.startswith("MUFU")))}


def sass_of(kernel) -> str:
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        return subprocess.run([str(compiled._backend_tool("cuobjdump")), "-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout


TOKENS = 2048  # the mix of tiles: one causal sequence of the extraction benchmark's length (4 × 2,048)
KEY_LOOPS = ("forward", "backward_q")  # a query block walks the keys; backward_kv and received the reverse


def tile_counts(kernel: str, tokens: int, block_m: int, block_n: int) -> dict:
    """Of a causal ``tokens`` × ``tokens`` attention (no padding, no window), the tiles a kernel
    visits (every tile with an allowed edge), counted by brute force over the tile grid: "full"
    (every edge allowed; received attention leaves the diagonal out, so there strictly below it)
    and "masked" (the rest: the diagonal crosses them, or the tensor's end)."""
    import numpy as np

    rows, columns = np.arange(tokens)[:, None], np.arange(tokens)[None, :]
    allowed = columns < rows if kernel == "received" else columns <= rows
    counts = {"full": 0, "masked": 0}
    for m_start in range(0, tokens, block_m):
        for n_start in range(0, tokens, block_n):
            tile = allowed[m_start:m_start + block_m, n_start:n_start + block_n]
            if (columns[0, n_start:n_start + block_n] <= m_start + block_m - 1).any():  # the loops' visit
                full = tile.shape == (block_m, block_n) and bool(tile.all())
                counts["full" if full else "masked"] += 1
    return counts


def mixed_cycles(bound: dict, counts: dict) -> float:
    """Cycles per visited tile edge over a sequence: each loop's cycles per edge weighted by its
    tiles (every tile holds BLOCK_M × BLOCK_N edges, full or masked)."""
    return sum(counts[name] * bound[name] for name in ("full", "masked")) / (counts["full"] + counts["masked"])


def kernel_row(variant: compiled.Variant, arch: int, tokens: int = TOKENS) -> dict:
    """The variant's full-tile loop (its shortest inner loop) and masked-tile loop (its longest:
    the same where a kernel has one loop), per edge by unit, and the bound unit's cycles per edge
    over the tiles of a causal ``tokens``-token sequence, each loop weighted by its tiles."""
    values, options = compiled.constants(variant, arch)
    edges = values["BLOCK_M"] * values["BLOCK_N"]
    flops = 2 * MATMULS_PER_EDGE[variant.kernel] * variant.head_dim
    loops = innermost_loops(sass_of(compiled.compile_variant(variant, arch)))
    full, masked = (per_edge(body, edges, options["num_warps"], flops) for body in (min(loops, key=len),
                                                                                    max(loops, key=len)))
    counts = tile_counts(variant.kernel, tokens, values["BLOCK_M"], values["BLOCK_N"])
    bound = {name: max(row["cycles_per_edge"].values()) for name, row in (("full", full), ("masked", masked))}
    mixed = mixed_cycles(bound, counts)
    return {"variant": variant.name, "tile": f"{values['BLOCK_M']}x{values['BLOCK_N']}",
            "warps": options["num_warps"], "loops": len(loops), "loop_instructions": len(min(loops, key=len)),
            "masked_loop_instructions": len(max(loops, key=len)), **full, "masked": masked, "tiles": counts,
            "bound_cycles_per_edge": {**bound, f"at {tokens} tokens": mixed}}


@triton.jit
def _noise_tiles(OUT, seed, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    bh, offs_m = tl.program_id(1), tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    total = tl.zeros([BLOCK_M], tl.float32)
    for n_start in range(0, N, BLOCK_N):
        total += tl.sum(logistic_noise(seed, bh, offs_m, n_start + tl.arange(0, BLOCK_N), M, N), 1)
    tl.store(OUT + offs_m, total)


@triton.jit
def _density_tiles(OUT, LOGITS, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    total = tl.zeros([BLOCK_M], tl.float32)
    for n_start in range(0, N, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        total += tl.sum(tl.sigmoid(tl.load(LOGITS + offs_m[:, None] * N + offs_n[None, :])), 1)
    tl.store(OUT + offs_m, total)


def micro_row(name: str, arch: int, block_m: int, block_n: int, warps: int) -> dict:
    """A gate part alone on the forward's tile (loop without a matrix instruction: its longest)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = {"noise": _noise_tiles, "density": _density_tiles}[name]
    pointer = {"noise": {"seed": "i32"}, "density": {"LOGITS": "*fp32"}}[name]
    signature = {"OUT": "*fp32", **pointer, "M": "i32", "N": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(4,): block_m, (5,): block_n})
    body = loop_body(sass_of(triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})),
                     around=None)
    return {"variant": f"{name} alone (the gate's part, on the forward's tile)", "tile": f"{block_m}x{block_n}",
            "warps": warps, "loop_instructions": len(body), **per_edge(body, block_m * block_n, warps)}


VARIANTS = (("forward", "dense"), ("forward", "deterministic"), ("forward", "sampled"), ("backward_kv", "dense"),
            ("backward_kv", "sampled"), ("backward_q", "dense"), ("backward_q", "sampled"), ("received", "dense"))
STEP = ("forward", "backward_kv", "backward_q")  # a training step's kernels, each over every edge once


def measure(arch: int, head_dim: int, dtype: torch.dtype) -> dict:
    rows = [kernel_row(compiled.Variant(kernel, gate, False, head_dim, dtype), arch) for kernel, gate in VARIANTS]
    forward, options = compiled.constants(compiled.Variant("forward", "sampled", False, head_dim, dtype), arch)
    rows += [micro_row(name, arch, forward["BLOCK_M"], forward["BLOCK_N"], options["num_warps"])
             for name in ("noise", "density")]
    return {"arch": f"sm_{arch}", "head_dim": head_dim, "dtype": str(dtype).removeprefix("torch."),
            "triton": triton.__version__, "rows": rows, "training_step": step_model(rows)}


def step_model(rows: list[dict]) -> dict:
    """A training step's modelled cycles per edge, dense kernels against sampled ones: per kernel
    its bound unit's cycles (the units overlap at best) over a causal sequence's tiles, full and
    masked, summed over the step's three kernels."""
    bound = {"/".join(row["variant"].split("/")[:2]): row["bound_cycles_per_edge"][f"at {TOKENS} tokens"]
             for row in rows if "bound_cycles_per_edge" in row}
    dense = sum(bound[f"{kernel}/dense"] for kernel in STEP)
    sampled = sum(bound[f"{kernel}/sampled"] for kernel in STEP)
    return {"dense_cycles_per_edge": dense, "sampled_cycles_per_edge": sampled, "sampled_over_dense": sampled / dense}


def table(result: dict) -> str:
    lines = [f"sm_{result['arch'][3:]}, head dimension {result['head_dim']}, {result['dtype']}, Triton {result['triton']}",
             "", "| kernel | tile, warps | loop instructions, full / masked | lane-instructions per edge, full tiles: "
             "ALU / FP32 / MUFU | modelled cycles per edge, full tiles: tensor / ALU / FP32 / MUFU / shuffle / "
             f"conversion / issue | bound by | bound unit's cycles per edge: full / masked / {TOKENS} tokens "
             "(tiles full : masked) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in result["rows"]:
        lanes, cycles = row["lane_instructions_per_edge"], row["cycles_per_edge"]
        loops, mix = f"{row['loop_instructions']}", "–"
        if "bound_cycles_per_edge" in row:
            loops += f" / {row['masked_loop_instructions']}"
            bound, tiles = row["bound_cycles_per_edge"], row["tiles"]
            mix = (f"{bound['full']:.3f} / {bound['masked']:.3f} / **{bound[f'at {TOKENS} tokens']:.3f}** "
                   f"({tiles['full']} : {tiles['masked']})")
        lines.append(f"| {row['variant']} | {row['tile']}, {row['warps']} | {loops} | "
                     + " / ".join(f"{lanes.get(u, 0):.1f}" for u in ("alu", "fp32", "mufu")) + " | "
                     + " / ".join(f"{cycles.get(u, 0):.3f}" for u in ("tensor", "alu", "fp32", "mufu", "shuffle", "conversion", "issue"))
                     + f" | {row['bound_by']} | {mix} |")
    step = result["training_step"]
    lines += ["", "A training step's three kernels, the bound unit's cycles per edge over "
                  f"{TOKENS} tokens' tiles summed: "
                  f"dense {step['dense_cycles_per_edge']:.3f}, sampled {step['sampled_cycles_per_edge']:.3f} "
                  f"({step['sampled_over_dense']:.1f}x)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, choices=[90])  # the model's rates are compute capability 9.0's
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--out", default=str(OUT / "kernel_work.json"))
    args = parser.parse_args()
    result = measure(args.arch, args.head_dim, getattr(torch, args.dtype))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(table(result))


if __name__ == "__main__":
    main()
