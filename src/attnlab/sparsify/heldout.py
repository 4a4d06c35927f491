"""Held-out numbers of each corpus source and of the mixture: CE of the copy and of its base, KL
and density at inference, per source and weighted by the sources' mixture weights; and the CE
bound that a ``ce`` constraint holds a training batch to."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from attnlab.attention import sparse
from attnlab.interventions import intervened
from attnlab.sparsify import losses
from attnlab.sparsify.corpus import Corpus
from attnlab.sparsify.train import Trainer, autocast_for

# the numbers one evaluation reports, each a mean over tokens of one source's held-out sequences
MEASURED = ("ce_sparse", "ce_dense", "kl", "density", "ce_control", "kl_control", "kl_vs_control")


@dataclass
class Evaluation:
    overall: dict  # each number weighted by the sources' mixture weights
    by_source: dict[str, dict]
    per_head: pd.DataFrame  # density per layer x head, weighted likewise

    def row(self) -> dict:
        """eval.csv's columns: the mixture's numbers, then each source's as ``name[source]``."""
        return {**self.overall, **{f"{key}[{source}]": value for source, measured in self.by_source.items()
                                   for key, value in measured.items()}}


class HeldOut:
    """Each source's held-out sequences, with the dense model's logits on them computed once
    when they fit in memory (every evaluation reuses them)."""

    def __init__(self, trainer: Trainer, corpus: Corpus):
        self.trainer, self.sources = trainer, corpus.sources
        self.references = {source.name: reference_logits(trainer, source.heldout)
                           if logits_fit(trainer, source.heldout) else None for source in self.sources}

    def measure(self) -> Evaluation:
        by_source, tables = {}, []
        for source in self.sources:
            measured, table = evaluate(self.trainer, source.heldout, self.references[source.name])
            by_source[source.name] = measured
            tables.append(table.assign(density=table["density"] * source.weight))
        weights = {source.name: source.weight for source in self.sources}
        overall = {key: float(sum(weights[name] * measured[key] for name, measured in by_source.items()))
                   for key in MEASURED if key in next(iter(by_source.values()))}
        per_head = pd.concat(tables).groupby(["layer", "head"], as_index=False, sort=True)["density"].sum()
        return Evaluation(overall, by_source, per_head)


def ce_bound(base_ce: dict[str, float], names: list[str], sources: np.ndarray, slack: float) -> float:
    """What a ``ce`` constraint holds a training batch's CE to: the base model's held-out CE on each
    batch sequence's source (``base_ce``, by source name; ``sources``: each sequence's source index
    into ``names``), averaged over the batch, plus ``slack``. Taking each source's own reference keeps
    a batch of text the base finds easier from looking like slack gained, and a harder one from
    looking like a broken bound (SmolLM2's held-out CE: 2.65 on narrative English, 3.04 on Python)."""
    return float(np.mean([base_ce[names[index]] for index in sources])) + slack


@torch.no_grad()
def reference_logits(trainer: Trainer, ids: torch.Tensor, model=None) -> list[torch.Tensor]:
    """The dense model's (or ``model``'s) logits on ``ids``, per evaluation batch (to reuse across
    evaluations)."""
    batch, model = trainer.settings.batch_size, model if model is not None else trainer.dense
    with autocast_for(trainer.device, trainer.settings.dtype, training=False):
        return [model(input_ids=ids[start:start + batch].to(trainer.device), use_cache=False).logits
                for start in range(0, len(ids), batch)]


def kl_reference(trainer: Trainer) -> tuple[str, object]:
    """The dense model the copy's gates are measured against in calibration: the dense control
    under ce_control (the copy's fine-tuned twin: the KL then prices the gates, not the
    fine-tuning both share), else the frozen base."""
    if trainer.control is not None:
        return "the dense control, fine-tuned on the same batches", trainer.control
    return "the base model", trainer.dense


@torch.no_grad()
def gated_kl(trainer: Trainer, ids: torch.Tensor, references: list[torch.Tensor] | None, model) -> dict:
    """KL(``model`` ‖ copy) and the copy's density at inference on ``ids`` (``references``:
    ``model``'s logits per batch, or None to compute them here)."""
    trainer.student.eval()
    model.eval()
    tracker, kl, batch = sparse.GateTracker(), 0.0, trainer.settings.batch_size
    for index, start in enumerate(range(0, len(ids), batch)):
        rows = ids[start:start + batch].to(trainer.device)
        with autocast_for(trainer.device, trainer.settings.dtype, training=False):
            reference = references[index] if references is not None else model(input_ids=rows, use_cache=False).logits
            with intervened(trainer.student, gates=tracker):
                logits = trainer.student(input_ids=rows, use_cache=False).logits
        kl += float(losses.loss_terms(logits, rows, reference)[1]) * len(rows) / len(ids)
    trainer.student.train()
    if model is trainer.control:
        model.train()
    return {"kl": kl, "density": tracker.inference_density()}


def logits_fit(trainer: Trainer, ids: torch.Tensor) -> bool:
    """Whether the dense logits on ``ids`` fit in 2 GB (to compute them once and reuse them)."""
    return len(ids) * ids.shape[1] * trainer.dense.config.get_text_config().vocab_size * 4 <= 2 ** 31


@torch.no_grad()
def evaluate(trainer: Trainer, heldout: torch.Tensor, references: list[torch.Tensor] | None = None
             ) -> tuple[dict, pd.DataFrame]:
    """CE of the copy, its base (and the dense control), KL and density at inference (deterministic
    gates) on ``heldout``. ``references``: the dense logits per batch (reference_logits), else
    computed here."""
    trainer.student.eval()
    models = [model for model in (trainer.student, trainer.control) if model is not None]
    for model in models:
        model.eval()
    tracker = sparse.GateTracker()
    totals = {"ce_sparse": 0.0, "ce_dense": 0.0, "kl": 0.0,
              **({"ce_control": 0.0, "kl_control": 0.0, "kl_vs_control": 0.0} if trainer.control else {})}
    batch = trainer.settings.batch_size
    for index, start in enumerate(range(0, len(heldout), batch)):
        ids = heldout[start:start + batch].to(trainer.device)
        with autocast_for(trainer.device, trainer.settings.dtype, training=False):
            reference = (references[index] if references is not None
                         else trainer.dense(input_ids=ids, use_cache=False).logits)
            with intervened(trainer.student, gates=tracker):
                logits = trainer.student(input_ids=ids, use_cache=False).logits
        ce, kl = losses.loss_terms(logits, ids, reference)
        ce_dense, _ = losses.loss_terms(reference, ids, None)
        weight = len(ids) / len(heldout)
        totals["ce_sparse"] += float(ce) * weight
        totals["kl"] += float(kl) * weight
        totals["ce_dense"] += float(ce_dense) * weight
        if trainer.control is not None:  # what fine-tuning alone does: the control's CE and KL from the base
            with autocast_for(trainer.device, trainer.settings.dtype, training=False):
                control_logits = trainer.control(input_ids=ids, use_cache=False).logits
            control_ce, control_kl = losses.loss_terms(control_logits, ids, reference)
            totals["ce_control"] += float(control_ce) * weight
            totals["kl_control"] += float(control_kl) * weight
            # and what the gates cost beside it: KL(control || copy)
            totals["kl_vs_control"] += float(losses.loss_terms(logits, ids, control_logits)[1]) * weight
    for model in models:
        model.train()
    return {**totals, "density": tracker.inference_density()}, density_table(tracker)


def density_table(tracker: sparse.GateTracker) -> pd.DataFrame:
    """Share of allowed (causal, in-window) edges open at inference, per layer x head."""
    rows = [{"layer": layer, "head": head, "density": value}
            for layer, density in tracker.density_per_head().items() for head, value in enumerate(density.tolist())]
    return pd.DataFrame(rows)
