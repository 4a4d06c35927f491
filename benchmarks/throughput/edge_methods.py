"""EAP-IG, ACDC and Edge Pruning on one model's task, each through the workflow's own edge step.

    .venv/bin/python -m benchmarks.throughput.edge_methods [--config config/edge-methods.yaml]
                                            [--methods eap_ig acdc edge_pruning] [--threads 2]

On the config's edge model and task (config/edge-methods.yaml: Gemma-3-270M's IOI, 5,644 edges),
the prompts and the ranked/counted split are the workflow's (``groundtruth.pairs.prompts_for``
and ``tasks.split_for_ranking`` at pruning.seed, as score_heads makes them). Each method runs
``attnlab.steps.edges.edge_circuit``, the edge_circuit rule's own step, with the config's
pruning.edges settings and ``method`` set to it, into benchmarks/out/edge_methods/<method>/. For
each: the edges to the threshold and their interval (every method's order counted by the same
search on the same counted prompts), ACDC's and Edge Pruning's own circuit and its explained
effect with its interval, MIB's areas (CPR, CMD) of the curve with their intervals (on MIB's
sizes and on the measured grid), the seconds spent ordering the edges and sweeping, and ACDC's
forwards and Edge Pruning's steps. Written to ``edge_methods_<methods>.json`` (the run's device,
threads, versions and commit beside them).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import pandas as pd
import torch
import yaml

from attnlab import io
from attnlab.circuits.areas import curve_areas
from attnlab.circuits.curves import resample_draws
from attnlab.config.schema import validate_config
from attnlab.config.settings import edge_params
from attnlab.config.validate import SCHEMA
from attnlab.groundtruth.pairs import prompts_for
from attnlab.patching.tasks import split_for_ranking
from attnlab.steps.edges import edge_circuit
from attnlab.tokenization import load_tokenizer
from benchmarks.tools.harness import OUT, REPO, embedded_model, write_result

METHODS = ("eap_ig", "acdc", "edge_pruning")
KEPT = ("method", "ranking", "edges", "edges_to_reach_threshold", "edges_to_reach_exact", "edges_interval",
        "fragile", "method_circuit", "method_circuit_effect", "method_circuit_effect_interval", "score_s",
        "sweep_s", "points", "acdc_forwards", "acdc_tried", "acdc_skipped", "edge_pruning_steps",
        "edge_pruning_expected_sparsity", "clean_metric", "corrupted_metric")


def prepared_inputs(config: dict, model: str, task: str, folder: Path) -> tuple[Path, Path, Path]:
    """The model's folder and the task's prompts and split as score_heads writes them."""
    pruning = config["pruning"]
    model_dir = embedded_model(model)
    prompts = prompts_for(task, load_tokenizer(model_dir), pruning["tasks"][task]["n"], pruning["seed"], model_dir)
    ranked_on, counted_on = split_for_ranking(len(prompts.clean), pruning["rank_share"], pruning["seed"])
    folder.mkdir(parents=True, exist_ok=True)
    io.write_json(dataclasses.asdict(prompts), folder / "prompts.json")
    io.write_json({"ranked_on": ranked_on, "counted_on": counted_on, "rank_share": pruning["rank_share"]},
                  folder / "scores.json")
    return model_dir, folder / "prompts.json", folder / "scores.json"


def run_method(config: dict, method: str, inputs: tuple[Path, Path, Path], task: str, folder: Path,
               threads: int) -> dict:
    """One method through ``edge_circuit``; its summary's numbers and its curve's areas."""
    pruning = config["pruning"]
    settings = edge_params({**pruning, "edges": {**pruning["edges"], "method": method}})
    out = folder / method
    out.mkdir(parents=True, exist_ok=True)
    outputs = {name: str(out / file) for name, file in (("edges", "edges.parquet"), ("curve", "curve.csv"),
                                                         ("per_prompt", "per_prompt.parquet"),
                                                         ("summary", "summary.json"))}
    started = time.perf_counter()
    edge_circuit(str(inputs[0]), task, settings, str(inputs[1]), str(inputs[2]), outputs, threads)
    wall = time.perf_counter() - started
    summary = io.read_json(outputs["summary"])
    per_prompt = pd.read_parquet(outputs["per_prompt"]).rename(columns={"edges_kept": "heads_kept"})
    bootstrap = pruning["bootstrap"]
    draws = resample_draws(per_prompt["prompt"].nunique(), bootstrap["n_resamples"], pruning["seed"])
    areas = curve_areas(per_prompt, summary["edges"], draws, bootstrap["confidence"])
    return {**{key: summary.get(key) for key in KEPT}, "wall_s": wall, "areas": areas}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "config" / "edge-methods.yaml")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT / "edge_methods")
    args = parser.parse_args()
    config = yaml.safe_load(args.config.read_text())
    validate_config(config, SCHEMA)  # the schema's defaults, as the workflow sees the config
    model, task = config["pruning"]["edges"]["models"][0], config["pruning"]["edges"]["tasks"][0]
    inputs = prepared_inputs(config, model, task, args.out / "inputs")
    torch.manual_seed(config["pruning"]["seed"])
    results = {method: run_method(config, method, inputs, task, args.out, args.threads) for method in args.methods}
    write_result({"config": str(args.config.relative_to(REPO)) if args.config.is_relative_to(REPO) else str(args.config),
                  "model": model, "task": task, "threads": args.threads, "threshold": config["pruning"]["threshold"],
                  "methods": results}, f"edge_methods_{'_'.join(args.methods)}.json", torch.device("cpu"), torch.float32)


if __name__ == "__main__":
    main()
