"""Where one call's time goes: torch's profiler over a run, summarised for benchmarks/gpu/node.py.

A ratio says how far a path is from its target, not why. Each profiled run is called once
unmeasured (compilation, caches), then once under ``torch.profiler`` with the host's activities
and, on CUDA, the device's. The summary names:

- ``wall_ms``: the profiled call, from its start to the device's end (synchronised);
- ``device_busy_ms``: the sum of the device's kernel and copy times (CUDA only): wall minus busy
  is time the card waited for the host, or for nothing;
- ``launches``: kernels launched (torch's ``cudaLaunchKernel`` and Triton's ``cuLaunchKernel``);
- ``host_waits``: the events that make the host wait for the device (synchronisations, copies to
  the host, a tensor's value read: ``aten::item``, ``aten::_local_scalar_dense``), by name;
- ``top_device`` and ``top_host``: the events with the most self time on each side, with calls.

The whole trace goes to ``trace_dir`` as gzipped Chrome JSON (chrome://tracing, Perfetto).
"""

from __future__ import annotations

import gzip
import shutil
import tempfile
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.tools.harness import synchronize

HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync", "aten::item", "aten::_local_scalar_dense")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
TOP = 12


def profiled(runs: dict, device: torch.device, trace_dir: Path | None = None) -> dict:
    """{name: summary} of one profiled call of each run (module docstring)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    summaries = {}
    for name, run in runs.items():
        try:  # a profiler that fails (no CUPTI on a node, say) must not lose the timings beside it
            run()  # unmeasured: compilation and caches
            synchronize()
            with profile(activities=activities) as recorded:
                run()
                synchronize()
            summaries[name] = summary(recorded, device.type == "cuda")
            if trace_dir is not None:
                summaries[name]["trace"] = str(_write_trace(recorded, Path(trace_dir), name))
        except Exception as error:  # noqa: BLE001
            summaries[name] = {"error": f"{type(error).__name__}: {error}"}
    return summaries


def summary(recorded, on_device: bool) -> dict:
    events = recorded.key_averages()
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    row = {"wall_ms": _wall_ms(recorded),
           "launches": sum(e.count for e in events if e.key in LAUNCHES),
           "host_waits": {e.key: e.count for e in events if e.key in HOST_WAITS},
           "top_host": [_top(e, e.self_cpu_time_total) for e in host[:TOP]]}
    if on_device:  # the device's own events only: the op that launched a kernel carries its time too
        device_time = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        busy = [e for e in events if e.device_type == DeviceType.CUDA and device_time(e) > 0]
        row["device_busy_ms"] = sum(device_time(e) for e in busy) / 1e3
        row["top_device"] = [_top(e, device_time(e)) for e in sorted(busy, key=device_time, reverse=True)[:TOP]]
    return row


def _top(event, microseconds: float) -> dict:
    return {"name": event.key[:100], "calls": event.count, "self_ms": microseconds / 1e3}


def _wall_ms(recorded) -> float:
    """From the first event's start to the last one's end, host or device."""
    events = recorded.events()
    if not events:
        return 0.0
    start = min(e.time_range.start for e in events)
    end = max(e.time_range.end for e in events)
    return (end - start) / 1e3


def _write_trace(recorded, folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{''.join(c if c.isalnum() else '_' for c in name)}.json.gz"
    with tempfile.TemporaryDirectory() as scratch:
        plain = Path(scratch) / "trace.json"
        recorded.export_chrome_trace(str(plain))
        partial = target.with_suffix(".partial")  # renamed once whole: a killed run leaves no trace that looks complete
        with plain.open("rb") as source, gzip.open(partial, "wb") as packed:
            shutil.copyfileobj(source, packed)
        partial.replace(target)
    return target
