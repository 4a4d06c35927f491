"""Static vs continuous batching on the embedded default's own generation prompts.

    .venv/bin/python -m benchmarks.throughput.default_engines WORKDIR [--device auto] [--dtype auto]

WORKDIR: a finished run of the embedded default (the path printed by
benchmarks/throughput/end_to_end.sh). Every prompt file of both models is generated with both
engines in one process, with the generation settings config/config.yaml gives that
model and dataset (batch, new tokens, stop strings), timing the generation alone
(no job start-up).
Checks that both engines give the same token ids. Writes benchmarks/out/default_engines.json.
"""

from __future__ import annotations

import argparse
import glob
import json

import torch
import yaml

from attnlab import io
from attnlab.config.plan import cell_generation
from attnlab.config.schema import validate_config
from attnlab.models import load_model
from attnlab.reasoning.generation import generate_all
from attnlab.tokenization import load_tokenizer
from benchmarks.tools.harness import REPO, add_device_arguments, device_and_dtype, timed, write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdir")
    add_device_arguments(parser)
    args = parser.parse_args()
    device, dtype = device_and_dtype(args)
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    validate_config(config, REPO / "config" / "schema.yaml")  # fills in the defaults
    results = {"threads": torch.get_num_threads(), "models": {}}
    for name in config["models"]:
        folder = f"{args.workdir}/resources/models/{name}"
        tokenizer = load_tokenizer(folder)
        model = load_model(folder, device, dtype)
        files = sorted(glob.glob(f"{args.workdir}/results/prompts/{name}/*/*.parquet"))
        generate_all(model, tokenizer, io.read_parquet(files[0]).head(2), 2, 4, engine="continuous")  # warm-up
        seconds, same, tokens = {"static": 0.0, "continuous": 0.0}, True, 0
        for path in files:
            prompts = io.read_parquet(path)
            cell = cell_generation(config, name, path.split("/")[-2])
            out = {}
            for engine in seconds:
                out[engine], taken = timed(lambda: generate_all(
                    model, tokenizer, prompts, cell["batch_size"], cell["max_new_tokens"], cell["stop_strings"],
                    engine=engine))
                seconds[engine] += taken
            same &= out["static"]["new_token_ids"].map(list).tolist() == out["continuous"]["new_token_ids"].map(list).tolist()
            tokens += int(out["static"]["n_new_tokens"].sum())
        results["models"][name] = {
            "prompt_files": len(files), "new_tokens": tokens, "same_tokens": same,
            "static_s": round(seconds["static"], 1), "continuous_s": round(seconds["continuous"], 1),
            "speedup": round(seconds["static"] / seconds["continuous"], 2)}
        print(json.dumps({name: results["models"][name]}), flush=True)
    write_result(results, "default_engines.json", device, dtype)


if __name__ == "__main__":
    main()
