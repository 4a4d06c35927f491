"""Time and peak memory of one tool's run, for the peer workers (benchmarks/peers/heads_worker.py):
the unit forward timed around it, the resident set's high-water mark on the CPU, torch's peak
allocation on CUDA. ``DEVICE`` is where every tool runs; the worker sets it from ``--device``
before any tool is loaded, and the tools read it as ``measuring.DEVICE`` when they run."""

from __future__ import annotations

import ctypes
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # auto: CUDA when present


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def held_bytes() -> int:
    """What the process holds now: resident set (CPU) or torch's allocation (CUDA)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    return _status_kib("VmRSS") * 1024


def timed_with_peak(run):
    """(result, seconds, peak bytes held during run())."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current VmRSS
    started = time.perf_counter()
    result = run()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _status_kib("VmHWM") * 1024
    return result, time.perf_counter() - started, peak


def settle() -> int:
    """What the process holds once freed memory has gone back to the system."""
    gc.collect()
    if DEVICE.type == "cpu":
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
    return held_bytes()


def measure(run, unit, repeats: int, warm_up: bool = True, unit_each: int = 1) -> tuple[object, dict]:
    """Time run() `repeats` times (after one warm-up), with the unit forward timed
    before the first run and after the last (`unit_each` times before each run and
    after the last when more than 1), so the ratio of the medians sees the same load.

    Returns run()'s last result and times, the unit's median and the peak held during
    run() above what the process held after the warm-up (model, inputs, buffers).
    """
    if unit is not None:
        unit()
    if warm_up:
        run()
    base = settle()
    times, unit_times, peaks, result = [], [], [], None

    def time_unit():
        if unit is not None:
            unit_times.extend(timed_with_peak(unit)[1] for _ in range(unit_each))
    for index in range(repeats):
        if index == 0 or unit_each > 1:
            time_unit()
        result = None
        settle()
        result, seconds, peak = timed_with_peak(run)
        times.append(seconds)
        peaks.append(peak)
    time_unit()
    median = statistics.median(times)
    stats = {"seconds": [round(t, 4) for t in times], "median_s": median,
             "peak_above_model_mib": round((max(peaks) - base) / 2**20, 1)}
    if unit is not None:
        stats["unit_seconds"] = [round(t, 4) for t in unit_times]
        stats["unit_s"] = statistics.median(unit_times)
        stats["unit_ratio"] = median / stats["unit_s"]
    return result, stats


def versions() -> dict:
    found = {"python": sys.version.split()[0], "torch": torch.__version__,
             "transformers": transformers.__version__, "numpy": np.__version__,
             "threads": torch.get_num_threads(), "device": str(DEVICE),
             "device_name": torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu",
             "dtype": "float32"}
    for name in ("transformer_lens", "nnsight", "attnlab"):
        try:
            from importlib.metadata import version
            found[name] = version(name)
        except Exception:  # noqa: BLE001 - not installed in this virtualenv
            pass
    return found
