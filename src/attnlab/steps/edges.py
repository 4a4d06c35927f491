"""Edge circuits of a model on a task (EAP-IG scores, the exact sweep over edges kept) and their
figure."""

from __future__ import annotations

import time

from attnlab import io
from attnlab.circuits.curves import renamed_unit
from attnlab.config.settings import EdgeSweep
from attnlab.steps.common import _batch_size, _seed_everything, log, log_cost_estimate
from attnlab.steps.edge_methods import circuit_effect, ordered_edges


def edge_circuit(model_dir: str, task: str, settings: dict, prompts_path: str, scoring_path: str,
                 outputs: dict, threads: int, batch_size: int | None = None) -> None:
    """Score every edge by ``settings.method`` (EAP-IG, ACDC, Edge Pruning: ``steps.edge_methods``)
    on the prompts the head sweep ranked heads on, then keep the top n by |score| and patch every other edge from the corrupted run on the prompts it counted
    on, for n on a log grid refined around the first crossing (``settings.search``: rounds) or
    with the crossing and the interval's ends searched (bisection: ``crossing_search``).
    ``outputs``: edges (every edge's score and rank), curve, per_prompt, summary."""
    import torch

    from attnlab.circuits.counting import Bootstrap, prompts_digest
    from attnlab.models import load_model, pick_device
    from attnlab.patching.edges import EdgeCircuits
    from attnlab.patching.heads import build_batch
    from attnlab.patching.tasks import TaskPrompts, subset
    from attnlab.tokenization import load_tokenizer

    settings = EdgeSweep(**settings)
    torch.set_num_threads(threads)
    _seed_everything(settings.seed)
    tokenizer = load_tokenizer(model_dir)
    scoring = io.read_json(scoring_path)
    prompts = TaskPrompts(**io.read_json(prompts_path))
    model = load_model(model_dir, pick_device(settings.device), torch.float32)
    size = _batch_size(settings.batch_size, batch_size)
    edges, scored_s, method = _scored_edges(model, model_dir, build_batch(subset(prompts, scoring["ranked_on"]),
                                                                          tokenizer), settings, size)
    io.write_parquet(edges, outputs["edges"])
    counted_on = scoring["counted_on"][:settings.n_counted]  # ascending ids: the first n (None: all)
    counted = subset(prompts, counted_on)
    circuits = EdgeCircuits(model, build_batch(counted, tokenizer), size, settings.refine_points,
                            cache_bytes=None if settings.cache_gb is None else int(settings.cache_gb * 1e9))
    clean, corrupted = circuits.metric(), circuits.corrupted_metric()
    log.info("corrupted recordings kept between evaluations: %d of %d mini-batches (cache_gb %s); the "
             "others are recorded again at each evaluation", *circuits.recordings_kept, settings.cache_gb)
    log.info("%s: %d edges scored in %.0f s; clean metric %.3f, corrupted %.3f on %d counted prompts", task,
             len(edges), scored_s, clean, corrupted, len(counted.clean))
    _log_estimates(model_dir, circuits, settings, size, scoring=False)
    bootstrap = Bootstrap(settings.bootstrap["n_resamples"], settings.bootstrap["confidence"], settings.seed)
    started = time.perf_counter()
    count = _swept_count(circuits, edges.sort_values("rank").index.to_numpy(), settings, bootstrap, counted_on)
    swept_s = time.perf_counter() - started
    method.update(circuit_effect(circuits, edges, bootstrap))  # ACDC's or Edge Pruning's own circuit
    io.write_csv(renamed_unit(count.curve), outputs["curve"])
    io.write_parquet(renamed_unit(count.per_prompt), outputs["per_prompt"])
    graph = circuits.graph
    io.write_json({"task": task, "edges": len(edges), "senders": graph.n_senders, "receivers": graph.n_receivers,
                   "layers": graph.n_layers, "heads": graph.n_heads, "kv_heads": graph.n_kv_heads,
                   "method": settings.method, **method, "score_chunk": settings.score_chunk,
                   "recordings_kept": list(circuits.recordings_kept), "ablation": "corrupted", "search": settings.search,
                   "threshold": settings.threshold,
                   **renamed_unit(count.summary),
                   "clean_metric": clean, "corrupted_metric": corrupted, "points": len(count.curve),
                   "refined_points": int(count.curve["refined"].sum()), "score_s": scored_s, "sweep_s": swept_s,
                   "interval_confidence": bootstrap.confidence, "bootstrap_resamples": bootstrap.n_resamples,
                   "n_prompts_ranked_on": len(scoring["ranked_on"]), "n_prompts_counted_on": len(counted.clean),
                   "rank_share": scoring["rank_share"],
                   "counted_prompts_digest": prompts_digest(counted.clean, counted.corrupted)},
                  outputs["summary"])


def _scored_edges(model, model_dir: str, batch, settings, size: int):
    """Every edge's score and rank under ``settings.method`` on ``batch`` (the prompts heads were
    ranked on), the seconds taken and the method's summary (``steps.edge_methods``)."""
    from attnlab.patching.edges import EdgeCircuits

    circuits = EdgeCircuits(model, batch, size, score_chunk=settings.score_chunk)
    if settings.method == "eap_ig":  # the estimate of EAP-IG's scoring (the cost fit's stage)
        _log_estimates(model_dir, circuits, settings, size)
    return ordered_edges(circuits, model_dir, settings, size)


def _log_estimates(model_dir: str, circuits, settings, batch_size: int, scoring: bool = True) -> None:
    """The cost fit's estimate of scoring's or the circuits' peak (attnlab.cost.model) in the log,
    beside the peak reached so far on CUDA."""
    import torch

    batch = circuits.batch
    rows, tokens = batch.whole_prompts(batch_size), int(batch.clean.shape[1])
    per_batch = max(len(batch.differing_points(chunk)) for chunk in batch.chunks(batch_size))
    if scoring:
        chunk = min(per_batch, settings.score_chunk or per_batch)
        work = {"batch": rows, "tokens": tokens, "points_per_batch": chunk, "prompts": len(batch.clean),
                "chunks": -(-per_batch // max(chunk, 1)), "steps": settings.steps}
    else:
        work = {"batch": rows, "tokens": tokens, "points_per_batch": per_batch, "prompts": len(batch.clean),
                "points": len(batch.differing_points(slice(0, len(batch.clean))))}
    log_cost_estimate("edge_scores" if scoring else "edge_circuit", model_dir, work, torch.float32, circuits.device)
    if circuits.device.type == "cuda":
        log.info("CUDA peak so far: %.1f GB", torch.cuda.max_memory_allocated() / 1e9)


def _swept_count(circuits, order, settings, bootstrap, counted_on):
    """The count over edges kept in ``order``: a log grid refined around the first crossing
    (search ``rounds``), or the crossing and the interval's ends bisected (``bisection``)."""
    from attnlab.circuits.counting import count_heads
    from attnlab.circuits.crossing_search import searched_count
    from attnlab.circuits.curves import k_grid
    from attnlab.config.plan import with_mib_sizes

    grid = with_mib_sizes(k_grid(len(order), 0, settings.log_points), len(order), settings.mib_sizes)
    if settings.search == "bisection":
        coarse = with_mib_sizes(k_grid(len(order), 0, settings.coarse_points), len(order), settings.mib_sizes)
        return searched_count(circuits, order, coarse, grid,
                              settings.threshold, bootstrap, counted_on, settings.interval_points)
    return count_heads(circuits, order, grid, settings.threshold, bootstrap, counted_on, settings.interval_points)


def plot_circuit(edges_path: str, summary_path: str, out_path: str, model: str, dpi: int) -> None:
    """The circuit at the first crossing of the threshold (summary.json's count; with none, every
    edge), drawn over the model's components."""
    from attnlab.circuits.curves import count_text
    from attnlab.plots.circuits import plot_circuit as plot

    summary = io.read_json(summary_path)
    needed = summary["edges_to_reach_threshold"]
    kept = summary["edges"] if needed is None else needed
    count = count_text(needed, summary["edges_to_reach_exact"])
    title = (f"{model}, {summary['task']}: the circuit at {summary['threshold']:g} explained effect "
             f"({count} of {summary['edges']:,} edges)")
    plot(io.read_parquet(edges_path), kept, (summary["layers"], summary["heads"], summary["kv_heads"]), title,
         out_path, dpi)
