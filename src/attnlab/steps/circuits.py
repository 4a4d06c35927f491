"""Head scoring and pruning sweeps, sparse post-training, and their figures."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pandas as pd

from attnlab import io
from attnlab.settings import Scoring, Sweep
from attnlab.steps.common import _batch_size, _seed_everything, log


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
    from attnlab.curves import crossing, flag_fragile_counts, fragility, heads_vs_density_table
    from attnlab.plots_circuits import plot_heads_vs_density

    sweeps = {tuple(key.split("/")): io.read_json(path) for key, path in sweep_paths.items()}
    curves = {tuple(key.split("/")): pd.read_csv(path) for key, path in curve_paths.items()}
    for key, curve in curves.items():  # from the curve: a sweep.json of older code meant less by "exact"
        sweeps[key].update(crossing(curve, sweeps[key]["threshold"]))
    densities = {model: io.read_json(path) for model, path in summary_paths.items()}
    table = heads_vs_density_table([tuple(pair) for pair in pairs], sweeps, densities, n_prompts)
    flags = {key: fragility(curve, sweeps[key]["threshold"]) for key, curve in curves.items()}
    table = flag_fragile_counts(table, flags)
    io.write_csv(table, table_path)
    with io.atomic_path(figure_path) as tmp:
        plot_heads_vs_density(table, "", tmp, dpi)


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
