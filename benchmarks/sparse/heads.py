"""Heads needed to 0.9 explained effect for a dense model and its sparse copies, under every
ranking x ablation x prompt count (attnlab.circuits.head_counts), and the padding check.

    python -m benchmarks.sparse.heads measure --label dense --model resources/models/smollm2-135m \
        --tasks ioi greater_than docstring ioi_long --n 24 96 --out results/sparse_heads
    python -m benchmarks.sparse.heads figure --out results/sparse_heads --base dense

``measure`` writes, task by task (a rerun resumes), heads_{label}.csv (one row per task x n x ablation x ranking, with the
model's held-out density and KL from its attnlab_source.json when it is a sparse copy),
curves_{label}.csv (every sweep) and padding_{label}.csv. ``figure`` gathers them into
heads.csv and draws heads_vs_density.png: heads to the threshold against the copy's density,
one panel per task, one line per ablation x ranking, the dense model at density 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))


def measure(args) -> None:
    """Every task of ``args`` not yet in heads_{label}.csv (a rerun resumes), each written as it ends."""
    from attnlab import io
    from attnlab.circuits import head_counts
    from attnlab.models import load_model
    from attnlab.tokenization import load_tokenizer
    from benchmarks.tools.harness import device_and_dtype, run_fields, timed

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {kind: out / f"{kind}_{args.label}.csv" for kind in ("heads", "curves", "padding")}
    done = {kind: pd.read_csv(path) if path.is_file() else pd.DataFrame() for kind, path in paths.items()}
    todo = [t for t in args.tasks if done["heads"].empty or t not in set(done["heads"]["task"])]
    if not todo:
        return
    device, dtype = device_and_dtype(args)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, device, dtype)
    info = _model_info(args.model)
    for task in todo:
        rows, curves = [], []
        for n in args.n:
            (found, sweeps), seconds = timed(lambda: head_counts.head_counts(
                model, tokenizer, task, n, args.seed, args.ablations, args.rankings, args.threshold,
                args.batch_size, args.all_k_up_to, args.log_points, args.mean_pool))
            rows += [{"label": args.label, **info, **row, "seconds": seconds, **run_fields(device, dtype)}
                     for row in found]
            curves.append(sweeps.assign(label=args.label))
        new = {"heads": pd.DataFrame(rows), "curves": pd.concat(curves, ignore_index=True)}
        if args.padding_check:
            new["padding"] = pd.DataFrame([{"label": args.label, **head_counts.padding_check(
                model, tokenizer, task, args.padding_n, args.seed, args.batch_size)}])
        for kind, frame in new.items():
            done[kind] = pd.concat([done[kind], frame], ignore_index=True)
            io.write_csv(done[kind], paths[kind])
        print(new["heads"][["task", "n_prompts", "ablation", "ranking", "heads_to_reach_threshold",
                            "crosses_back_below", "spearman_attribution_vs_exact"]].to_string(), flush=True)


def _model_info(model_dir: str) -> dict:
    """Held-out density and KL of a sparse copy (its attnlab_source.json); density 1 for a dense model."""
    source = Path(model_dir) / "attnlab_source.json"
    summary = json.loads(source.read_text()).get("summary", {}) if source.is_file() else {}
    if "heldout_density" not in summary:
        return {"heldout_density": 1.0, "heldout_kl": 0.0}
    return {"heldout_density": summary["heldout_density"], "heldout_kl": summary["heldout_kl"],
            "gate_bias": json.dumps(summary.get("inference_gate_bias")), "tokens": summary.get("tokens")}


def figure(args) -> None:
    from attnlab import io
    from attnlab.plots.circuits import plot_heads_vs_density

    out = Path(args.out)
    table = pd.concat([pd.read_csv(p) for p in sorted(out.glob("heads_*.csv"))], ignore_index=True)
    io.write_csv(table, out / "heads.csv")
    plot_heads_vs_density(table, args.base, out / "heads_vs_density.png")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("measure")
    run.add_argument("--label", required=True)
    run.add_argument("--model", required=True, help="a prepared model folder (resources/models/...)")
    run.add_argument("--tasks", nargs="+", default=["ioi", "greater_than", "docstring", "ioi_long"])
    run.add_argument("--n", nargs="+", type=int, default=[24])
    run.add_argument("--ablations", nargs="+", default=["corrupted", "mean", "zero"])
    run.add_argument("--rankings", nargs="+", default=["attribution", "exact"])
    run.add_argument("--threshold", type=float, default=0.9)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--batch-size", type=int, default=64)
    run.add_argument("--all-k-up-to", type=int, default=300)
    run.add_argument("--log-points", type=int, default=40)
    run.add_argument("--mean-pool", type=int, default=256,
                     help="mean ablation: each template's mean over this many prompts drawn apart from the n")
    # the device and dtype options of common.add_device_arguments, named here so that `figure` needs no torch
    run.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    run.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16", "float16"),
                     help="weights' dtype (default float32: head counts comparable between devices)")
    run.add_argument("--padding-check", action="store_true")
    run.add_argument("--padding-n", type=int, default=8)
    run.add_argument("--out", required=True)
    run.set_defaults(func=measure)
    draw = commands.add_parser("figure")
    draw.add_argument("--out", required=True)
    draw.add_argument("--base", required=True, help="label of the dense model")
    draw.set_defaults(func=figure)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
