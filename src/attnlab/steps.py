"""One function per workflow step: read inputs, call the library, write outputs.

The scripts under workflow/scripts/ are one call into this module each, so a
step can be run and tested without Snakemake.
"""

from __future__ import annotations

import logging
import sys
import time

import pandas as pd

from attnlab import io

log = logging.getLogger("attnlab")


def setup_logging(log_path: str | None = None) -> None:
    """Send stderr (tqdm bars, warnings, our logging) to the rule's log file."""
    if log_path:
        sys.stderr = open(log_path, "w", buffering=1)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _seed_everything(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def prepare_model(name: str, source: dict, out_dir: str) -> None:
    from attnlab.models import prepare_model as prepare

    prepare(name, source, out_dir)


def prepare_dataset(name: str, spec: dict, out_path: str) -> None:
    from attnlab.data import prepare_dataset as prepare

    io.write_parquet(prepare(name, spec), out_path)


def make_prompts(model_dir: str, dataset_path: str, out_path: str, condition_name: str,
                 condition: dict, prompt_cfg: dict, prompt_format: str) -> None:
    from attnlab.models import context_length, load_tokenizer
    from attnlab.prompts import make_prompts as build

    tokenizer = load_tokenizer(model_dir)
    questions = pd.read_parquet(dataset_path)
    prompts = build(tokenizer, questions, condition_name, condition, prompt_cfg,
                    prompt_format, context_length(model_dir))
    io.write_parquet(prompts, out_path)


def generate(model_dir: str, prompts_path: str, out_path: str, generation: dict,
             threads: int) -> None:
    import torch

    from attnlab.generation import check_context, generate_all
    from attnlab.models import context_length, load_model, load_tokenizer, pick_device, pick_dtype

    torch.set_num_threads(threads)
    _seed_everything(generation["seed"])
    prompts = pd.read_parquet(prompts_path)
    check_context(prompts, generation["max_new_tokens"], context_length(model_dir))
    device = pick_device(generation["device"])
    dtype = pick_dtype(generation["dtype"], device)
    log.info("device %s, dtype %s, batch size %d, greedy, %d new tokens at most",
             device, dtype, generation["batch_size"], generation["max_new_tokens"])
    model = load_model(model_dir, device, dtype)
    tokenizer = load_tokenizer(model_dir)
    started = time.perf_counter()
    out = generate_all(model, tokenizer, prompts, generation["batch_size"],
                       generation["max_new_tokens"], generation["stop_strings"])
    elapsed = time.perf_counter() - started
    log.info("%d new tokens in %.1f s (%.1f tokens/s)", out["n_new_tokens"].sum(), elapsed,
             out["n_new_tokens"].sum() / max(elapsed, 1e-9))
    out["device"], out["dtype"], out["decoding"] = str(device), str(dtype), "greedy"
    io.write_parquet(out, out_path)


def grade(prompts_path: str, generations_path: str, items_path: str, summary_path: str,
          keys: dict, grading: dict) -> None:
    from attnlab.grading import grade_items, summarise

    graded = grade_items(pd.read_parquet(prompts_path), pd.read_parquet(generations_path),
                         grading["fallback"])
    summary = {**keys, **summarise(graded, grading["bootstrap"])}
    log.info("%s: math-verify %.1f%%, lenient %.1f%% (n=%d)", keys,
             summary["math_verify_acc"], summary["lenient_acc"], summary["n"])
    io.write_csv(graded, items_path)
    io.write_json(summary, summary_path)


def accuracy_table(summary_paths: list[str], out_path: str) -> None:
    table = pd.DataFrame([io.read_json(p) for p in summary_paths])
    io.write_csv(table.sort_values(["dataset", "model", "condition"]), out_path)


def plot_accuracy(summary_paths: list[str], out_path: str, dataset: str, models: list[str],
                  conditions: list[str], dpi: int) -> None:
    from attnlab.plots import plot_accuracy as plot

    table = pd.DataFrame([io.read_json(p) for p in summary_paths])
    plot(table, dataset, models, conditions, out_path, dpi)
