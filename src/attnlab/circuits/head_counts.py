"""How many heads a model needs, under each way of measuring it (docs/sparsify.md, docs/results.md).

The head-pruning figure's "N×" rests on choices the paper does not publish in full:
how heads are ranked (attribution patching, a linear estimate, or exact one-head
activation patching), what an ablated head is replaced by (the corrupted prompt's
activation, the template mean, zero) and how many prompts are averaged. ``head_counts``
measures the heads needed to reach the threshold under every combination on one model,
with the same Patcher, gates and sweep as the workflow's ``score_heads``/``sweep_heads``,
so a reversal can be traced to the measurement or to the model.

``padding_check`` tests the patcher itself: each prompt's metric in the left-padded
batches the patcher uses against the same prompt run alone (no padding), clean and with
half of the heads ablated, and, for a sparse model, the gates opened on real tokens.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pandas as pd
import torch
from scipy.stats import spearmanr

from attnlab.attention import sparse
from attnlab.circuits.curves import crossing, k_grid
from attnlab.circuits.sweeps import sweep
from attnlab.interventions import intervened
from attnlab.patching.heads import Patcher, build_batch, held_apart_means
from attnlab.patching.tasks import MEAN_POOL_SEED_OFFSET, TaskPrompts, generate_task

log = logging.getLogger(__name__)
RANKINGS = ("attribution", "exact")


def head_counts(model, tokenizer, task: str, n: int, seed: int, ablations: list[str],
                rankings: list[str], threshold: float, batch_size: int,
                all_k_up_to: int = 300, log_points: int = 40, mean_pool: int = 256) -> tuple[list[dict], pd.DataFrame]:
    """Heads to ``threshold`` for every ablation x ranking on ``n`` prompts of ``task``; under mean
    ablation each template's mean over ``mean_pool`` prompts drawn apart (as the workflow's).

    Returns one row per (ablation, ranking) (crossing(), clean and corrupted metrics, the
    Spearman correlation of attribution and exact scores) and the sweeps' curves.
    """
    prompts = generate_task(task, tokenizer, n, seed)
    batch = build_batch(prompts, tokenizer)
    means = None
    if "mean" in ablations:
        drawn = generate_task(task, tokenizer, mean_pool, seed + MEAN_POOL_SEED_OFFSET)
        means, _ = held_apart_means(model, tokenizer, prompts, drawn, batch_size)
    rows, curves = [], []
    for ablation in ablations:
        patcher = Patcher(model, batch, ablation, batch_size, means=means if ablation == "mean" else None)
        scores = {"attribution": patcher.attribution()}
        if "exact" in rankings:
            scores["exact"] = patcher.exact()
        common = {"task": task, "n_prompts": len(prompts.clean), "ablation": ablation,
                  "clean_metric": patcher.metric(), "corrupted_metric": patcher.corrupted_metric(),
                  "spearman_attribution_vs_exact": _spearman(scores)}
        for ranking in rankings:
            order = _order(scores[ranking])
            swept, _ = sweep(patcher, order, k_grid(len(order), all_k_up_to, log_points), threshold)
            rows.append({**common, "ranking": ranking, "threshold": threshold,
                         **crossing(swept, threshold), "sweep_points": len(swept),
                         "max_explained_effect": float(swept["explained_effect"].max())})
            curves.append(swept.assign(task=task, n_prompts=len(prompts.clean), ablation=ablation,
                                       ranking=ranking))
        log.info("%s, %s ablation: %s", task, ablation,
                 ", ".join(f"{r['ranking']} {r['heads_to_reach_threshold']}" for r in rows if r["ablation"] == ablation))
    return rows, pd.concat(curves, ignore_index=True)


def _order(scores: torch.Tensor) -> list[tuple[int, int]]:
    """Heads by descending signed score (ties by position), as score_heads ranks them."""
    flat = scores.flatten().numpy()
    ranked = np.argsort(-flat, kind="stable")
    heads = scores.shape[1]
    return [(int(i) // heads, int(i) % heads) for i in ranked]


def _spearman(scores: dict) -> float | None:
    if "exact" not in scores:
        return None
    return float(spearmanr(scores["attribution"].flatten(), scores["exact"].flatten()).statistic)


def padding_check(model, tokenizer, task: str, n: int, seed: int, batch_size: int,
                  ablation: str = "corrupted") -> dict:
    """Largest difference between a prompt's metric in the patcher's left-padded batches and
    the same prompt run alone, clean and with a fixed random half of the heads ablated;
    for a sparse model also the open gates on real tokens, batched against one at a time."""
    if ablation == "mean":
        raise ValueError("the template mean depends on the other prompts: check corrupted or zero")
    prompts = generate_task(task, tokenizer, n, seed)
    batch = build_batch(prompts, tokenizer)
    patcher = Patcher(model, batch, ablation, batch_size)
    half = (torch.rand(patcher.gates.n_layers, patcher.gates.n_heads,
                       generator=torch.Generator().manual_seed(seed)) < 0.5).float()
    batched = {"clean": _per_prompt(patcher, None), "half_ablated": _per_prompt(patcher, half)}
    open_batched = _open_edges(model, patcher)
    single = {"clean": [], "half_ablated": []}
    open_single = 0.0
    for index in range(len(prompts.clean)):
        alone = Patcher(model, build_batch(_subset(prompts, index), tokenizer), ablation, batch_size)
        single["clean"] += _per_prompt(alone, None)
        single["half_ablated"] += _per_prompt(alone, half)
        open_single += _open_edges(model, alone)
    padded = int((batch.mask == 0).sum())
    result = {"task": task, "n_prompts": len(prompts.clean), "ablation": ablation, "padding_tokens": padded,
              **{f"max_abs_diff_{k}": float(np.max(np.abs(np.subtract(batched[k], single[k])))) for k in batched},
              "metric_scale": float(np.mean(np.abs(batched["clean"])))}
    if sparse.is_sparse(model):
        result.update(open_edges_batched=open_batched, open_edges_one_at_a_time=open_single)
    return result


def _per_prompt(patcher: Patcher, gates: torch.Tensor | None) -> list[float]:
    """The task metric of every prompt (Patcher.metric gives their mean)."""
    values = []
    per = patcher.batch.rows_per_prompt
    if gates is not None:
        patcher.gates.gates = gates.to(patcher.device)
    with torch.no_grad():
        for rows, reference in zip(patcher._chunks(), patcher.references):
            patcher.gates.reference = None if gates is None else reference
            logits = patcher._logits(patcher.batch.clean, rows)
            values += patcher.batch.metric(logits, slice(rows.start // per, rows.stop // per)).tolist()
    patcher.gates.reference = None
    return values


def _open_edges(model, patcher: Patcher) -> float:
    """Open gates on real (unpadded, causal) edges over the clean prompts; 0 for a dense model."""
    if not sparse.is_sparse(model):
        return 0.0
    tracker = sparse.GateTracker()
    with torch.no_grad(), intervened(model, gates=tracker):
        for rows in patcher._chunks():
            patcher.model(input_ids=patcher.batch.clean[rows].to(patcher.device),
                          attention_mask=patcher.batch.mask[rows].to(patcher.device),
                          position_ids=patcher.positions[rows].to(patcher.device), use_cache=False)
    return float(sum(float(v.sum()) for v in tracker.open_per_head.values()))


def _subset(prompts: TaskPrompts, index: int) -> TaskPrompts:
    """Prompt ``index`` alone (its own batch: no padding)."""
    pick = lambda values: values[index:index + 1] if values else values  # noqa: E731
    return dataclasses.replace(prompts, clean=pick(prompts.clean), corrupted=pick(prompts.corrupted),
                               templates=pick(prompts.templates), answers=pick(prompts.answers),
                               distractors=pick(prompts.distractors), years=pick(prompts.years))
