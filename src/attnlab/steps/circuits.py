"""Head scoring and pruning sweeps, sparse post-training, and their figures."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pandas as pd

from attnlab import io
from attnlab.config.settings import Scoring, Sweep
from attnlab.patching.mean_reference import Identity, TaskMeans, model_fingerprint, read_means, write_means
from attnlab.steps.common import _batch_size, _seed_everything, log, log_cost_estimate


def score_heads(model_dir: str, task: str, settings: dict, prompts_path: str, scores_paths: dict[str, str],
                summary_path: str, threads: int, batch_size: int | None = None, means_path: str | None = None) -> None:
    """Generate the task for this tokenizer, draw the prompts heads are ranked on (the rest are
    for the sweeps), then score every head on those under each configured ablation
    (``scores_paths``: ablation -> its scores.csv): attribution, and exact patching. One job for
    every ablation: the prompts, the split and the model load are shared. Under mean ablation the
    reference is written to ``means_path`` too, for the mean sweep (``mean_reference``)."""
    import torch

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
    batch = build_batch(subset(prompts, ranked_on), tokenizer)
    size = _batch_size(settings.batch_size, batch_size)
    work = {"prompts": len(batch.clean), "batch": size, "tokens": int(batch.clean.shape[1]), "forwards": 4}
    for stage in ("head_attribution", "heads") if settings.runs_exact else ("head_attribution",):  # in turn
        log_cost_estimate(stage, model_dir, work, torch.float32, model.device, repeats=len(settings.ablations))
    means = None
    if "mean" in settings.ablations:
        if means_path is None:
            raise ValueError("score_heads: mean ablation is configured but no means_path was given to write "
                             "its reference to (the mean sweep reads it)")
        means = _task_means(model, task, prompts, tokenizer, size, settings.mean_pool, settings.seed, model_dir)
        write_means(means, _means_identity(task, settings, prompts, model_dir), means_path)
    by_ablation, metrics = {}, {}
    for ablation in settings.ablations:
        patcher = Patcher(model, batch, ablation, size, means=means.by_template if means else None)
        if not metrics:  # the unpatched model's, whatever the ablation
            metrics = {"clean_metric": patcher.metric(), "corrupted_metric": patcher.corrupted_metric()}
            log.info("%s: clean metric %.3f, corrupted %.3f (%d prompts ranked on, %d counted on)", task,
                     metrics["clean_metric"], metrics["corrupted_metric"], len(ranked_on), len(counted_on))
        scores, by_ablation[ablation] = _scored_heads(patcher, settings)
        io.write_csv(scores, scores_paths[ablation])
    # the metrics are the ranked prompts'; n_prompts counts every pair generated
    io.write_json({"task": task, "n_prompts": len(prompts.clean), "n_prompts_ranked_on": len(ranked_on),
                   **metrics, "ablations": list(settings.ablations), "ranking": settings.ranking, **prompts.info,
                   "rank_share": settings.rank_share, "ranked_on": ranked_on, "counted_on": counted_on,
                   **({"mean_over": means.described()} if means is not None else {}),
                   "by_ablation": by_ablation}, summary_path)


def _task_means(model, task: str, prompts, tokenizer, batch_size: int, pool: int, seed: int, model_dir) -> TaskMeans:
    """Each template's mean over a pool of ``pool`` prompts of the task drawn apart from ``prompts``
    (another seed, the task's own prompts dropped): a mean over prompts that hold the ablated one
    ablates it only in part (IOI's 4-5 prompts per template at n = 128: a fifth of the reference
    was the prompt's own activation). Taken once, in the scoring job: the mean sweep reads it."""
    from collections import Counter

    from attnlab.groundtruth.pairs import prompts_for
    from attnlab.patching.heads import held_apart_means
    from attnlab.patching.tasks import MEAN_POOL_SEED_OFFSET

    drawn = prompts_for(task, tokenizer, pool, seed + MEAN_POOL_SEED_OFFSET, model_dir)
    means, apart = held_apart_means(model, tokenizer, prompts, drawn, batch_size)
    return TaskMeans(means, len(apart.clean), min(Counter(apart.templates).values()), seed + MEAN_POOL_SEED_OFFSET)


def _means_identity(task: str, settings, prompts, model_dir: str) -> Identity:
    """What the task's mean reference is taken for: the scoring job writes it with this, the mean
    sweep refuses a file without it."""
    from attnlab.circuits.counting import prompts_digest

    return Identity(task, settings.mean_pool, settings.seed, prompts_digest(prompts.clean, prompts.corrupted),
                    model_fingerprint(model_dir))


def _scoring_means(means_path: str | None, task: str, settings: Sweep, prompts, model_dir: str, device) -> TaskMeans:
    """A mean sweep's reference: the scoring job's file, refused if taken for anything else."""
    if means_path is None:
        raise ValueError("sweep_heads: a mean sweep needs the scoring job's reference (means_path)")
    return read_means(means_path, _means_identity(task, settings, prompts, model_dir), device)


def _scored_heads(patcher, settings: Scoring) -> tuple[pd.DataFrame, dict]:
    """Every head's attribution and (when asked for) exact score under the patcher's ablation,
    ranked by the configured ranking, and what scoring took (seconds, the Spearman correlation
    of attribution and exact)."""
    from scipy.stats import spearmanr

    started = time.perf_counter()
    attribution = patcher.attribution()
    summary = {"attribution_s": time.perf_counter() - started}
    layers, heads = attribution.shape
    scores = pd.DataFrame({"layer": np.repeat(np.arange(layers), heads), "head": np.tile(np.arange(heads), layers),
                           "attribution": attribution.flatten().numpy()})
    if settings.runs_exact:
        started = time.perf_counter()
        scores["exact"] = patcher.exact().flatten().numpy()
        summary["exact_s"] = time.perf_counter() - started
        summary["spearman_attribution_vs_exact"] = float(spearmanr(scores["attribution"], scores["exact"]).statistic)
    scores["rank"] = scores[settings.ranking].rank(ascending=False, method="first").astype(int)
    return scores.sort_values("rank"), summary


def sweep_heads(model_dir: str, task: str, settings: dict, prompts_path: str, scores_path: str,
                scoring_path: str, outputs: dict, threads: int, batch_size: int | None = None,
                means_path: str | None = None) -> None:
    """On the prompts heads were not ranked on, under ``settings["ablation"]`` (its scores: ``scores_path``):
    keep the top-k heads of each ranking scored, ablate the rest, for every k of the grid; for the configured
    ranking also every k around the first crossing of the threshold and just below each end of its bootstrap
    interval, found by rounds or by search (``_head_count``); the other ranking's count is the grid's (an upper
    bound). The unpatched model's metric on each counted prompt, clean and corrupted, is recorded too (a copy's
    kept gap: ``circuits.task_gap``). ``outputs``: sweep (curves), per_prompt (each prompt's metric at each k),
    summary. Mean ablation's reference: the scoring job's (``means_path``)."""
    import torch

    from attnlab.circuits.counting import Bootstrap
    from attnlab.models import load_model, pick_device
    from attnlab.patching.heads import Patcher, build_batch
    from attnlab.patching.tasks import TaskPrompts, subset
    from attnlab.tokenization import load_tokenizer

    settings = Sweep(**settings)
    torch.set_num_threads(threads)
    _seed_everything(settings.seed)
    tokenizer = load_tokenizer(model_dir)
    scoring = io.read_json(scoring_path)
    prompts = TaskPrompts(**io.read_json(prompts_path))
    counted = subset(prompts, scoring["counted_on"])
    model = load_model(model_dir, pick_device(settings.device), torch.float32)
    size = _batch_size(settings.batch_size, batch_size)
    means = (_scoring_means(means_path, task, settings, prompts, model_dir, model.device)
             if settings.ablation == "mean" else None)
    patcher = Patcher(model, build_batch(counted, tokenizer), settings.ablation, size,
                      means=means.by_template if means else None)
    scores = pd.read_csv(scores_path)
    rankings = [settings.ranking, *(r for r in ("exact", "attribution")
                                    if settings.sweep_other_ranking and r in scores and r != settings.ranking)]
    most = _log_sweep_estimate(model_dir, patcher, len(scores), settings, rankings)
    bootstrap = Bootstrap(settings.bootstrap["n_resamples"], settings.bootstrap["confidence"], settings.seed)
    started, counts = time.perf_counter(), {}
    for ranking in rankings:
        order = list(scores.sort_values(ranking, ascending=False, kind="stable")[["layer", "head"]]
                     .itertuples(index=False, name=None))
        counts[ranking] = _head_count(patcher, [(int(l), int(h)) for l, h in order], settings, bootstrap,
                                      scoring["counted_on"], configured=ranking == settings.ranking)
    elapsed = time.perf_counter() - started
    log.info("the sweep measured %d k in %.0f s (at most %d estimated)", sum(len(c.curve) for c in counts.values()),
             elapsed, most)
    io.write_csv(pd.concat([c.curve.assign(ranking=r) for r, c in counts.items()], ignore_index=True),
                 outputs["sweep"])
    io.write_parquet(pd.concat([c.per_prompt.assign(ranking=r) for r, c in counts.items()], ignore_index=True),
                     outputs["per_prompt"])
    primary = counts[settings.ranking]
    io.write_json({"task": task, "heads": len(scores), "sweep_s": elapsed, "points": len(primary.curve),
                   "refined_points": int(primary.curve["refined"].sum()), "threshold": settings.threshold,
                   **primary.summary, "ablation": settings.ablation, "ranking": settings.ranking,
                   **({"mean_over": means.described()} if means is not None else {}),
                   "interval_confidence": bootstrap.confidence, "bootstrap_resamples": bootstrap.n_resamples,
                   **_counted_prompts(scoring, counted, patcher),
                   "spearman_attribution_vs_exact": scoring.get("by_ablation", {}).get(settings.ablation, {}).get(
                       "spearman_attribution_vs_exact"),
                   "rankings": {r: _ranking_summary(c.summary) for r, c in counts.items()}},
                  outputs["summary"])


def _log_sweep_estimate(model_dir: str, patcher, n_heads: int, settings: Sweep, rankings: list[str]) -> int:
    """Log the cost fit's estimate of the sweep: its whole forwards, one per k at most as many as
    each ranking's search can measure (``requests.sweep_points``); returns that many k."""
    import torch

    from attnlab.cost.requests import SWEEP_FORWARDS, sweep_points

    most = sum(sweep_points(n_heads, dataclasses.asdict(settings), r == settings.ranking) for r in rankings)
    rows = len(patcher.batch.clean)
    log_cost_estimate("heads", model_dir, {"prompts": rows, "batch": min(patcher.batch_size, rows),
                                           "tokens": int(patcher.batch.clean.shape[1]),
                                           "forwards": SWEEP_FORWARDS + most, "exact": False},
                      torch.float32, patcher.model.device)
    return most


def _counted_prompts(scoring: dict, counted, patcher) -> dict:
    """What a sweep.json says of the prompts it counted on: how many (and how many heads were
    ranked on), their digest (two sweeps with the same one can be paired), and the unpatched
    model's metric on each, clean and corrupted, with their means (no ablation enters: the
    clean − corrupted gap a sparse copy is held to, ``circuits.task_gap``)."""
    from attnlab.circuits.counting import prompts_digest

    clean_mean, clean = patcher.per_prompt(None)
    corrupted = patcher.corrupted_per_prompt()
    return {"n_prompts_ranked_on": len(scoring["ranked_on"]), "n_prompts_counted_on": len(counted.clean),
            "rank_share": scoring["rank_share"], "counted_prompts_digest": prompts_digest(counted.clean, counted.corrupted),
            "clean_metric": clean_mean, "corrupted_metric": float(corrupted.mean()),
            "clean_metric_per_prompt": clean.tolist(), "corrupted_metric_per_prompt": corrupted.tolist()}


def _head_count(patcher, order, settings: Sweep, bootstrap, counted_on: list[int], configured: bool):
    """One ranking's sweep. rounds: the grid (every k up to all_k_up_to, else log_points), for
    the configured ranking refined at the first crossing and below the interval's ends
    (``counting.count_heads``). bisection: the configured ranking searched from a coarse grid
    with that grid as the fine one (``crossing_search``), any other ranking on the coarse grid."""
    from attnlab.circuits.counting import count_heads
    from attnlab.circuits.crossing_search import searched_count
    from attnlab.circuits.curves import k_grid
    from attnlab.config.plan import with_mib_sizes

    grid = with_mib_sizes(k_grid(len(order), settings.all_k_up_to, settings.log_points), len(order),
                          settings.mib_sizes)
    if settings.search == "bisection":
        coarse = with_mib_sizes(k_grid(len(order), 0, settings.coarse_points), len(order), settings.mib_sizes)
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
                 ablation: str, ranking: str, bootstrap: dict, dpi: int, unit: str = "heads",
                 copies: list | None = None) -> None:
    """The pruning figure of one task under one ablation from each model's sweep
    (``inputs[model]``: sweep, summary, per_prompt), the configured ranking's curves, with every
    count's and N×'s interval; for a compared pair of a model and its own sparse copy (``copies``:
    (dense, copy) pairs) also the share of the model's clean − corrupted gap the copy keeps.
    ``unit`` "edges": edge sweeps (one ranking each, which ``ranking`` names)."""
    from attnlab.circuits.task_gap import kept_gap, kept_gap_text
    from attnlab.config.plan import comparison_pairs
    from attnlab.plots.circuits import plot_pruning as plot

    read = {model: _read_sweep(paths, ranking, unit) for model, paths in inputs.items()}
    ratios, notes = {}, {}
    own_copies = {frozenset(pair): tuple(pair) for pair in copies or []}
    for first, second in comparison_pairs(compare, list(inputs)):
        if first in read and second in read:  # a compared model without a sweep here has no N× (edges of one model)
            ratios[(first, second)] = _ratio(read[first], read[second], threshold, bootstrap)
            if frozenset((first, second)) in own_copies:
                dense, copy = own_copies[frozenset((first, second))]
                gap = kept_gap(read[dense].summary, read[copy].summary, _bootstrap(bootstrap))
                notes[(first, second)] = kept_gap_text(copy, dense, gap)
    plot({m: r.curve for m, r in read.items()}, task, compare, threshold, ablation, ranking, out_path, dpi,
         {m: r.summary for m, r in read.items()}, ratios, unit, notes)


def _bootstrap(settings: dict):
    """The resamples the rules hand on (``pruning_bootstrap``: n_resamples, confidence, seed)."""
    from attnlab.circuits.counting import Bootstrap

    return Bootstrap(settings["n_resamples"], settings["confidence"], settings["seed"])


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
    from attnlab.circuits.counting import ratio_between

    paired = first.summary.get("counted_prompts_digest") == second.summary.get("counted_prompts_digest")
    return ratio_between(first.per_prompt, second.per_prompt, paired, threshold, _bootstrap(bootstrap))


def heads_vs_density(sweep_paths: dict[str, str], curve_paths: dict[str, str],
                     per_prompt_paths: dict[str, str], summary_paths: dict[str, str], pairs: list,
                     n_prompts: dict[str, int], bootstrap: dict, table_path: str, figure_path: str,
                     dpi: int, unit: str = "heads") -> None:
    """Each dense model's heads (``unit``: or edges) to the threshold beside its sparse copies'
    under each ablation swept (sweep_paths keyed "model/task/ablation", or "model/task": the
    ablation is the one each sweep.json records), against the copies' held-out density (their
    summary.json); whether each count, and so each N×, is fragile comes from the sweep's curve
    (curve_paths, same keys), and each N×'s interval from both sweeps' per-prompt metrics
    (per_prompt_paths, paired). Heads: each copy's kept gap too (``circuits.task_gap``)."""
    from attnlab.circuits.curves import (crossing, flag_fragile_counts, fragility, heads_vs_density_table,
                                         renamed_unit)
    from attnlab.circuits.task_gap import with_kept_gaps
    from attnlab.plots.circuits import plot_heads_vs_density

    read = {}
    for key, path in sweep_paths.items():
        swept = _read_sweep({"sweep": curve_paths[key], "summary": path, "per_prompt": per_prompt_paths[key]}, unit=unit)
        model, task = key.split("/")[:2]
        read[(model, task, swept.summary["ablation"])] = swept
    # the counts from the curve: a sweep.json of older code meant less by "exact"
    sweeps = {key: {**r.summary, **crossing(r.curve, r.summary["threshold"])} for key, r in read.items()}
    densities = {model: io.read_json(path) for model, path in summary_paths.items()}
    table = heads_vs_density_table([tuple(pair) for pair in pairs], sweeps, densities, n_prompts)
    table = flag_fragile_counts(table, {key: fragility(r.curve, r.summary["threshold"]) for key, r in read.items()})
    keys = [((row.label, row.task, row.ablation), (row.base, row.task, row.ablation)) for row in table.itertuples()]
    intervals = [sweeps[own].get("heads_interval", [None, None]) for own, _ in keys]
    ratios = [None if own == base else _ratio(read[base], read[own], sweeps[own]["threshold"], bootstrap)
              for own, base in keys]
    table = table.assign(heads_low=[i[0] for i in intervals], heads_high=[i[1] for i in intervals],
                         heads_fewer_low=[r and r["low"] for r in ratios],
                         heads_fewer_high=[r and r["high"] for r in ratios],
                         heads_fewer_paired=[r and r["paired"] for r in ratios])
    if unit == "heads":  # edge summaries keep no per-prompt clean and corrupted metrics: the heads' say it
        table = with_kept_gaps(table, sweeps, _bootstrap(bootstrap))
    io.write_csv(renamed_unit(table, "heads", unit), table_path)
    plot_heads_vs_density(table, "", figure_path, dpi, unit)


def sparsify_model(name: str, base_dir: str, settings: dict, outputs: dict, checkpoint: str,
                   threads: int) -> None:
    """Post-train the sparse copy of ``base_dir``; resumes from ``checkpoint`` when one is there."""
    from pathlib import Path

    import torch

    from attnlab.cost.training import sparsify_estimate
    from attnlab.sparsify import Outputs, SparsifySettings, post_train, sparsify_device, write_control, write_outputs

    torch.set_num_threads(threads)
    configured, settings = settings, SparsifySettings.from_config(settings)
    device = sparsify_device(settings.device)
    log.info("post-training the sparse copy %s of %s on %s", name, base_dir, device)
    found = sparsify_estimate(io.read_json(f"{base_dir}/config.json"), configured, device.type)
    log.info("post-training: estimated peak and time %s", "none (the cost fit has no family or lora_step for it)"
             if found is None else found.describe())
    result = post_train(base_dir, name, settings, checkpoint, device)
    write_outputs(result, name, settings, Outputs(model_dir=outputs["model"], steps=outputs["steps"],
                                                  evals=outputs["evals"], density=outputs["density"],
                                                  summary=outputs["summary"]))
    summary = result.summary
    log.info("held-out: density %.4f, KL %.4f nats/token, CE dense %.4f, sparse %.4f; %.0f tokens/s",
             summary["heldout_density"], summary["heldout_kl"], summary["heldout_ce_dense"],
             summary["heldout_ce_sparse"], summary["tokens_per_s"])
    for source, measured in summary["heldout_by_source"].items():
        log.info("held-out, %s (weight %.3g): density %.4f, KL %.4f, CE dense %.4f, sparse %.4f", source,
                 measured["weight"], measured["density"], measured["kl"], measured["ce_dense"], measured["ce_sparse"])
    # a ce_control run's dense control beside the checkpoint (not a rule output): a model whose local
    # source names this folder is prepared from it after this job (config/sparse.yaml's control)
    write_control(result, name, str(Path(checkpoint).parent / "control"))
    Path(checkpoint).unlink(missing_ok=True)  # the finished model supersedes it


def plot_sparsify(inputs: dict, training_path: str, density_path: str, model: str, dpi: int) -> None:
    from attnlab.plots.sparsify import plot_sparse_density, plot_sparse_training

    summary = io.read_json(inputs["summary"])
    plot_sparse_training(pd.read_csv(inputs["steps"]), pd.read_csv(inputs["evals"]), summary, model,
                         training_path, dpi)
    plot_sparse_density(pd.read_csv(inputs["density"]), summary, model, density_path, dpi)
