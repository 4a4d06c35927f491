"""Every fused-kernel variant the launchers can pick, compiled for a GPU on this machine, with what
the compiler reports of it: registers, spilled bytes, stack, shared memory and the matrix
instructions (attnlab.attention.kernels.compiled). No GPU is needed: Triton builds the PTX and the cubin for
the target and its bundled ptxas and cuobjdump read them.

    .venv/bin/python -m benchmarks.gpu.kernel_resources [--archs 90 80] [--head-dims 64 128 256]
                                                   [--dtypes bfloat16 float16 float32] [--kernels ...]

Writes benchmarks/out/kernel_resources.json (one row per variant and target, with Triton's
version) and prints the markdown table benchmarks/gpu/README.md keeps. Under another Triton (the GPU
machine's 3.6, say), run it with that Triton first on PYTHONPATH (a ``pip install --target DIR
triton==3.6.0``): the table says which version compiled it.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from attnlab.attention.kernels import compiled
from benchmarks.tools.harness import OUT


def measure(variant: compiled.Variant, arch: int) -> dict:
    row = {"variant": variant.name, "arch": f"sm_{arch}", "triton": triton.__version__}
    values, options = compiled.constants(variant, arch)
    row.update(block_m=values["BLOCK_M"], block_n=values["BLOCK_N"], **options)
    started = time.perf_counter()
    try:
        row.update(compiled.resources(compiled.compile_variant(variant, arch)))
    except Exception as error:  # noqa: BLE001 -- a variant that does not compile is a row of the table
        row["error"] = f"{type(error).__name__}: {str(error)[-300:]}"
    row["compile_s"] = round(time.perf_counter() - started, 1)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| variant | target | tiles (M×N, warps, stages) | registers | spill bytes (stores/loads) | stack | shared KiB | MMA |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['variant']} | {row['arch']} | | | **{row['error'][:80]}** | | | |")
            continue
        lines.append(f"| {row['variant']} | {row['arch']} | {row['block_m']}×{row['block_n']}, {row['num_warps']}, "
                     f"{row['num_stages']} | {row['registers']} | {row['spill_store_bytes']}/{row['spill_load_bytes']} "
                     f"| {row['stack_bytes']} | {row['shared_bytes'] / 1024:.0f} | {row['mma']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", type=int, nargs="+", default=[90, 80])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16", "float32"])
    parser.add_argument("--kernels", nargs="+", default=list(compiled.KERNELS))
    parser.add_argument("--out", default=str(OUT / "kernel_resources.json"))
    args = parser.parse_args()
    dtypes = tuple(getattr(torch, name) for name in args.dtypes)
    rows = []
    for variant in compiled.variants(tuple(args.kernels), tuple(args.head_dims), dtypes):
        for arch in args.archs:
            rows.append(measure(variant, arch))
            print(json.dumps(rows[-1]), flush=True)
    OUT.mkdir(exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(rows, handle, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
