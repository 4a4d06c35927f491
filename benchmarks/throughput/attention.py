"""Attention extraction vs a plain forward pass, measured in one run.

    .venv/bin/python -m benchmarks.throughput.attention [--batch 4] [--length 512]

On SmolLM2-135M-Instruct (converted from its wheel into benchmarks/out/ once):
tokens/s and peak memory of
  - a plain forward pass of the decoder with sdpa and with eager attention,
  - `output_attentions=True` (eager, every layer's full maps returned),
  - attnlab's extraction (`attnlab.extraction.extract.extract`: reducing attention
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
import statistics

import numpy as np
import torch

from attnlab.extraction.extract import extract, write_attention
from benchmarks.tools.harness import (OUT, add_device_arguments, device_and_dtype, held_mib, load_embedded, math500_prompts, peak_mib,
                    reset_peak, timed, write_result)


def measure(run, device: torch.device, repeats: int) -> tuple[float, float, float]:
    """(median seconds, peak memory, peak memory above what was held before) of run(), MiB."""
    times, peaks, extras = [], [], []
    for _ in range(repeats):
        reset_peak(device)
        base = held_mib(device)
        times.append(timed(run)[1])
        peaks.append(peak_mib(device))
        extras.append(peaks[-1] - base)
    return statistics.median(times), max(peaks), max(extras)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size-prompts", type=int, default=40)
    add_device_arguments(parser)
    args = parser.parse_args()

    device, dtype = device_and_dtype(args)
    model, tokenizer = load_embedded("smollm2-135m", device, dtype)
    decoder = model.get_decoder()
    prompts = math500_prompts(tokenizer, args.batch, args.length)
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
    report = {"model": "SmolLM2-135M-Instruct", "threads": torch.get_num_threads(),
              "batch": f"{args.batch} x {args.length} tokens", "baseline": f"plain forward ({fastest})"}
    base_seconds, base_peak, base_extra = results[fastest]
    for name, (seconds, peak, extra) in results.items():
        report[name] = {"tokens_per_s": round(tokens / seconds),
                        "throughput_ratio": round(base_seconds / seconds, 3),
                        "peak_mib": round(peak), "peak_memory_ratio": round(peak / base_peak, 2),
                        "peak_above_weights_mib": round(extra, 1),
                        "peak_above_weights_ratio": round(extra / max(base_extra, 1e-9), 2)}

    sized = math500_prompts(tokenizer, args.size_prompts, 256)
    path = OUT / "size_check.h5"
    write_attention(path, extract(model, sized, 8, []), sized, {"model": "smollm2-135m"})
    report["hdf5_mib_per_1000_prompts_of_256_tokens"] = round(
        path.stat().st_size / 2**20 * 1000 / args.size_prompts, 1)
    write_result(report, "attention_throughput.json", device, dtype)


if __name__ == "__main__":
    main()
