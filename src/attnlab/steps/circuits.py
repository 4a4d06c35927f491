"""Head scoring and pruning sweeps, sparse post-training, and their figures."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pandas as pd

from attnlab import io
from attnlab.config.settings import Scoring, Sweep
from attnlab.steps.common import _batch_size, _seed_everything, log


def score_heads(model_dir: str, task: str, settings: dict, prompts_path: str, scores_path: str,
                summary_path: str, threads: int, batch_size: int | None = None) -> None:
    """Generate the task for this tokenizer, draw the prompts heads are ranked on (the rest are
    for the sweep), then score every head on those: attribution, and exact patching."""
    import torch
    from scipy.stats import spearmanr

    from attnlab.groundtruth.pairs import prompts_for
    from attnlab.models import load_model, pick_device
    from attnlab.patching.heads import Patcher, build_batch
    from attnlab.patching.tasks import split_for_ranking, subset
    from attnlab.tokenization import load_tokenizer

    settings = Scoring(**settings)
    torch.set_num_threads(threads)
    _seed_everything(settings.seed)
    tokenizer = load_tokenizer(model_dir)
    prompts = prompts_for(task, tokenizer, settings.n, settings.seed, model_dir)
    io.write_json(dataclasses.asdict(prompts), prompts_path)
    ranked_on, counted_on = split_for_ranking(len(prompts.clean), settings.rank_share, settings.seed)
    model = load_model(model_dir, pick_device(settings.device), torch.float32)
    patcher = Patcher(model, build_batch(subset(prompts, ranked_on), tokenizer), settings.ablation,
                      _batch_size(settings.batch_size, batch_size))
    clean, corrupted = patcher.metric(), patcher.corrupted_metric()
    log.info("%s: clean metric %.3f, corrupted %.3f (%d prompts ranked on, %d counted on)", task, clean,
             corrupted, len(ranked_on), len(counted_on))
    started = time.perf_counter()
    attribution = patcher.attribution()
    timings = {"attribution_s": time.perf_counter() - started}
    layers, heads = attribution.shape
    scores = pd.DataFrame({"layer": np.repeat(np.arange(layers), heads), "head": np.tile(np.arange(heads), layers),
                           "attribution": attribution.flatten().numpy()})
    # the metrics are the ranked prompts'; n_prompts counts every pair generated
    summary = {"task": task, "n_prompts": len(prompts.clean), "n_prompts_ranked_on": len(ranked_on),
               "clean_metric": clean,
               "corrupted_metric": corrupted, "ablation": settings.ablation,
               "ranking": settings.ranking, **prompts.info, "rank_share": settings.rank_share,
               "ranked_on": ranked_on, "counted_on": counted_on}
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
                scoring_path: str, outputs: dict, threads: int, batch_size: int | None = None) -> None:
    """On the prompts heads were not ranked on: keep the top-k heads of each ranking scored,
    ablate the rest, for every k of the grid; for the configured ranking also every k around the
    first crossing of the threshold and just below each end of its bootstrap interval, found by
    rounds or by search (``_head_count``); the other ranking's count is the grid's (an upper
    bound). ``outputs``: sweep (curves), per_prompt (each prompt's metric at each k), summary."""
    import torch

    from attnlab.circuits.counting import Bootstrap, prompts_digest
    from attnlab.models import load_model, pick_device
    from attnlab.patching.heads import Patcher, build_batch
    from attnlab.patching.tasks import TaskPrompts, subset
    from attnlab.tokenization import load_tokenizer

    settings = Sweep(**settings)
    torch.set_num_threads(threads)
    _seed_everything(settings.seed)
    tokenizer = load_tokenizer(model_dir)
    scoring = io.read_json(scoring_path)
    counted = subset(TaskPrompts(**io.read_json(prompts_path)), scoring["counted_on"])
    model = load_model(model_dir, pick_device(settings.device), torch.float32)
    patcher = Patcher(model, build_batch(counted, tokenizer), settings.ablation,
                      _batch_size(settings.batch_size, batch_size))
    scores = pd.read_csv(scores_path)
    rankings = [settings.ranking, *(r for r in ("exact", "attribution") if r in scores and r != settings.ranking)]
    bootstrap = Bootstrap(settings.bootstrap["n_resamples"], settings.bootstrap["confidence"], settings.seed)
    started, counts = time.perf_counter(), {}
    for ranking in rankings:
        order = list(scores.sort_values(ranking, ascending=False, kind="stable")[["layer", "head"]]
                     .itertuples(index=False, name=None))
        counts[ranking] = _head_count(patcher, [(int(l), int(h)) for l, h in order], settings, bootstrap,
                                      scoring["counted_on"], configured=ranking == settings.ranking)
    elapsed = time.perf_counter() - started
    primary = counts[settings.ranking]
    io.write_csv(pd.concat([c.curve.assign(ranking=r) for r, c in counts.items()], ignore_index=True),
                 outputs["sweep"])
    io.write_parquet(pd.concat([c.per_prompt.assign(ranking=r) for r, c in counts.items()], ignore_index=True),
                     outputs["per_prompt"])
    io.write_json({"task": task, "heads": len(scores), "sweep_s": elapsed, "points": len(primary.curve),
                   "refined_points": int(primary.curve["refined"].sum()), "threshold": settings.threshold,
                   **primary.summary, "ablation": settings.ablation, "ranking": settings.ranking,
                   "interval_confidence": bootstrap.confidence, "bootstrap_resamples": bootstrap.n_resamples,
                   "n_prompts_ranked_on": len(scoring["ranked_on"]), "n_prompts_counted_on": len(counted.clean),
                   "rank_share": scoring["rank_share"],
                   "counted_prompts_digest": prompts_digest(counted.clean, counted.corrupted),
                   "spearman_attribution_vs_exact": scoring.get("spearman_attribution_vs_exact"),
                   "rankings": {r: _ranking_summary(c.summary) for r, c in counts.items()}},
                  outputs["summary"])


def _head_count(patcher, order, settings: Sweep, bootstrap, counted_on: list[int], configured: bool):
    """One ranking's sweep. rounds: the grid (every k up to all_k_up_to, else log_points), for
    the configured ranking refined at the first crossing and below the interval's ends
    (``counting.count_heads``). bisection: the configured ranking searched from a coarse grid
    with that grid as the fine one (``crossing_search``), any other ranking on the coarse grid."""
    from attnlab.circuits.counting import count_heads
    from attnlab.circuits.crossing_search import searched_count
    from attnlab.circuits.curves import k_grid

    grid = k_grid(len(order), settings.all_k_up_to, settings.log_points)
    if settings.search == "bisection":
        coarse = k_grid(len(order), 0, settings.coarse_points)
        if configured:
            return searched_count(patcher, order, coarse, grid, settings.threshold, bootstrap, counted_on,
                                  settings.log_points)
        return count_heads(patcher, order, coarse, settings.threshold, bootstrap, counted_on, 0, refine=False)
    return count_heads(patcher, order, grid, settings.threshold, bootstrap, counted_on,
                       settings.log_points if configured else 0, refine=configured)


def _ranking_summary(summary: dict) -> dict:
    keys = ("heads_to_reach_threshold", "heads_to_reach_exact", "unmeasured_below", "heads_interval",
            "interval_to_the_head", "fragile", "fragile_reasons", "max_explained_effect")
    return {key: summary[key] for key in keys}


def plot_pruning(inputs: dict[str, dict[str, str]], out_path: str, task: str, compare, threshold: float,
                 ablation: str, ranking: str, bootstrap: dict, dpi: int, unit: str = "heads") -> None:
    """The pruning figure of one task from each model's sweep (``inputs[model]``: sweep, summary,
    per_prompt), the configured ranking's curves, with every count's and N×'s interval; ``unit``
    "edges": edge sweeps (one ranking each, which ``ranking`` names)."""
    from attnlab.config.plan import comparison_pairs
    from attnlab.plots.circuits import plot_pruning as plot

    read = {model: _read_sweep(paths, ranking, unit) for model, paths in inputs.items()}
    ratios = {}
    for first, second in comparison_pairs(compare, list(inputs)):
        if first in read and second in read:  # a compared model without a sweep here has no N× (edges of one model)
            ratios[(first, second)] = _ratio(read[first], read[second], threshold, bootstrap)
    plot({m: r.curve for m, r in read.items()}, task, compare, threshold, ablation, ranking, out_path, dpi,
         {m: r.summary for m, r in read.items()}, ratios, unit)


@dataclasses.dataclass
class _Swept:
    """One model x task sweep as the figures read it: one ranking's curve and per-prompt metrics
    and its sweep.json."""

    curve: pd.DataFrame
    summary: dict
    per_prompt: pd.DataFrame


def _read_sweep(paths: dict[str, str], ranking: str | None = None, unit: str = "heads") -> _Swept:
    """``paths``: sweep (curves), summary (sweep.json), per_prompt; ``ranking``: the summary's own
    when None. ``unit`` "edges": an edge sweep (one ranking), its "edges" named "heads" as the
    counting and the figures read them."""
    from attnlab.circuits.curves import renamed_unit

    summary = renamed_unit(io.read_json(paths["summary"]), unit, "heads")
    curve = renamed_unit(pd.read_csv(paths["sweep"]), unit, "heads")
    rows = renamed_unit(io.read_parquet(paths["per_prompt"]), unit, "heads")
    if unit == "edges":
        return _Swept(curve, summary, rows)
    ranking = ranking or summary["ranking"]
    return _Swept(curve[curve["ranking"] == ranking].reset_index(drop=True), summary,
                  rows[rows["ranking"] == ranking])


def _ratio(first: _Swept, second: _Swept, threshold: float, bootstrap: dict) -> dict:
    """The bootstrap interval of first's count / second's, paired where both were counted on the
    same prompts."""
    from attnlab.circuits.counting import Bootstrap, ratio_between

    paired = first.summary.get("counted_prompts_digest") == second.summary.get("counted_prompts_digest")
    return ratio_between(first.per_prompt, second.per_prompt, paired, threshold,
                         Bootstrap(bootstrap["n_resamples"], bootstrap["confidence"], bootstrap["seed"]))


def heads_vs_density(sweep_paths: dict[str, str], curve_paths: dict[str, str],
                     per_prompt_paths: dict[str, str], summary_paths: dict[str, str], pairs: list,
                     n_prompts: dict[str, int], bootstrap: dict, table_path: str, figure_path: str,
                     dpi: int, unit: str = "heads") -> None:
    """Each dense model's heads (``unit``: or edges) to the threshold beside its sparse copies'
    (sweep_paths keyed "model/task"), against the copies' held-out density (their summary.json);
    whether each count, and so each N×, is fragile comes from the sweep's curve (curve_paths,
    same keys), and each N×'s interval from both sweeps' per-prompt metrics (per_prompt_paths,
    paired)."""
    from attnlab.circuits.curves import (crossing, flag_fragile_counts, fragility, heads_vs_density_table,
                                         renamed_unit)
    from attnlab.plots.circuits import plot_heads_vs_density

    read = {tuple(key.split("/")): _read_sweep({"sweep": curve_paths[key], "summary": path,
                                                "per_prompt": per_prompt_paths[key]}, unit=unit)
            for key, path in sweep_paths.items()}
    # the counts from the curve: a sweep.json of older code meant less by "exact"
    sweeps = {key: {**r.summary, **crossing(r.curve, r.summary["threshold"])} for key, r in read.items()}
    densities = {model: io.read_json(path) for model, path in summary_paths.items()}
    table = heads_vs_density_table([tuple(pair) for pair in pairs], sweeps, densities, n_prompts)
    flags = {key: fragility(r.curve, r.summary["threshold"]) for key, r in read.items()}
    table = flag_fragile_counts(table, flags)
    intervals = [sweeps[(row.label, row.task)].get("heads_interval", [None, None]) for row in table.itertuples()]
    ratios = [None if row.label == row.base else
              _ratio(read[(row.base, row.task)], read[(row.label, row.task)], row.threshold, bootstrap)
              for row in table.itertuples()]
    table = table.assign(heads_low=[i[0] for i in intervals], heads_high=[i[1] for i in intervals],
                         heads_fewer_low=[r and r["low"] for r in ratios],
                         heads_fewer_high=[r and r["high"] for r in ratios],
                         heads_fewer_paired=[r and r["paired"] for r in ratios])
    io.write_csv(renamed_unit(table, "heads", unit), table_path)
    plot_heads_vs_density(table, "", figure_path, dpi, unit)


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
    from attnlab.plots.circuits import plot_sparse_density, plot_sparse_training

    summary = io.read_json(inputs["summary"])
    plot_sparse_training(pd.read_csv(inputs["steps"]), pd.read_csv(inputs["evals"]), summary, model,
                         training_path, dpi)
    plot_sparse_density(pd.read_csv(inputs["density"]), summary, model, density_path, dpi)
