"""What ARM adds to a forward pass, measured in one run.

    .venv/bin/python -m benchmarks.throughput.arm_overhead [--batch 16] [--length 256] [--repeats 7]
                                                [--device auto] [--dtype auto]

On SmolLM2-135M-Instruct (converted from its wheel into benchmarks/out/ once),
a full forward pass (decoder and LM head, no KV cache) of a batch of random
token ids, with and without ARM on layer 0's MLP activation (default
settings, `mode: replace`). Plain and ARM passes alternate so drifts in the
machine's speed hit both; the ratio of the medians is reported, and the time
of ARM's redistribution alone on the same activation shape.
"""

from __future__ import annotations

import argparse

import torch

from attnlab.interventions import intervened
from attnlab.interventions.mlp import ArmSettings, redistribute
from benchmarks.tools.harness import add_device_arguments, alternate, device_and_dtype, load_embedded, median_seconds, write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    add_device_arguments(parser)
    args = parser.parse_args()
    device, dtype = device_and_dtype(args)
    model, _ = load_embedded("smollm2-135m", device, dtype)
    ids = torch.randint(100, model.config.vocab_size, (args.batch, args.length),
                        generator=torch.Generator().manual_seed(0)).to(device)
    settings = ArmSettings()

    def plain():
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)

    def with_arm():
        with intervened(model, arm=settings), torch.inference_mode():
            model(input_ids=ids, use_cache=False)

    times = alternate({"plain": plain, "arm": with_arm}, args.repeats)
    shape = (args.batch, args.length, model.config.intermediate_size)
    activation = torch.randn(shape, device=device, dtype=dtype)
    positions = torch.arange(args.length, device=device).expand(args.batch, -1)
    alone = median_seconds(lambda: redistribute(activation, settings, positions, ids), args.repeats)
    result = {"threads": torch.get_num_threads(), "batch": args.batch, "length": args.length,
              "plain_s": times["plain"], "arm_s": times["arm"], "redistribute_s": alone}
    result["arm_over_plain"] = result["arm_s"] / result["plain_s"]
    # an upper bound that timing noise of the whole forward cannot hide
    result["redistribute_over_plain"] = result["redistribute_s"] / result["plain_s"]
    write_result(result, "arm_overhead.json", device, dtype)


if __name__ == "__main__":
    main()
