"""What ARM adds to a forward pass, measured in one run.

    .venv/bin/python benchmarks/arm_overhead.py [--batch 16] [--length 256] [--repeats 7]

On SmolLM2-135M-Instruct (converted from its wheel into benchmarks/out/ once),
a full forward pass (decoder and LM head, no KV cache) of a batch of random
token ids, with and without ARM on layer 0's MLP activation (default
settings, `mode: replace`). Plain and ARM passes alternate so drifts in the
machine's speed hit both; the ratio of the medians is reported, and the time
of ARM's redistribution alone on the same activation shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from attnlab.interventions import intervened
from attnlab.mlp import ArmSettings, redistribute
from attnlab.models import load_model, pick_device
from common import OUT, embedded_model


def _timed(run) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    device = pick_device("auto")
    model = load_model(embedded_model("smollm2-135m"), device, torch.float32)
    ids = torch.randint(100, model.config.vocab_size, (args.batch, args.length),
                        generator=torch.Generator().manual_seed(0)).to(device)
    settings = ArmSettings()

    def plain():
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)

    def with_arm():
        with intervened(model, arm=settings), torch.inference_mode():
            model(input_ids=ids, use_cache=False)

    plain(), with_arm()  # warm-up
    times = {"plain": [], "arm": []}
    for _ in range(args.repeats):
        times["plain"].append(_timed(plain))
        times["arm"].append(_timed(with_arm))
    shape = (args.batch, args.length, model.config.intermediate_size)
    activation = torch.randn(shape, device=device)
    positions = torch.arange(args.length, device=device).expand(args.batch, -1)
    alone = [_timed(lambda: redistribute(activation, settings, positions, ids)) for _ in range(args.repeats)]
    result = {
        "device": str(device), "threads": torch.get_num_threads(), "batch": args.batch,
        "length": args.length, "plain_s": statistics.median(times["plain"]),
        "arm_s": statistics.median(times["arm"]), "redistribute_s": statistics.median(alone),
    }
    result["arm_over_plain"] = result["arm_s"] / result["plain_s"]
    # an upper bound that timing noise of the whole forward cannot hide
    result["redistribute_over_plain"] = result["redistribute_s"] / result["plain_s"]
    OUT.mkdir(exist_ok=True)
    (OUT / "arm_overhead.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
