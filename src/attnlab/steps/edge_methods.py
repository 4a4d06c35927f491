"""What orders an edge sweep's edges (``pruning.edges.method``): EAP-IG's scores, ACDC's circuit,
or Edge Pruning's masks, on the prompts heads were ranked on; and a method's own circuit measured
on the counted prompts, with its interval (docs/edges.md, "Methods")."""

from __future__ import annotations

import time

import numpy as np

from attnlab.steps.common import log

METHOD_NAMES = {"eap_ig": "EAP-IG", "acdc": "ACDC", "edge_pruning": "Edge Pruning"}


def ordered_edges(circuits, model_dir: str, settings, size: int):
    """Every edge with its score and rank under ``settings.method`` on ``circuits``' prompts (those
    heads were ranked on); the seconds taken; the method's own summary (``ranking``: how edges are
    ordered; for ACDC and Edge Pruning ``method_circuit``: the edges of the circuit it found)."""
    from attnlab.patching.edges import ranked_edges
    from attnlab.patching.faithfulness import Faithfulness

    if settings.method == "acdc":  # before any forward
        acdc_time_check(model_dir, circuits, settings, size)
    started = time.perf_counter()
    if settings.method == "eap_ig":
        edges = ranked_edges(circuits.graph, circuits.scores(settings.steps))
        return edges, time.perf_counter() - started, {"ranking": f"EAP-IG {settings.steps} steps",
                                                       "eap_ig_steps": settings.steps}
    faithfulness = Faithfulness(circuits, settings.faithfulness)
    if settings.method == "acdc":
        found, extra = _acdc(faithfulness, settings)
        edges = ranked_edges(circuits.graph, found.scores)
        edges["increase"] = _at_edges(found.increases, edges)
    else:
        found, extra = _edge_pruning(faithfulness, settings)
        edges = ranked_edges(circuits.graph, found.scores)
        edges["log_alpha"] = _at_edges(found.log_alpha, edges)
    edges["in_circuit"] = _at_edges(found.kept, edges).astype(bool)
    extra["method_circuit"] = int(found.kept.sum())
    return edges, time.perf_counter() - started, extra


def _at_edges(matrix, edges) -> np.ndarray:
    return matrix.detach().cpu().numpy()[edges["sender"].to_numpy(), edges["receiver"].to_numpy()]


def acdc_time_check(model_dir: str, circuits, settings, size: int) -> float | None:
    """ACDC's estimated minutes for this job's ranked prompts (``cost.budget.acdc_estimate`` on
    their own sizes, times the fit's largest time factor), logged, and refused above
    ``acdc.max_minutes`` before any forward: the plan checks it too, but a model whose config.json
    was not at hand when the plan was made is estimated only here. None where the fit has no time
    (a GPU)."""
    from attnlab import io
    from attnlab.config.checks import ConfigError
    from attnlab.cost.budget import acdc_estimate
    from attnlab.cost.requests import acdc_refusal, with_time_factor

    config, batch = io.read_json(f"{model_dir}/config.json"), circuits.batch
    work = {"batch": batch.whole_prompts(size), "tokens": int(batch.clean.shape[1]), "prompts": len(batch.clean),
            "points_per_batch": max(len(batch.differing_points(chunk)) for chunk in batch.chunks(size)),
            "points": len(batch.differing_points(slice(0, len(batch.clean))))}
    found = with_time_factor(acdc_estimate(config, work, circuits.device.type), config)
    if found is None:
        log.info("ACDC: the cost fit has no time for this model or device; not checked against acdc.max_minutes")
        return None
    minutes, edges = found
    limit = settings.acdc["max_minutes"]
    log.info("ACDC: at most %d patched forwards of %d prompts, estimated %.1f min (acdc.max_minutes %g)",
             edges + 1, len(batch.clean), minutes, limit)
    if minutes > limit:
        raise ConfigError(acdc_refusal(limit, [
            f"  {model_dir}: {edges:,} edges, estimated {minutes:,.3g} min on the {circuits.device.type}"]))
    return minutes


def _acdc(faithfulness, settings):
    from attnlab.patching.acdc import acdc

    options = settings.acdc
    found = acdc(faithfulness, options["threshold"])
    log.info("ACDC (%s, threshold %g): %d of %d edges kept; %d tried, %d removed without a forward "
             "(their component sends nothing), %.0f s", settings.faithfulness, options["threshold"],
             int(found.kept.sum()), faithfulness.circuits.graph.n_edges, found.tried, found.skipped, found.seconds)
    return found, {"ranking": f"ACDC ({settings.faithfulness}, threshold {options['threshold']:g}): the distance's "
                              "growth when each edge was removed, clipped at 0; kept edges first",
                   "acdc_threshold": options["threshold"], "faithfulness": settings.faithfulness,
                   "acdc_forwards": found.forwards, "acdc_tried": found.tried, "acdc_skipped": found.skipped,
                   "acdc_distance": found.distance}


def _edge_pruning(faithfulness, settings):
    from attnlab.patching.edge_pruning import PruningSchedule, prune_edges

    options = settings.edge_pruning
    schedule = PruningSchedule(sparsity=options["sparsity"], steps=options["steps"], warmup=options["warmup"],
                               lr=options["lr"], lambda_lr=options["lambda_lr"], read_at=options["read_at"],
                               seed=settings.seed)
    found = prune_edges(faithfulness, schedule)
    last = found.history[-1]
    log.info("Edge Pruning (%s, sparsity %g, %d steps): %d edges above %g; last loss %.4g, expected sparsity "
             "%.4f, %.0f s", settings.faithfulness, schedule.sparsity, schedule.steps, int(found.kept.sum()),
             schedule.read_at, last["loss"], last["expected_sparsity"], found.seconds)
    return found, {"ranking": f"Edge Pruning ({settings.faithfulness}, sparsity {schedule.sparsity:g}, "
                              f"{schedule.steps} steps): the gates' sigmoid(log alpha)",
                   "faithfulness": settings.faithfulness, "edge_pruning_sparsity": schedule.sparsity,
                   "edge_pruning_steps": schedule.steps, "edge_pruning_warmup": schedule.warmup,
                   "edge_pruning_read_at": schedule.read_at, "edge_pruning_last_loss": last["loss"],
                   "edge_pruning_expected_sparsity": last["expected_sparsity"]}


def circuit_effect(circuits, edges, bootstrap) -> dict:
    """The explained effect of the method's own circuit (``edges``' ``in_circuit``; none for
    EAP-IG: {}) on ``circuits``' prompts (the counted ones), with the bootstrap interval over those
    prompts (the sweep's draws)."""
    from attnlab.circuits.curves import order_interval, resampled_effects

    if "in_circuit" not in edges:
        return {}
    own = edges[edges["in_circuit"]]
    kept = circuits.graph.mask(own["sender"].to_numpy(), own["receiver"].to_numpy())
    none = kept.clone().zero_()
    metrics = np.stack([circuits.per_prompt(mask)[1] for mask in (none, kept, None)])  # [none, circuit, all]
    effects = resampled_effects(metrics, bootstrap.draws(metrics.shape[1]))[:, 1]
    low, high = order_interval(effects, bootstrap.confidence)
    point = resampled_effects(metrics, np.arange(metrics.shape[1])[None])[0, 1]
    return {"method_circuit_effect": float(point), "method_circuit_effect_interval": [low, high]}
