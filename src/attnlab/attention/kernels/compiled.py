"""The fused kernels compiled ahead of time for a GPU this machine need not have, and what the
compiler says of each: registers, spills, stack, shared memory and the matrix instructions
(``wgmma`` on sm_90, ``mma`` elsewhere).

``variants()`` lists what the launchers (``launch``) can pick: each kernel × gate × window × head
dimension × dtype, with the tiles, warps and stages ``launch.blocks`` chooses for it.
``compile_variant`` builds one for a target from the very arguments its launcher passes
(``representative_launch``: the launcher's own ``Launch`` for CPU tensors of a model's shapes),
typed and specialised by Triton's own rule as a launch on the card would be (``specialised``: a
stride of 1 a constant, sizes and strides divisible by 16 and aligned pointers marked so), for
``GPUTarget("cuda", arch, 32)``: PTX and a cubin, on the CPU. Before 2026-12-05 the compiles
declared every integer unspecialised, which a launch never does: their register counts and
instruction counts described code no card runs (benchmarks/gpu/README.md). ``resources`` reads
the cubin with the ``cuobjdump`` bundled in Triton's NVIDIA backend.
tests/test_kernel_compiles.py compiles a representative set; benchmarks/gpu/kernel_resources.py
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
from attnlab.attention.kernels.layout import MaskLayout
from attnlab.attention.kernels.received import _received_kernel

KERNELS = {"forward": _forward_kernel, "backward_kv": _backward_kv_kernel, "backward_q": _backward_q_kernel,
           "received": _received_kernel}
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


# What a compile stands for: SmolLM2-135M's heads (9 query, 3 key/value), two prompts of 256
# tokens, as the model hands them: queries and keys contiguous [B, H, T, D] (the rotary embedding
# writes new tensors), values a view of v_proj's [B, T, H_kv, D] output. A launch specialises on
# what these share with any such call: strides and sizes equal to 1 or divisible by 16 (every
# stride here, at a head dimension that is a multiple of 16), 16-byte aligned pointers.
BATCH, HEADS, KV_HEADS, TOKENS, WINDOW = 2, 9, 3, 256, 512


def representative_launch(variant: Variant, arch: int = 90,
                          tensor_dtypes: dict[str, torch.dtype] | None = None) -> launch.Launch:
    """The variant's ``launch.Launch`` for a CUDA card of compute capability ``arch``, built by
    the launcher itself from CPU tensors of the shapes above (nothing runs); the tensors in
    ``variant.dtype`` unless ``tensor_dtypes`` names others (Q for queries, keys, outputs and
    their gradients, V for values and theirs)."""
    dtypes = {"Q": variant.dtype, "V": variant.dtype, **(tensor_dtypes or {})}
    head_dim = variant.head_dim
    query = torch.zeros(BATCH, HEADS, TOKENS, head_dim, dtype=dtypes["Q"])
    key = torch.zeros(BATCH, KV_HEADS, TOKENS, head_dim, dtype=dtypes["Q"])
    value = torch.zeros(BATCH, TOKENS, KV_HEADS, head_dim, dtype=dtypes["V"]).transpose(1, 2)
    layout = MaskLayout(torch.ones(BATCH, TOKENS, dtype=torch.bool), 0, WINDOW if variant.window else None)
    gate = launch.Gate(GATES[variant.gate], 0.3, seed=12345)
    rows = torch.zeros(BATCH, HEADS, TOKENS)
    if variant.kernel == "forward":
        return launch.forward_launch(query, key, value, layout, gate, 0.125,
                                     torch.zeros(BATCH, TOKENS, dtype=torch.bool), arch=arch)[0]
    if variant.kernel == "received":
        return launch.received_launch(query, key, rows, layout, gate, 0.125, arch=arch)[0]
    out = torch.zeros(BATCH, TOKENS, HEADS, head_dim, dtype=dtypes["Q"])
    launches, _ = launch.backward_launches((query, key, value, out, rows), out, rows, layout, gate, 0.125, arch=arch)
    return launches[0 if variant.kernel == "backward_kv" else 1]


def specialised(call: launch.Launch) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attributes, options) of ``call`` as Triton's launcher would compile
    it: each argument typed and specialised by Triton's own rule (``native_specialize_impl``: an
    int equal to 1 becomes a constant, one divisible by 16 and a 16-byte aligned pointer get
    ``tt.divisibility``), but for the parameters the kernel keeps from specialisation."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    kernel = _jit_function(call.kernel)
    values = dict(zip(kernel.arg_names, call.args)) | {k: v for k, v in call.constants.items() if k in kernel.arg_names}
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[(index,)] = "constexpr", value
            continue
        kind, key = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                           not param.do_not_specialize_on_alignment)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[(index,)] = value
        elif isinstance(key, str):
            attrs[(index,)] = BaseBackend.parse_attr(key)
    options = {k: v for k, v in call.constants.items() if k not in kernel.arg_names}
    return signature, constexprs, attrs, options


def _jit_function(kernel):
    """The kernel's ``JITFunction`` (under TRITON_INTERPRET, as in the tests, the decorator gave an
    interpreter's function: the same source and options, rebuilt for its parameters' metadata)."""
    if hasattr(kernel, "params"):
        return kernel
    options = {name: kernel.kwargs[name] for name in ("do_not_specialize", "do_not_specialize_on_alignment")
               if name in kernel.kwargs}
    return triton.runtime.jit.JITFunction(kernel.fn, **options)


def constants(variant: Variant, arch: int = 90) -> tuple[dict, dict]:
    """(the kernel's constexpr values, its launch options) as the launcher sets them on a CUDA
    device of compute capability ``arch`` (90: sm_90)."""
    call = representative_launch(variant, arch)
    values = {k: v for k, v in call.constants.items() if k in call.kernel.arg_names}
    return values, {k: v for k, v in call.constants.items() if k not in call.kernel.arg_names}


def compile_variant(variant: Variant, arch: int = 90, tensor_dtypes: dict[str, torch.dtype] | None = None):
    """The variant compiled for ``sm_{arch}`` (a ``triton.compiler.CompiledKernel``) from the
    arguments its launcher passes (``representative_launch``), specialised as a launch would be."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    call = representative_launch(variant, arch, tensor_dtypes)
    signature, constexprs, attrs, options = specialised(call)
    source = ASTSource(fn=call.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
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
