"""One function per workflow step: read inputs, call the library, write outputs.

The scripts under workflow/scripts/ are one call into this module each, so a
step can be run and tested without Snakemake.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time

import numpy as np
import pandas as pd

from attnlab import io
from attnlab.settings import Extraction, Generation, MlpAnalysis, Scoring, Sweep

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


def prepare_model(name: str, source: dict, out_dir: str, prompt_format: str | None = None) -> None:
    from attnlab.models import prepare_model as prepare

    prepare(name, source, out_dir, prompt_format)


def prepare_dataset(name: str, spec: dict, out_path: str) -> None:
    from attnlab.data import prepare_dataset as prepare

    io.write_parquet(prepare(name, spec), out_path)


def prepare_fewshot(name: str, spec: dict, evaluated_path: str, out_path: str, seed: int) -> None:
    from attnlab.data import fewshot_pool
    from attnlab.plan import FEWSHOT_POOL

    pool = fewshot_pool(name, spec, io.read_parquet(evaluated_path), FEWSHOT_POOL, seed)
    io.write_parquet(pool, out_path)


def make_prompts(model_dir: str, dataset_path: str, out_path: str, condition_name: str,
                 condition: dict, prompt_cfg: dict, prompt_format: str, fewshot: int = 0,
                 fewshot_path: str | None = None) -> None:
    from attnlab.models import context_length, load_tokenizer
    from attnlab.prompts import make_prompts as build

    tokenizer = load_tokenizer(model_dir)
    questions = io.read_parquet(dataset_path)
    examples = io.read_parquet(fewshot_path).head(fewshot) if fewshot else None
    if examples is not None and len(examples) < fewshot:
        log.warning("only %d of %d few-shot examples available", len(examples), fewshot)
    prompts = build(tokenizer, questions, condition_name, condition, prompt_cfg,
                    prompt_format, context_length(model_dir), examples)
    io.write_parquet(prompts, out_path)


def _batch_size(configured: int, given: int | None) -> int:
    """The batch this attempt uses: Snakemake halves it for each retry (resources.batch_size)."""
    batch = given or configured
    if batch < configured:
        log.warning("batch size %d (configured %d, halved for a retry after running out of memory)",
                    batch, configured)
    limit = os.environ.get("ATTNLAB_TEST_OOM_ABOVE_BATCH")  # fault injection for the retry test
    if limit and batch > int(limit):
        raise MemoryError(f"simulated out-of-memory at batch size {batch} "
                          f"(ATTNLAB_TEST_OOM_ABOVE_BATCH={limit})")
    return batch


def _arm(arm: dict | None):
    from attnlab.mlp import ArmSettings

    return ArmSettings(**arm) if arm else None


def generate(model_dir: str, prompts_path: str, out_path: str, generation: dict,
             threads: int, arm: dict | None = None, batch_size: int | None = None) -> None:
    import torch

    from attnlab.generation import check_context, generate_all
    from attnlab.interventions import intervened
    from attnlab.models import context_length, load_model, load_tokenizer, pick_device, pick_dtype

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
    from attnlab.grading import grade_items, summarise

    graded = grade_items(io.read_parquet(prompts_path), io.read_parquet(generations_path),
                         grading["fallback"])
    summary = {**keys, **summarise(graded, grading["bootstrap"])}
    log.info("%s: math-verify %.1f%%, lenient %.1f%% (%d of them substring-only matches; n=%d)", keys,
             summary["math_verify_acc"], summary["lenient_acc"], summary["lenient_substring_only"],
             summary["n"])
    io.write_csv(graded, items_path)
    io.write_json(summary, summary_path)


def _read_summaries(paths: list[str]) -> pd.DataFrame:
    """One row per graded model x dataset x condition cell."""
    return pd.DataFrame([io.read_json(p) for p in paths])


# Summary keys added after the tables' first release: last, so every earlier column keeps
# its position (the summaries' sorted keys would put them among the lenient_* columns).
LATER_COLUMNS = ("lenient_substring_only", "lenient_exact_acc")


def _ordered(table: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """``keys`` first, then the other columns as read, LATER_COLUMNS last."""
    later = [c for c in LATER_COLUMNS if c in table.columns]
    return table[keys + [c for c in table.columns if c not in keys and c not in later] + later]


def accuracy_table(summary_paths: list[str], out_path: str) -> None:
    keys = ["model", "dataset", "condition"]
    table = _ordered(_read_summaries(summary_paths), keys)
    io.write_csv(table.sort_values(["dataset", "model"], kind="stable"), out_path)


def plot_accuracy(summary_paths: list[str], out_path: str, dataset: str, models: list[str],
                  conditions: list[str], dpi: int) -> None:
    from attnlab.plots import plot_accuracy as plot

    table = _read_summaries(summary_paths)
    plot(table, dataset, models, conditions, out_path, dpi)


def _model_and_prompts(model_dir: str, prompts_path: str, settings: Extraction | MlpAnalysis):
    """The first ``max_prompts`` prompts, and the model on the configured device and dtype."""
    from attnlab.models import load_model, pick_device, pick_dtype

    prompts = io.read_parquet(prompts_path)
    if settings.max_prompts:
        prompts = prompts.head(settings.max_prompts)
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    return load_model(model_dir, device, dtype), prompts, device, dtype


def extract_attention(model_dir: str, prompts_path: str, out_path: str, settings: dict,
                      attrs: dict, threads: int, arm: dict | None = None,
                      batch_size: int | None = None) -> None:
    import torch

    from attnlab.extraction import extract, write_attention
    from attnlab.interventions import intervened

    settings = Extraction(**settings)
    torch.set_num_threads(threads)
    batch_size = _batch_size(settings.batch_size, batch_size)
    model, prompts, device, dtype = _model_and_prompts(model_dir, prompts_path, settings)
    log.info("extracting %d prompts on %s (%s), batch size %d", len(prompts), device, dtype, batch_size)
    started = time.perf_counter()
    with intervened(model, arm=_arm(arm)):
        extraction = extract(model, prompts, batch_size, settings.full_map_layers)
    elapsed = time.perf_counter() - started
    log.info("%d tokens in %.1f s (%.0f tokens/s)", prompts["n_prompt_tokens"].sum(), elapsed,
             prompts["n_prompt_tokens"].sum() / max(elapsed, 1e-9))
    import hashlib

    # The class ("TokenizersBackend" for every model under transformers 5) cannot tell two
    # tokenizers apart: record where it was loaded from and a hash of its vocabulary and rules.
    tokenizer_config = io.read_json(f"{model_dir}/tokenizer_config.json")
    tokenizer_json = os.path.join(model_dir, "tokenizer.json")
    digest = "no tokenizer.json"
    if os.path.exists(tokenizer_json):
        with open(tokenizer_json, "rb") as handle:
            digest = hashlib.sha256(handle.read()).hexdigest()
    write_attention(out_path, extraction, prompts, {
        **attrs, "arm": arm or {}, "tokenizer": str(model_dir), "tokenizer_sha256": digest,
        "tokenizer_class": tokenizer_config.get("tokenizer_class", "unknown"),
        "dtype": str(dtype), "device": str(device)})


def plot_attention_head(paths: dict[str, str], out_path: str, model: str, dataset: str,
                        layer: int, head: int, plot: dict, dpi: int) -> None:
    from attnlab.attention_analysis import read_head
    from attnlab.plots import plot_attention_head as plot_head

    per_condition = {condition: read_head(path, layer, head) for condition, path in paths.items()}
    plot_head(per_condition, model, dataset, layer, head, out_path, plot["drop_first"],
              plot["per_prompt"], dpi)


def plot_attention_figure(figure: dict, paths: list[str], out_path: str, plot: dict, dpi: int) -> None:
    """One composite figure; ``paths`` are the files ``plan.figure_files`` names, in its order."""
    from attnlab.attention_analysis import read_head
    from attnlab.plan import figure_files
    from attnlab.plots import plot_attention_figure as draw

    files = dict(zip(figure_files(figure), paths))
    panels = [{**panel, "per_condition": {
        condition: read_head(files[panel["model"], panel["dataset"], condition], panel["layer"],
                             panel["head"], key="attention.figures")
        for condition in figure["conditions"]}} for panel in figure["panels"]]
    draw(panels, figure["name"], figure["view"], figure["zoom"], out_path, plot["drop_first"],
         plot["per_prompt"], dpi)


def rank_attention_heads(paths: dict[str, str], table_path: str, figure_dir: str, model: str,
                         dataset: str, top: dict, plot: dict, ext: str, dpi: int) -> None:
    """Heads whose received attention changes most between two conditions, and their plots."""
    from pathlib import Path

    from attnlab.attention_analysis import head_change_scores

    first, second = top["between"]
    scores = head_change_scores(paths[first], paths[second], plot["drop_first"])
    scores.insert(0, "between", f"{first} vs {second}")
    io.write_csv(scores, table_path)
    with io.atomic_path(figure_dir, directory=True) as tmp:
        for rank, row in enumerate(scores.head(top["k"]).itertuples(), start=1):
            plot_attention_head(paths, str(Path(tmp) / f"rank{rank}_layer{row.layer}_head{row.head}.{ext}"),
                                model, dataset, row.layer, row.head, plot, dpi)


def lambda_summary(paths: dict[str, str], table_path: str, figure_path: str, keys: dict,
                   dpi: int) -> None:
    from attnlab.attention_analysis import lambda_table
    from attnlab.plots import plot_lambda_heatmap

    table = lambda_table(paths)
    for key, value in reversed(list(keys.items())):
        table.insert(0, key, value)
    io.write_csv(table, table_path)
    plot_lambda_heatmap(table, keys["model"], keys["dataset"], figure_path, dpi)


def score_heads(model_dir: str, task: str, settings: dict, prompts_path: str, scores_path: str,
                summary_path: str, threads: int, batch_size: int | None = None) -> None:
    """Generate the task for this tokenizer, then score every head."""
    import torch
    from scipy.stats import spearmanr

    from attnlab.models import load_model, load_tokenizer, pick_device
    from attnlab.pruning import Patcher, build_batch
    from attnlab.tasks import generate_task

    settings = Scoring(**settings)
    torch.set_num_threads(threads)
    _seed_everything(settings.seed)
    tokenizer = load_tokenizer(model_dir)
    prompts = generate_task(task, tokenizer, settings.n, settings.seed)
    io.write_json(dataclasses.asdict(prompts), prompts_path)
    model = load_model(model_dir, pick_device(settings.device), torch.float32)
    patcher = Patcher(model, build_batch(prompts, tokenizer), settings.ablation,
                      _batch_size(settings.batch_size, batch_size))
    clean, corrupted = patcher.metric(), patcher.corrupted_metric()
    log.info("%s: clean metric %.3f, corrupted %.3f (%d prompts)", task, clean, corrupted, len(prompts.clean))
    started = time.perf_counter()
    attribution = patcher.attribution()
    timings = {"attribution_s": time.perf_counter() - started}
    layers, heads = attribution.shape
    scores = pd.DataFrame({"layer": np.repeat(np.arange(layers), heads), "head": np.tile(np.arange(heads), layers),
                           "attribution": attribution.flatten().numpy()})
    summary = {"task": task, "n_prompts": len(prompts.clean), "clean_metric": clean,
               "corrupted_metric": corrupted, "ablation": settings.ablation,
               "ranking": settings.ranking, **prompts.info}
    if settings.exact or settings.ranking == "exact":
        started = time.perf_counter()
        scores["exact"] = patcher.exact().flatten().numpy()
        timings["exact_s"] = time.perf_counter() - started
        summary["spearman_attribution_vs_exact"] = float(spearmanr(scores["attribution"], scores["exact"]).statistic)
    ranking = scores[settings.ranking]
    scores["rank"] = ranking.rank(ascending=False, method="first").astype(int)
    io.write_csv(scores.sort_values("rank"), scores_path)
    io.write_json({**summary, **timings}, summary_path)


def sweep_heads(model_dir: str, task: str, settings: dict, prompts_path: str, scores_path: str,
                sweep_path: str, summary_path: str, threads: int, batch_size: int | None = None) -> None:
    """Keep the top-k heads, ablate the rest, for every k of the grid and every k around
    the first crossing of the threshold (so the heads needed to reach it are exact)."""
    import torch

    from attnlab.models import load_model, load_tokenizer, pick_device
    from attnlab.curves import crossing, fragility, k_grid
    from attnlab.pruning import Patcher, build_batch
    from attnlab.tasks import TaskPrompts

    settings = Sweep(**settings)
    torch.set_num_threads(threads)
    _seed_everything(settings.seed)
    tokenizer = load_tokenizer(model_dir)
    prompts = TaskPrompts(**io.read_json(prompts_path))
    model = load_model(model_dir, pick_device(settings.device), torch.float32)
    patcher = Patcher(model, build_batch(prompts, tokenizer), settings.ablation,
                      _batch_size(settings.batch_size, batch_size))
    scores = pd.read_csv(scores_path).sort_values("rank")
    order = list(zip(scores["layer"], scores["head"]))
    started = time.perf_counter()
    sweep = patcher.sweep(order, k_grid(len(order), settings.all_k_up_to, settings.log_points),
                          settings.threshold)
    elapsed = time.perf_counter() - started
    io.write_csv(sweep, sweep_path)
    io.write_json({"task": task, "heads": len(order), "sweep_s": elapsed, "points": len(sweep),
                   "refined_points": int(sweep["refined"].sum()), "threshold": settings.threshold,
                   **crossing(sweep, settings.threshold), **fragility(sweep, settings.threshold),
                   "ablation": settings.ablation, "ranking": settings.ranking}, summary_path)


def plot_pruning(sweep_paths: dict[str, str], out_path: str, task: str, compare, threshold: float,
                 ablation: str, ranking: str, dpi: int) -> None:
    from attnlab.plots_circuits import plot_pruning as plot

    sweeps = {model: pd.read_csv(path) for model, path in sweep_paths.items()}
    plot(sweeps, task, compare, threshold, ablation, ranking, out_path, dpi)


def heads_vs_density(sweep_paths: dict[str, str], curve_paths: dict[str, str],
                     summary_paths: dict[str, str], pairs: list, n_prompts: dict[str, int],
                     table_path: str, figure_path: str, dpi: int) -> None:
    """Each dense model's heads to the threshold beside its sparse copies' (sweep_paths keyed
    "model/task"), against the copies' held-out density (their summary.json); whether each
    count, and so each N×, is fragile comes from the sweep's curve (curve_paths, same keys)."""
    from attnlab.curves import flag_fragile_counts, fragility, heads_vs_density_table
    from attnlab.plots_circuits import plot_heads_vs_density

    sweeps = {tuple(key.split("/")): io.read_json(path) for key, path in sweep_paths.items()}
    densities = {model: io.read_json(path) for model, path in summary_paths.items()}
    table = heads_vs_density_table([tuple(pair) for pair in pairs], sweeps, densities, n_prompts)
    flags = {tuple(key.split("/")): fragility(pd.read_csv(path), sweeps[tuple(key.split("/"))]["threshold"])
             for key, path in curve_paths.items()}
    table = flag_fragile_counts(table, flags)
    io.write_csv(table, table_path)
    with io.atomic_path(figure_path) as tmp:
        plot_heads_vs_density(table, "", tmp, dpi)


def plot_length_sweep(summary_paths: list[str], out_path: str, model: str, dataset: str,
                      families: dict, dpi: int) -> None:
    from attnlab.plots import plot_length_sweep as plot

    table = _read_summaries(summary_paths)
    plot(table, families, model, dataset, out_path, dpi)


def mlp_activations(model_dir: str, prompts_path: str, stats_path: str, histogram_path: str,
                    settings: dict, threads: int, arm: dict | None = None,
                    batch_size: int | None = None) -> None:
    """Statistics and a histogram of one layer's MLP activation over the question tokens."""
    import torch

    from attnlab.interventions import intervened
    from attnlab.mlp import record_activations

    settings = MlpAnalysis(**settings)
    torch.set_num_threads(threads)
    batch_size = _batch_size(settings.batch_size, batch_size)
    model, prompts, device, dtype = _model_and_prompts(model_dir, prompts_path, settings)
    bins = settings.histogram
    edges = np.linspace(bins["low"], bins["high"], bins["bins"] + 1)
    log.info("layer %d MLP activations of %d prompts on %s (%s)", settings.layer, len(prompts),
             device, dtype)
    with intervened(model, arm=_arm(arm)):
        stats, histogram = record_activations(model, prompts, settings.layer, settings.near_zero,
                                              edges, batch_size)
    stats.insert(0, "id", prompts["id"].values)
    outside = histogram["count"].iloc[[0, -1]].sum() / histogram["count"].sum()
    log.info("near-zero share %.4f, L1 %.2f, Gini %.3f; %.2f%% of values outside the histogram range",
             stats["near_zero"].mean(), stats["l1"].mean(), stats["gini"].mean(), 100 * outside)
    io.write_csv(stats, stats_path)
    io.write_csv(histogram, histogram_path)


def mlp_summary(stats_paths: dict[str, str], histogram_paths: dict[str, str], table_path: str,
                figure_path: str, keys: dict, baseline: str, layer: int, near_zero: float,
                dpi: int) -> None:
    from attnlab.mlp import summarise_statistics
    from attnlab.plots import plot_mlp_histograms

    stats = {c: pd.read_csv(path) for c, path in stats_paths.items()}
    histograms = {c: pd.read_csv(path) for c, path in histogram_paths.items()}
    table = summarise_statistics(stats, baseline)
    for key, value in reversed(list({**keys, "layer": layer, "near_zero_threshold": near_zero}.items())):
        table.insert(0, key, value)
    io.write_csv(table, table_path)
    plot_mlp_histograms(histograms, table, baseline, keys["model"], keys["dataset"], layer,
                        near_zero, figure_path, dpi)


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
    from attnlab.plots import plot_placement as plot

    table = pd.read_csv(table_path)
    plot(table[table["dataset"] == dataset], dataset, models, out_path, dpi)


def sparsify_model(name: str, base_dir: str, settings: dict, outputs: dict, checkpoint: str,
                   threads: int) -> None:
    """Post-train the sparse copy of ``base_dir``; resumes from ``checkpoint`` when one is there."""
    from pathlib import Path

    import torch

    from attnlab.sparsify import Outputs, SparsifySettings, post_train, sparsify_device, write_outputs

    torch.set_num_threads(threads)
    settings = SparsifySettings.from_config(settings)
    device = sparsify_device(settings.device)
    log.info("post-training the sparse copy %s of %s on %s", name, base_dir, device)
    result = post_train(base_dir, name, settings, checkpoint, device)
    write_outputs(result, name, settings, Outputs(model_dir=outputs["model"], steps=outputs["steps"],
                                                  evals=outputs["evals"], density=outputs["density"],
                                                  summary=outputs["summary"]))
    summary = result.summary
    log.info("held-out: density %.4f, KL %.4f nats/token, CE dense %.4f, sparse %.4f; %.0f tokens/s",
             summary["heldout_density"], summary["heldout_kl"], summary["heldout_ce_dense"],
             summary["heldout_ce_sparse"], summary["tokens_per_s"])
    Path(checkpoint).unlink(missing_ok=True)  # the finished model supersedes it


def plot_sparsify(inputs: dict, training_path: str, density_path: str, model: str, dpi: int) -> None:
    from attnlab.plots_circuits import plot_sparse_density, plot_sparse_training

    summary = io.read_json(inputs["summary"])
    plot_sparse_training(pd.read_csv(inputs["steps"]), pd.read_csv(inputs["evals"]), summary, model,
                         training_path, dpi)
    plot_sparse_density(pd.read_csv(inputs["density"]), summary, model, density_path, dpi)
