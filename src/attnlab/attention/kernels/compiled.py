"""The fused kernels compiled ahead of time for a GPU this machine need not have, and what the
compiler says of each: registers, spills, stack, shared memory and the matrix instructions
(``wgmma`` on sm_90, ``mma`` elsewhere).

``variants()`` lists what the launchers (``launch``) can pick: each kernel × gate × window × head
dimension × dtype, with the tiles, warps and stages ``launch.blocks`` chooses for it.
``compile_variant`` builds one for a target (``triton.compile`` of the kernel's source with the
launcher's argument types and constants, for ``GPUTarget("cuda", arch, 32)``: PTX and a cubin,
on the CPU) and ``resources`` reads the cubin with the ``cuobjdump`` bundled in Triton's NVIDIA
backend. tests/test_kernel_compiles.py compiles a representative set; benchmarks/gpu/kernel_resources.py
compiles all of them into a table.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from attnlab.attention.kernels import launch
from attnlab.attention.kernels.backward import _backward_kv_kernel, _backward_q_kernel
from attnlab.attention.kernels.forward import _forward_kernel
from attnlab.attention.kernels.received import _received_kernel

KERNELS = {"forward": _forward_kernel, "backward_kv": _backward_kv_kernel, "backward_q": _backward_q_kernel,
           "received": _received_kernel}
# The kernels' pointer arguments: the attention's tensors (queries, keys, values, output and their
# gradients: the operands' dtype), float32 rows and int8 flags.
TENSOR_POINTERS = {"Q", "K", "V", "O", "DY", "DQ", "DK", "DV"}
FLOAT32_POINTERS = {"LSE", "STATS", "DELTA", "DEXP", "COLUMNS"}
INT8_POINTERS = {"KEY_REAL", "INSERTED"}
FLOAT_SCALARS = {"scale", "bias"}
TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
GATES = {"dense": launch.DENSE, "deterministic": launch.DETERMINISTIC, "sampled": launch.SAMPLED}


@dataclass(frozen=True)
class Variant:
    """One kernel as a launcher compiles it."""

    kernel: str
    gate: str
    window: bool
    head_dim: int
    dtype: torch.dtype

    @property
    def name(self) -> str:
        window = "window" if self.window else "causal"
        return f"{self.kernel}/{self.gate}/{window}/d{self.head_dim}/{TRITON_TYPES[self.dtype]}"


def variants(kernels=tuple(KERNELS), head_dims=(64, 128, 256),
             dtypes=(torch.bfloat16, torch.float16, torch.float32)) -> list[Variant]:
    """Every variant the launchers can pick: the backward kernels train (sampled gates) or run a
    dense model's backward; the received-attention kernel never sees a sampled gate."""
    found = []
    for kernel, gate, window, head_dim, dtype in itertools.product(kernels, GATES, (False, True), head_dims, dtypes):
        if kernel == "received" and gate == "sampled":
            continue
        if kernel.startswith("backward") and gate == "deterministic":
            continue
        found.append(Variant(kernel, gate, window, head_dim, dtype))
    return found


def _signature(kernel, tensor_dtypes: dict[str, torch.dtype], values: dict) -> dict[str, str]:
    """Triton's type of each argument of ``kernel``: constants, pointers by kind, scalars."""
    types = {}
    for name in kernel.arg_names:
        if name in values:
            types[name] = "constexpr"
        elif name in TENSOR_POINTERS:
            types[name] = f"*{TRITON_TYPES[tensor_dtypes[name]]}"
        elif name in FLOAT32_POINTERS:
            types[name] = "*fp32"
        elif name in INT8_POINTERS:
            types[name] = "*i8"
        else:
            types[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    return types


def constants(variant: Variant, arch: int = 90) -> tuple[dict, dict]:
    """(the kernel's constexpr values, its launch options) as the launcher sets them on a CUDA
    device of compute capability ``arch`` (90: sm_90)."""
    block_m, block_n, block_d, options = launch.blocks(variant.head_dim, torch.device("cuda"), variant.dtype,
                                                       variant.kernel, arch=arch)
    values = {"GATE": GATES[variant.gate], "HAS_KEY_REAL": True, "HAS_WINDOW": variant.window,
              "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d,
              "PRECISION": launch.precision(variant.dtype)}
    kernel = KERNELS[variant.kernel]
    if "HAS_INSERTED" in kernel.arg_names:
        values["HAS_INSERTED"] = True
    if "NOISY" in kernel.arg_names:
        values["NOISY"] = False
    return values, options


def compile_variant(variant: Variant, arch: int = 90, tensor_dtypes: dict[str, torch.dtype] | None = None):
    """The variant compiled for ``sm_{arch}`` (a ``triton.compiler.CompiledKernel``); its tensors
    in ``variant.dtype`` unless ``tensor_dtypes`` names others (as a caller might pass them)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = KERNELS[variant.kernel]
    values, options = constants(variant, arch)
    signature = _signature(kernel, {**dict.fromkeys(TENSOR_POINTERS, variant.dtype), **(tensor_dtypes or {})}, values)
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(name),): value for name, value in values.items()})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def _backend_tool(name: str) -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def resources(compiled) -> dict:
    """What the compiler reports of a compiled kernel: registers, spill stores and loads, stack,
    shared memory (bytes), and the matrix instruction its PTX uses."""
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(_backend_tool("cuobjdump")), "-res-usage", str(cubin)],
                               capture_output=True, text=True, check=True).stdout
        ptx = Path(folder) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        arch = compiled.metadata.target.arch
        spills = subprocess.run([str(_backend_tool("ptxas")), f"-arch=sm_{arch}{'a' if arch == 90 else ''}", "-v",
                                 str(ptx), "-o", str(Path(folder) / "again.cubin")],
                                capture_output=True, text=True).stderr
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    stores = re.search(r"(\d+) bytes spill stores", spills)
    loads = re.search(r"(\d+) bytes spill loads", spills)
    text = compiled.asm["ptx"]
    mma = "wgmma" if "wgmma" in text else ("mma" if "mma.sync" in text else "fma")
    return {"registers": registers, "spill_store_bytes": int(stores.group(1)) if stores else None,
            "spill_load_bytes": int(loads.group(1)) if loads else None, "stack_bytes": stack,
            "shared_bytes": compiled.metadata.shared, "mma": mma}


def request(variant: Variant, arch: int = 90, tensor_dtypes: dict[str, torch.dtype] | None = None) -> dict:
    """One compilation for ``compile_elsewhere``, as JSON."""
    return {"kernel": variant.kernel, "gate": variant.gate, "window": variant.window, "head_dim": variant.head_dim,
            "dtype": str(variant.dtype).removeprefix("torch."), "arch": arch,
            "tensor_dtypes": {name: str(dtype).removeprefix("torch.") for name, dtype in (tensor_dtypes or {}).items()}}


def _answer(asked: dict) -> dict:
    variant = Variant(asked["kernel"], asked["gate"], asked["window"], asked["head_dim"], getattr(torch, asked["dtype"]))
    tensor_dtypes = {name: getattr(torch, dtype) for name, dtype in asked["tensor_dtypes"].items()}
    try:
        return {"name": variant.name, **resources(compile_variant(variant, asked["arch"], tensor_dtypes))}
    except Exception as error:  # noqa: BLE001 -- a compile error is the answer
        return {"name": variant.name, "error": f"{type(error).__name__}: {str(error)[-500:]}"}


def compile_elsewhere(requests: list[dict], timeout: int = 900) -> list[dict]:
    """``requests`` compiled in a fresh interpreter without ``TRITON_INTERPRET`` (where it is set,
    as in the tests, the kernels are the interpreter's functions, which do not compile): each
    answer ``resources``' report, or the compile error."""
    import json
    import os
    import sys

    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    finished = subprocess.run([sys.executable, "-m", "attnlab.attention.kernels.compiled"], input=json.dumps(requests),
                              capture_output=True, text=True, env=environment, timeout=timeout, check=True)
    return json.loads(finished.stdout)


if __name__ == "__main__":  # compile_elsewhere's other side: requests on stdin, answers on stdout
    import json
    import sys

    print(json.dumps([_answer(asked) for asked in json.load(sys.stdin)]))
