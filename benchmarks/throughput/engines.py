"""Static vs continuous batching on a variable-length workload, measured in one run.

    .venv/bin/python -m benchmarks.throughput.engines [--items 64] [--new-tokens 384] [--batch 16]
                                                      [--device auto] [--dtype auto]

Workload (issue 12): GSM8K test items in each embedded model's own format, greedy:
SmolLM2-135M-Instruct in its chat template, Gemma-3-270M (base) with 4 few-shot
examples and the stop strings of the default config. Both engines get the same
batch budget (at most --batch rows decoding at once) and produce the same tokens
(checked here). Reported per model and engine:

- useful tokens/s: generated tokens up to EOS / stop string / the limit (not padding,
  not what a row decodes after it stopped), over wall time;
- slot efficiency of the static engine: useful tokens / (rows x decoding steps) summed
  over batches, i.e. the share of decoded row-steps that were useful;
- peak resident memory of the process (CPU: its high-water mark, monotone over the run, so the
  engine measured second reports the larger of the two) or peak CUDA memory.

Results go to benchmarks/out/generation_engines.json.
"""

from __future__ import annotations

import argparse
import json

import torch

from attnlab.reasoning.generation import generate_all
from benchmarks.tools.harness import (GENERATION_MODELS as MODELS, OUT, add_device_arguments, device_and_dtype, load_embedded, peak_mib, reset_peak, run_fields,
                    gsm8k_workload, timed, write_result)

# a subset rerun joins an earlier run's file only where these agree
SAME_RUN = ("device", "device_name", "dtype", "items", "new_tokens", "batch")


def slot_efficiency(lengths: list[int], prompt_lengths: list[int], batch: int) -> float:
    """Useful row-steps / decoded row-steps of the static engine: it takes prompts longest
    first in batches of ``batch``, and a batch decodes until its longest row ends."""
    order = sorted(range(len(lengths)), key=lambda i: -prompt_lengths[i])
    useful = decoded = 0
    for start in range(0, len(order), batch):
        rows = [lengths[i] for i in order[start:start + batch]]
        useful += sum(rows)
        decoded += len(rows) * max(rows)
    return useful / decoded


def measure(model, tokenizer, prompts, name: str, engine: str, batch: int, new_tokens: int, device):
    if device.type == "cuda":  # on a CPU the peak stays the process's (see the module's docstring)
        reset_peak(device)
    out, seconds = timed(lambda: generate_all(model, tokenizer, prompts, batch, new_tokens, MODELS[name]["stops"],
                                              engine=engine))
    useful = int(out["n_new_tokens"].sum())
    return out, {"seconds": round(seconds, 1), "useful_tokens": useful,
                 "useful_tokens_per_s": round(useful / seconds, 1),
                 "hit_token_limit": int(out["hit_token_limit"].sum()),
                 "peak_memory_mb": round(peak_mib(device))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=384)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    add_device_arguments(parser)
    args = parser.parse_args()
    device, dtype = device_and_dtype(args)
    results = {**run_fields(device, dtype), "threads": torch.get_num_threads(), "items": args.items,
               "new_tokens": args.new_tokens, "batch": args.batch, "models": {}}
    for name in args.models:
        model, tokenizer = load_embedded(name, device, dtype)
        prompts = gsm8k_workload(tokenizer, name, args.items)
        generate_all(model, tokenizer, prompts.head(2), 2, 4, engine="static")  # warm-up
        generate_all(model, tokenizer, prompts.head(2), 2, 4, engine="continuous")
        static_out, static = measure(model, tokenizer, prompts, name, "static", args.batch, args.new_tokens, device)
        continuous_out, continuous = measure(model, tokenizer, prompts, name, "continuous", args.batch,
                                             args.new_tokens, device)
        static["slot_efficiency"] = round(slot_efficiency(static_out["n_new_tokens"].tolist(),
                                                          prompts["n_prompt_tokens"].tolist(), args.batch), 3)
        results["models"][name] = {
            "static": static, "continuous": continuous,
            "same_tokens": static_out["new_token_ids"].tolist() == continuous_out["new_token_ids"].tolist(),
            "speedup": round(continuous["useful_tokens_per_s"] / static["useful_tokens_per_s"], 2)}
        print(json.dumps({name: results["models"][name]}, indent=2), flush=True)
    path = OUT / "generation_engines.json"
    if path.exists() and set(args.models) != set(MODELS):  # a subset rerun keeps the other models' runs
        previous = json.loads(path.read_text())
        if {k: previous.get(k) for k in SAME_RUN} == {k: results[k] for k in SAME_RUN}:
            results["models"] = {**previous["models"], **results["models"]}
    write_result(results, path.name, device, dtype)


if __name__ == "__main__":
    main()
