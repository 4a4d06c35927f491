"""Generation, grading and the accuracy tables and figures."""

from __future__ import annotations

import time

import pandas as pd

from attnlab import io
from attnlab.config.settings import Generation
from attnlab.steps.common import (_arm, _batch_size, _ordered, _read_summaries, _seed_everything, log, log_cost_estimate,
                                   log_replaced_rows)


def generate(model_dir: str, prompts_path: str, out_path: str, generation: dict,
             threads: int, arm: dict | None = None, batch_size: int | None = None) -> None:
    import torch

    from attnlab.interventions import intervened
    from attnlab.models import load_model, pick_device, pick_dtype
    from attnlab.reasoning.generation import check_context, generate_all
    from attnlab.tokenization import context_length, load_tokenizer

    generation = Generation(**generation)
    torch.set_num_threads(threads)
    _seed_everything(generation.seed)
    batch_size = _batch_size(generation.batch_size, batch_size)
    prompts = io.read_parquet(prompts_path)
    check_context(prompts, generation.max_new_tokens, context_length(model_dir))
    device = pick_device(generation.device)
    dtype = pick_dtype(generation.dtype, device)
    log.info("device %s, dtype %s, batch size %d, greedy, %d new tokens at most",
             device, dtype, batch_size, generation.max_new_tokens)
    log_cost_estimate("generation", model_dir, {"prompts": len(prompts), "batch": min(batch_size, len(prompts)),
                                                "new_tokens": generation.max_new_tokens,
                                                "prompt_tokens": int(prompts["n_prompt_tokens"].max())}, dtype, device)
    model = load_model(model_dir, device, dtype)
    tokenizer = load_tokenizer(model_dir)
    started = time.perf_counter()
    with intervened(model, arm=_arm(arm)):
        out = generate_all(model, tokenizer, prompts, batch_size, generation.max_new_tokens,
                           generation.stop_strings, generation.engine)
    elapsed = time.perf_counter() - started
    log.info("%d new tokens in %.1f s (%.1f tokens/s)", out["n_new_tokens"].sum(), elapsed,
             out["n_new_tokens"].sum() / max(elapsed, 1e-9))
    out["device"], out["dtype"], out["decoding"] = str(device), str(dtype), "greedy"
    io.write_parquet(out, out_path)


def grade(prompts_path: str, generations_path: str, items_path: str, summary_path: str,
          keys: dict, grading: dict) -> None:
    from attnlab.reasoning.grading import grade_items, summarise

    graded = grade_items(io.read_parquet(prompts_path), io.read_parquet(generations_path),
                         grading["fallback"])
    summary = {**keys, **summarise(graded, grading["confidence"])}
    log.info("%s: math-verify %.1f%%, lenient %.1f%% (%d of them substring-only matches; n=%d)", keys,
             summary["math_verify_acc"], summary["lenient_acc"], summary["lenient_substring_only"],
             summary["n"])
    io.write_csv(graded, items_path)
    io.write_json(summary, summary_path)


def accuracy_table(summary_paths: list[str], out_path: str, config: str = "") -> None:
    """Every cell of this run, each row naming the ``config`` it ran under; the log lists the rows
    of the previous table (another config's, say) this one no longer holds or holds rewritten."""
    keys = ["model", "dataset", "condition"]
    table = _ordered(_read_summaries(summary_paths), keys)
    table.insert(0, "config", config)
    table = table.sort_values(["dataset", "model"], kind="stable")
    log_replaced_rows(table, out_path, keys)
    io.write_csv(table, out_path)


def accuracy_paired(item_paths: list[str], out_path: str, baseline: str, confidence: float, config: str = "") -> None:
    """Every condition against ``baseline`` on the same items, per model × dataset × grader
    (``attnlab.reasoning.paired``), for the cells given (one dataset's in the workflow); empty (with its
    columns) where no cell has the baseline."""
    from attnlab.reasoning.grading import GRADERS
    from attnlab.reasoning.paired import paired_rows

    cells: dict[tuple[str, str], dict[str, pd.DataFrame]] = {}
    for path in item_paths:  # results/grades/{model}/{dataset}/{condition}.csv
        parts = path.split("/")
        cells.setdefault((parts[-3], parts[-2]), {})[parts[-1].removesuffix(".csv")] = \
            pd.read_csv(path, usecols=["id", *GRADERS], dtype={"id": str})
    tables = []
    for (model, dataset), items in cells.items():
        if baseline not in items or len(items) < 2:
            log.info("%s on %s: no paired comparison (baseline %r %s)", model, dataset, baseline,
                     "missing" if baseline not in items else "alone")
            continue
        rows = paired_rows(items, baseline, GRADERS, confidence)
        rows.insert(0, "dataset", dataset)
        rows.insert(0, "model", model)
        tables.append(rows)
    table = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=PAIRED_COLUMNS)
    table.insert(0, "config", config)
    log_replaced_rows(table, out_path, ["model", "dataset", "condition", "grader"])
    io.write_csv(table, out_path)


PAIRED_COLUMNS = ["model", "dataset", "condition", "baseline", "grader", "n_paired", "both_correct", "treated_only",
                  "baseline_only", "neither", "difference_pts", "ci_low_pts", "ci_high_pts", "mcnemar_p", "holm_p"]


def plot_accuracy(summary_paths: list[str], out_path: str, dataset: str, models: list[str],
                  conditions: list[str], dpi: int, paired_path: str | None = None) -> None:
    from attnlab.plots.base import plot_accuracy as plot

    table = _read_summaries(summary_paths)
    paired = None
    if paired_path is not None:
        paired = pd.read_csv(paired_path)
    plot(table, dataset, models, conditions, out_path, dpi, paired)


def plot_length_sweep(summary_paths: list[str], out_path: str, model: str, dataset: str,
                      families: dict, dpi: int) -> None:
    from attnlab.plots.base import plot_length_sweep as plot

    table = _read_summaries(summary_paths)
    plot(table, families, model, dataset, out_path, dpi)


def placement_table(summary_paths: list[str], placements: dict, out_path: str) -> None:
    """Accuracy of every non-ARM condition with its inserted kind, length and placement."""
    table = _read_summaries(summary_paths)
    table = table[table["condition"].isin(list(placements))]
    info = pd.DataFrame([{"condition": c, **p} for c, p in placements.items()])
    info["family"] = info["family"].fillna("none")
    table = info.merge(table, on="condition", validate="1:m")
    keys = ["dataset", "model", "family", "length", "placement", "condition"]
    table = _ordered(table, keys)
    io.write_csv(table.sort_values(keys[:4], kind="stable"), out_path)


def plot_placement(table_path: str, out_path: str, dataset: str, models: list[str], dpi: int) -> None:
    from attnlab.plots.base import plot_placement as plot

    table = pd.read_csv(table_path)
    plot(table[table["dataset"] == dataset], dataset, models, out_path, dpi)
