"""Every circuit method of a compiled-program model scored against its truth, and the gathered
table and ROC figure (``make groundtruth``; attnlab.groundtruth)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pandas as pd

from attnlab import io
from attnlab.config.settings import GroundTruth
from attnlab.steps.common import _batch_size, _seed_everything, log
from attnlab.steps.edge_methods import METHOD_NAMES


def groundtruth_score(model_dir: str, task: str, settings: dict, inputs: dict, outputs: dict, threads: int,
                      batch_size: int | None = None) -> None:
    """The truth on the task's pairs; each head ranking's and the edge circuit's counted circuit
    (precision, recall) and AUC; EAP and EAP-IG's AUC at each step count on the ranked prompts;
    the negative control's largest effects. ``inputs``: prompts, scores, scoring, sweep, edges,
    circuit; ``outputs``: table, roc, truth, control."""
    import torch

    from attnlab.groundtruth import pairs, truth
    from attnlab.groundtruth.scoring import method_row, roc_points
    from attnlab.models import load_model, pick_device
    from attnlab.patching.tasks import TaskPrompts
    from attnlab.tokenization import load_tokenizer

    settings = GroundTruth(**settings)
    torch.set_num_threads(threads)
    _seed_everything(settings.seed)
    spec, tokenizer = pairs.read_spec(model_dir), load_tokenizer(model_dir)
    prompts = TaskPrompts(**io.read_json(inputs["prompts"]))
    known = truth.derive(spec, pairs.token_pairs(prompts))
    model = load_model(model_dir, pick_device(settings.device), torch.float32)
    size = _batch_size(settings.batch_size, batch_size)
    ranked_on = io.read_json(inputs["scoring"])["ranked_on"]
    rankings = (_head_rankings(inputs) + [_circuit_ranking(inputs)]
                + _edge_rankings(model, tokenizer, prompts, ranked_on, settings, size)
                + _circuit_methods(model, tokenizer, prompts, ranked_on, settings, size, len(known.edges)))
    truths = {"heads": set(known.heads), "edges": set(known.edges)}
    rows = [method_row(r.method, r.unit, r.names, r.scores, truths[r.unit], r.kept) for r in rankings]
    curves = [roc_points(r.method, r.unit, r.names, r.scores, truths[r.unit]) for r in rankings]
    control = _control(model, tokenizer, model_dir, settings, size)
    table = pd.DataFrame(rows).assign(model=spec["name"], program=spec["readout"], stack=" ".join(spec["stack"]),
                                      task=task)
    io.write_csv(table, outputs["table"])
    io.write_csv(pd.concat(curves, ignore_index=True).assign(model=spec["name"], program=spec["readout"]),
                 outputs["roc"])
    io.write_json({"edges": sorted(map(list, known.edges)), "heads": sorted(map(list, known.heads)),
                   "mlps": sorted(known.mlps), "structural_edges": len(known.candidates),
                   "pairs": len(prompts.clean)}, outputs["truth"])
    io.write_json(control, outputs["control"])
    log.info("%s: truth %d edges, heads %s; control largest effect %.2e", spec["name"], len(known.edges),
             sorted(known.heads), control["largest_effect"])


class Ranking(NamedTuple):
    """One method's scored components and, where its sweep counted one, its circuit."""
    method: str
    unit: str  # heads or edges
    names: list
    scores: np.ndarray
    kept: list | None = None


def _head_rankings(inputs: dict) -> list[Ranking]:
    """Each ranking's scores and the circuit its sweep counted (the top k of the sweep's own order)."""
    scores, sweep = pd.read_csv(inputs["scores"]), io.read_json(inputs["sweep"])
    rankings = []
    for ranking in ("exact", "attribution"):
        if ranking not in scores:
            continue
        order = scores.sort_values(ranking, ascending=False, kind="stable")  # as sweep_heads orders
        names = [(int(l), int(h)) for l, h in zip(order["layer"], order["head"])]
        count = sweep["rankings"].get(ranking, {}).get("heads_to_reach_threshold")
        method = {"exact": "exact patching", "attribution": "attribution patching"}[ranking]
        rankings.append(Ranking(method, "heads", names, order[ranking].to_numpy(),
                                names[:count] if count is not None else None))
    return rankings


def _circuit_ranking(inputs: dict) -> Ranking:
    edges, summary = pd.read_parquet(inputs["edges"]), io.read_json(inputs["circuit"])
    names = list(zip(edges["sender_name"], edges["receiver_name"]))
    count = summary.get("edges_to_reach_threshold")
    kept = list(zip(*(edges.loc[edges["rank"] <= count, column] for column in ("sender_name", "receiver_name")))) \
        if count is not None else None
    method = summary.get("method", "eap_ig")
    name = f"EAP-IG ({summary['eap_ig_steps']} steps)" if method == "eap_ig" else METHOD_NAMES[method]
    return Ranking(f"{name}, circuit at the crossing", "edges", names, edges["score"].to_numpy(), kept)


def _edge_rankings(model, tokenizer, prompts, ranked_on: list[int], settings: GroundTruth,
                   size: int) -> list[Ranking]:
    """EAP (1 step) and EAP-IG at each other step count, on the ranked prompts."""
    from attnlab.patching.edges import EdgeCircuits, ranked_edges
    from attnlab.patching.heads import build_batch
    from attnlab.patching.tasks import subset

    circuits = EdgeCircuits(model, build_batch(subset(prompts, ranked_on), tokenizer), size)
    rankings = []
    for steps in settings.eap_ig_steps:
        edges = ranked_edges(circuits.graph, circuits.scores(steps))
        method = "EAP" if steps == 1 else f"EAP-IG ({steps} steps)"
        rankings.append(Ranking(method, "edges", list(zip(edges["sender_name"], edges["receiver_name"])),
                                edges["score"].to_numpy()))
    return rankings


def _circuit_methods(model, tokenizer, prompts, ranked_on: list[int], settings: GroundTruth, size: int,
                     truth_edges: int) -> list[Ranking]:
    """ACDC's and Edge Pruning's circuits on the ranked prompts, where ``groundtruth`` asks for
    them: each scored by its own circuit (what it kept) and the AUC of its scores. Edge Pruning is
    told the truth's size (sparsity 1 − truth / edges): whether it finds the circuit given its size."""
    from attnlab.patching.acdc import acdc
    from attnlab.patching.edge_pruning import PruningSchedule, prune_edges
    from attnlab.patching.edges import EdgeCircuits, ranked_edges
    from attnlab.patching.faithfulness import Faithfulness
    from attnlab.patching.heads import build_batch
    from attnlab.patching.tasks import subset

    circuits = EdgeCircuits(model, build_batch(subset(prompts, ranked_on), tokenizer), size)
    graph, rankings = circuits.graph, []
    names = lambda mask: [(graph.sender_names()[s], graph.receiver_names()[r]) for s, r in mask.nonzero().tolist()]  # noqa: E731
    if settings.acdc is not None:
        options = settings.acdc
        found = acdc(Faithfulness(circuits, options["faithfulness"]), options["threshold"], progress=False)
        edges = ranked_edges(graph, found.scores)
        rankings.append(Ranking(f"ACDC ({options['faithfulness']}, threshold {options['threshold']:g})", "edges",
                                list(zip(edges["sender_name"], edges["receiver_name"])), edges["score"].to_numpy(),
                                names(found.kept)))
    if settings.edge_pruning is not None and truth_edges:
        options = dict(settings.edge_pruning)
        faithfulness = options.pop("faithfulness")
        schedule = PruningSchedule(sparsity=1 - truth_edges / graph.n_edges, seed=settings.seed, **options)
        found = prune_edges(Faithfulness(circuits, faithfulness), schedule, progress=False)
        edges = ranked_edges(graph, found.scores)
        rankings.append(Ranking(f"Edge Pruning ({faithfulness}, {schedule.steps} steps, sparsity at the truth's "
                                f"size)", "edges", list(zip(edges["sender_name"], edges["receiver_name"])),
                                edges["score"].to_numpy(), names(found.kept)))
    return rankings


def _control(model, tokenizer, model_dir: str, settings: GroundTruth, size: int) -> dict:
    """The negative control: the clean and corrupted metrics, every head's exact effect and every
    edge patched alone (the effects; all within the tolerance to pass), and EAP-IG's largest
    |score| at the largest step count (an attribution along a path through inputs that are not
    controls, reported, not held to the tolerance)."""
    from attnlab.groundtruth import pairs
    from attnlab.patching.edges import EdgeCircuits
    from attnlab.patching.heads import Patcher, build_batch

    prompts = pairs.generate("program_control", tokenizer, settings.control_n, settings.seed, model_dir)
    batch = build_batch(prompts, tokenizer)
    patcher, circuits = Patcher(model, batch, "corrupted", size), EdgeCircuits(model, batch, size)
    every, clean = circuits.graph.valid(), circuits.metric()
    edge_effects = []
    for sender, receiver in every.nonzero().tolist():
        kept = every.clone()
        kept[sender, receiver] = False  # this edge alone carries the corrupted run
        edge_effects.append(abs(circuits.metric(kept) - clean))
    effects = {"metric_difference": abs(patcher.metric() - patcher.corrupted_metric()),
               "head_exact": float(patcher.exact().abs().max()), "edge_patched_alone": max(edge_effects)}
    steps = max(settings.eap_ig_steps)
    largest = max(effects.values())
    return {"pairs": len(prompts.clean), "rule": prompts.info["control"], "largest_effects": effects,
            "largest_effect": largest, "tolerance": settings.tolerance, "passed": bool(largest <= settings.tolerance),
            "edges_patched": len(edge_effects),
            f"eap_ig_{steps}_steps_largest_abs_score": float(circuits.scores(steps).abs().max())}


def groundtruth_table(tables: list[str], rocs: list[str], controls: list[str], table_path: str,
                      figure_path: str, dpi: int) -> None:
    """Every model's rows in one table, each negative control as a row of its own (its largest
    effect and whether it is within the tolerance), and the ROC figure."""
    from attnlab.plots.groundtruth import plot_roc

    frames = [pd.read_csv(path) for path in tables]
    control_rows = []
    for path, scored in zip(controls, frames):
        control, first = io.read_json(path), scored.iloc[0]
        control_rows.append({"model": first["model"], "program": first["program"], "stack": first["stack"],
                             "task": "program_control", "method": f"negative control ({control['rule']['kind']})",
                             "unit": "every head and edge", "largest_effect": control["largest_effect"],
                             "eap_ig_largest_abs_score": next(v for k, v in control.items() if k.startswith("eap_ig_")),
                             "tolerance": control["tolerance"], "passed": control["passed"]})
    table = pd.concat([*frames, pd.DataFrame(control_rows)], ignore_index=True)
    leading = ["model", "program", "task", "unit", "method", "counted", "truth", "precision", "recall", "auc"]
    io.write_csv(table[leading + [c for c in table.columns if c not in leading]], table_path)
    curves = pd.concat([pd.read_csv(path) for path in rocs], ignore_index=True)
    plot_roc(curves, table[table["task"] != "program_control"], figure_path, dpi)
