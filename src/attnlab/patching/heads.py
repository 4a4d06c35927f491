"""Head attribution and head-pruning sweeps.

Every head is gated at the input of its layer's attention output projection
(``o_proj``), the concatenation of per-query-head outputs (also under
grouped-query attention): ``z' = r + g * (z - r)`` for that head's slice,
where ``r`` is the ablation reference (the corrupted run's activation, the
dataset mean, or zero). ``g = 1`` keeps the head, ``g = 0`` ablates it; MLPs
are never touched.

- Attribution patching: with all gates at 1, ``d metric / d g`` for every
  head from one clean forward, one corrupted forward (the reference) and one
  backward: a linear estimate of how much the metric drops when that head is
  ablated.
- Exact patching: the same drop, measured: every head of a layer at once, in passes that resume
  at that layer from a recorded clean forward (``Patcher.exact``, about a third of a forward per
  head), or one full forward per head (``exact_one_forward_per_head``, kept to check it).
- Sweep: keep the k best-ranked heads, ablate the rest, for each k (each prompt's metric kept:
  ``counting`` bootstraps the count from them). Explained
  effect = (m(k) − m(0)) / (m(all) − m(0)), with m(0) and m(all) taken from
  the same sweep, so it is exactly 0 at k = 0 and exactly 1 at k = all.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from tqdm import tqdm

from attnlab import anatomy
from attnlab.interventions import intervened
from attnlab.interventions.readout import Readout
from attnlab.interventions.resume import LayerInputs, ResumeAt, cached_positions, prefix_cache
from attnlab.patching.batch import LOGITS_KEPT, TaskBatch, build_batch
from attnlab.patching.tasks import held_apart

__all__ = ["ABLATIONS", "LOGITS_KEPT", "HeadGates", "Patcher", "TaskBatch", "build_batch"]

log = logging.getLogger(__name__)
ABLATIONS = ("corrupted", "mean", "zero")
# Tokens in one resumed pass of exact patching on a CPU: larger passes run out of cache and
# cost more per head (SmolLM2, Docstring, measured before the readout kept only the logits read:
# 0.46 forwards per head at about 3,400 tokens a pass, 0.62 at 10,000; benchmarks/throughput/pruning_cost.py).
# Elsewhere only the batch size bounds a pass.
RESUMED_TOKENS = {"cpu": 4096}


class HeadGates:
    """Each head's gate at the input of its layer's o_proj, with the ablation reference; the
    pre-hooks that apply them are ``hook(layer)``, installed by ``intervened(head_gates=...)``."""

    def __init__(self, model):
        parts = anatomy.of(model, stages=("head patching",))
        self.n_layers, self.n_heads, self.head_dim = parts.n_layers, parts.n_heads, parts.head_dim
        self.gates = torch.ones(self.n_layers, self.n_heads, device=model.device)
        self.reference: list[torch.Tensor] | None = None  # per layer, like o_proj's input
        self.captured: list[torch.Tensor | None] = [None] * self.n_layers
        self.capturing = False

    def hook(self, layer: int):
        def gate(module, args):
            z = args[0]
            if self.capturing:
                self.captured[layer] = z.detach()
            if self.reference is None or self.reference[layer] is None:
                return None
            shape = (*z.shape[:-1], self.n_heads, self.head_dim)
            reference = self.reference[layer].view(shape)
            gates = self.gates[layer]  # [heads], or [rows, heads]: one set of gates per row
            gates = gates.view(-1 if gates.dim() == 2 else 1, 1, self.n_heads, 1).to(z.dtype)
            gated = reference + gates * (z.view(shape) - reference)
            return (gated.reshape(z.shape), *args[1:])
        return gate


class Patcher:
    """Runs a task batch through a model with head gates, in mini-batches."""

    def __init__(self, model, batch: TaskBatch, ablation: str, batch_size: int,
                 references: list[torch.Tensor] | None = None, means: dict | None = None):
        """``references``: what an ablated head's slice is replaced by, given ([rows, tokens,
        heads · head_dim] per layer, the batch's rows: mediation patches another run's activations
        in), instead of one of ``ABLATIONS``. ``means``: under ``mean`` ablation, each template's
        mean over a pool held apart from the batch (``held_apart_means``); None: this batch's own,
        which holds each ablated prompt and so ablates it only in part (tests use it)."""
        if references is None and ablation not in ABLATIONS:
            raise ValueError(f"ablation must be one of {ABLATIONS}, not {ablation!r}")
        self.model, self.batch, self.means = model, batch, means
        self.batch_size = batch.whole_prompts(batch_size)
        model.requires_grad_(False)
        self.gates = HeadGates(model)
        self.device = model.device
        self.positions = batch.positions
        self.references = (self._references(ablation) if references is None else
                           [[z[rows].to(self.device) for z in references] for rows in self._chunks()])

    def per_prompt_with_head_inputs(self) -> tuple[np.ndarray, list[torch.Tensor]]:
        """``per_prompt(None)``'s metrics and each layer's output-projection input [rows, tokens,
        heads · head_dim] of the batch's sequences, unpatched, in one run."""
        self.gates.capturing, self.gates.reference = True, None
        chunks, metrics = [], []
        with torch.no_grad():
            for rows in self._chunks():
                metrics.append(self._metric(self.batch.clean, rows))
                chunks.append(list(self.gates.captured))
        self.gates.capturing = False
        inputs = [torch.cat([chunk[layer] for chunk in chunks]) for layer in range(self.gates.n_layers)]
        return torch.cat(metrics).double().cpu().numpy(), inputs

    def _chunks(self) -> list[slice]:
        return self.batch.chunks(self.batch_size)

    def _logits(self, ids: torch.Tensor, rows: slice, copies: int = 1, start: int = 0, past=None,
                record: LayerInputs | None = None, read: str = "tokens", **parts) -> torch.Tensor:
        """Logits at the last positions of ``rows`` (repeated ``copies`` times, one block of rows
        after another), with the head gates and any other ``intervened`` parts. ``read``: "all"
        computes every logit (attribution, whose gradients then stay what they were to the last
        bit); "tokens" only those the metric reads (-inf for the others), with the same values to
        the last bit (the sweeps); "fast" also only at the last ``read_positions``, to float
        rounding (exact patching; ``readout.Readout``). ``start`` and ``past``: run positions
        from ``start`` on, the earlier ones' keys and values cached in ``past``. ``record``: also
        keep the model's cache of every position (``record.cache``)."""
        def take(tensor):
            return tensor[rows].repeat(copies, 1).to(self.device)
        # the last 2 positions (every task's metric reads at most those) unless a metric reads more
        keep = self.batch.read_positions if read == "fast" else max(LOGITS_KEPT, self.batch.read_positions)
        readout = None if read == "all" else Readout(keep, self.batch.read_tokens, fast=read == "fast")
        with intervened(self.model, head_gates=self.gates, record=record, readout=readout, **parts):
            out = self.model(input_ids=take(ids)[:, start:], attention_mask=take(self.batch.mask),
                             position_ids=take(self.positions)[:, start:], past_key_values=past,
                             use_cache=record is not None, logits_to_keep=keep)
        if record is not None:
            record.cache = out.past_key_values
        return out.logits

    def _metric(self, ids: torch.Tensor, rows: slice) -> torch.Tensor:
        return self.batch.metric(self._logits(ids, rows), self.batch.prompts_of(rows))

    def _references(self, ablation: str) -> list[list[torch.Tensor]]:
        """Per chunk, per layer: what an ablated head's slice is replaced by."""
        self.gates.capturing = True
        source = self.batch.corrupted if ablation == "corrupted" else self.batch.clean
        references = []
        with torch.no_grad():
            for rows in self._chunks():
                self._logits(source, rows)
                references.append(list(self.gates.captured))
        self.gates.capturing = False
        if ablation == "zero":
            return [[torch.zeros_like(z) for z in chunk] for chunk in references]
        if ablation == "mean":
            return self._template_means(references)
        return references

    def _template_means(self, references):
        """Each row's slice replaced, on its template's tokens, by the template's mean: the given
        ``means``, or this batch's (prompts of one template have equal lengths by construction)."""
        layers = [torch.cat([chunk[layer] for chunk in references]) for layer in range(self.gates.n_layers)]
        means = self.means if self.means is not None else _means_by_template(layers, self.batch)
        lengths = self.batch.mask.sum(1).tolist()
        for row, template in enumerate(self.batch.templates):
            if template not in means:
                raise ValueError(f"mean ablation: template {template} of row {row} has no mean among the "
                                 f"{len(means)} templates given (means must come from a superset of the batch)")
            for z, mean in zip(layers, means[template]):
                if mean.shape[0] != lengths[row]:
                    raise ValueError(f"mean ablation: row {row} (template {template}) has {lengths[row]} tokens, "
                                     f"its template's mean {mean.shape[0]}")
                z[row, z.shape[1] - lengths[row]:] = mean.to(z.device, z.dtype)
        return [[z[rows] for z in layers] for rows in self._chunks()]

    def _per_chunk(self, gates: torch.Tensor | None) -> list[torch.Tensor]:
        """The metric of every prompt, chunk by chunk, with the given gates (None: unpatched)."""
        if gates is not None:
            self.gates.gates = gates.to(self.device)
        values = []
        with torch.no_grad():
            for rows, reference in zip(self._chunks(), self.references):
                self.gates.reference = None if gates is None else reference
                values.append(self._metric(self.batch.clean, rows))
        self.gates.reference = None
        return values

    def metric(self, gates: torch.Tensor | None = None) -> float:
        """Mean task metric with the given gates (None: the unpatched model)."""
        return _mean(self._per_chunk(gates), self.batch.n_prompts)

    def per_prompt(self, gates: torch.Tensor | None = None) -> tuple[float, np.ndarray]:
        """The mean metric (as ``metric``) and the metric of each prompt, with the given gates."""
        values = self._per_chunk(gates)
        return _mean(values, self.batch.n_prompts), torch.cat(values).double().cpu().numpy()

    def corrupted_metric(self) -> float:
        self.gates.reference = None
        with torch.no_grad():
            values = [self._metric(self.batch.corrupted, rows).sum() for rows in self._chunks()]
        return float(sum(values)) / self.batch.n_prompts

    def corrupted_per_prompt(self) -> np.ndarray:
        """The unpatched model's metric on each corrupted prompt (``corrupted_metric``'s terms)."""
        self.gates.reference = None
        with torch.no_grad():
            values = [self._metric(self.batch.corrupted, rows) for rows in self._chunks()]
        return torch.cat(values).double().cpu().numpy()

    def attribution(self) -> torch.Tensor:
        """d mean-metric / d gate for every head at gates = 1: [layers, heads]."""
        gates = torch.ones(self.gates.n_layers, self.gates.n_heads, device=self.device, requires_grad=True)
        for rows, reference in zip(self._chunks(), self.references):
            self.gates.reference, self.gates.gates = reference, gates
            logits = self._logits(self.batch.clean, rows, read="all")
            metric = self.batch.metric(logits, self.batch.prompts_of(rows)).sum() / self.batch.n_prompts
            metric.backward()
        self.gates.reference = None
        return gates.grad.detach().cpu()

    def attribution_per_prompt(self) -> torch.Tensor:
        """``attribution`` of each prompt alone: [prompts, layers, heads] of d metric_i / d gate,
        one set of gates per row (a row's metric depends on its own gates only, so one backward
        of the summed metric gives every row's gradient)."""
        grads = []
        for rows, reference in zip(self._chunks(), self.references):
            n_rows = rows.stop - rows.start
            gates = torch.ones(self.gates.n_layers, n_rows, self.gates.n_heads, device=self.device,
                               dtype=torch.float64, requires_grad=True)
            self.gates.reference, self.gates.gates = reference, gates
            logits = self._logits(self.batch.clean, rows, read="all")
            self.batch.metric(logits, self.batch.prompts_of(rows)).sum().backward()
            grads.append(gates.grad.detach().cpu().permute(1, 0, 2))
        self.gates.reference, self.gates.gates = None, torch.ones(self.gates.n_layers, self.gates.n_heads,
                                                                  device=self.device)
        return torch.cat(grads)

    def exact(self) -> torch.Tensor:
        """metric(all heads) − metric(that head ablated) for every head: [layers, heads].

        Per chunk of prompts, one clean forward records every layer's input, o_proj's input and
        keys and values (``resume.LayerInputs``). Then each layer's heads are ablated together,
        one copy of the chunk per head, in passes that resume at that layer (``resume.ResumeAt``):
        nothing below the layer is recomputed, nor its own attention, nor any position before
        the first one where the ablation changes the layer's o_proj input (corrupted patching:
        the first token where the corrupted prompt differs), whose keys and values are the
        clean run's. Equal to ``exact_one_forward_per_head`` up to float rounding; a head of
        layer L costs at most (layers − L − 1) layers and L's o_proj and MLP: half a forward on
        average over the layers, a third measured (fewer positions; benchmarks/throughput/pruning_cost.py).
        """
        full, ablated = self._exact_runs()
        return (_mean(full, self.batch.n_prompts) - ablated.sum(0) / self.batch.n_prompts).float()

    def exact_per_prompt(self) -> torch.Tensor:
        """``exact`` of each prompt alone: [prompts, layers, heads] (the same passes)."""
        full, ablated = self._exact_runs()
        return torch.cat(full).double().cpu()[:, None, None] - ablated

    def _exact_runs(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(each chunk's unpatched metric per prompt, [prompts, layers, heads] each prompt's metric
        with one head ablated), by the resumed passes ``exact`` describes."""
        layers, heads = self.gates.n_layers, self.gates.n_heads
        full, ablated = [], torch.zeros(self.batch.n_prompts, layers, heads, dtype=torch.float64)
        with torch.no_grad():
            for rows, reference in zip(self._chunks(), self.references):
                recorded = LayerInputs()
                self.gates.reference = None
                full.append(self.batch.metric(self._logits(self.batch.clean, rows, record=recorded, read="fast"),
                                              self.batch.prompts_of(rows)))
                for layer in tqdm(range(layers), desc="exact patching", unit="layer", mininterval=10):
                    start = min(self._first_changed(reference[layer], recorded.attention[layer]),
                                cached_positions(recorded.cache))
                    for group in self._head_groups(rows, start):
                        ablated[self.batch.prompts_of(rows), layer, group] = self._ablated(
                            layer, group, rows, recorded, reference, start).T
        self.gates.reference = None
        return full, ablated

    def _first_changed(self, reference: torch.Tensor, clean: torch.Tensor) -> int:
        """The first position where ablating a head of this layer can change anything: where
        the reference first differs from the clean o_proj input, in any row (at most the first
        position the metric reads)."""
        changed = (reference != clean).flatten(2).any(-1).any(0).nonzero()
        last = clean.shape[1] - self.batch.read_positions
        return min(int(changed[0]), last) if len(changed) else last

    def _head_groups(self, rows: slice, start: int = 0) -> list[list[int]]:
        """Heads ablated in one pass: as many copies of the chunk as the batch size allows (and,
        on a CPU, as keep the pass near RESUMED_TOKENS tokens)."""
        n_rows = rows.stop - rows.start
        per_pass = self.batch_size // n_rows
        tokens = RESUMED_TOKENS.get(self.device.type)
        if tokens is not None:
            per_pass = min(per_pass, tokens // (n_rows * (self.batch.clean.shape[1] - start)))
        heads = list(range(self.gates.n_heads))
        per_pass = max(1, per_pass)
        return [heads[i:i + per_pass] for i in range(0, len(heads), per_pass)]

    def _ablated(self, layer: int, group: list[int], rows: slice, recorded: LayerInputs,
                 reference: list[torch.Tensor], start: int) -> torch.Tensor:
        """[heads of ``group``, prompts]: each prompt's metric with each head of ``group`` (of
        ``layer``) ablated, one copy of the chunk per head, resumed at ``layer`` and ``start``."""
        copies, n_rows = len(group), rows.stop - rows.start
        gates = torch.ones(self.gates.n_layers, copies, n_rows, self.gates.n_heads, device=self.device)
        for copy, head in enumerate(group):
            gates[layer, copy, :, head] = 0
        self.gates.gates = gates.flatten(1, 2)
        self.gates.reference = [None] * self.gates.n_layers

        def tiled(tensor):
            return tensor[:, start:].repeat(copies, 1, 1)
        self.gates.reference[layer] = tiled(reference[layer])
        resume = ResumeAt(layer, tiled(recorded.hidden[layer]), tiled(recorded.attention[layer]))
        past = prefix_cache(self.model, recorded.cache, start, copies)
        logits = self._logits(self.batch.clean, rows, copies, start=start, past=past, read="fast", resume=resume)
        prompts = self.batch.prompts_of(rows)
        return torch.stack([self.batch.metric(block, prompts).double().cpu() for block in logits.split(n_rows)])

    def exact_one_forward_per_head(self) -> torch.Tensor:
        """``exact`` by one full forward per head (the path before resuming: kept to check it)."""
        full = self.metric(torch.ones(self.gates.n_layers, self.gates.n_heads))
        scores = torch.zeros(self.gates.n_layers, self.gates.n_heads)
        heads = [(l, h) for l in range(self.gates.n_layers) for h in range(self.gates.n_heads)]
        for layer, head in tqdm(heads, desc="exact patching", unit="head", mininterval=10):
            gates = torch.ones(self.gates.n_layers, self.gates.n_heads)
            gates[layer, head] = 0
            scores[layer, head] = full - self.metric(gates)
        return scores

    def kept(self, order: list[tuple[int, int]], k: int) -> torch.Tensor:
        """Gates keeping the first k heads of ``order``, ablating the rest."""
        gates = torch.zeros(self.gates.n_layers, self.gates.n_heads)
        for layer, head in order[:k]:
            gates[layer, head] = 1
        return gates


def held_apart_means(model, tokenizer, prompts, drawn, batch_size: int):
    """Mean ablation's reference for ``prompts``: ``template_means`` over the prompts of ``drawn``
    (a pool the caller drew with its own seed) held apart from them (``tasks.held_apart``).
    Returns (the means, the pool)."""
    pool = held_apart(drawn, prompts)
    return template_means(model, build_batch(pool, tokenizer), batch_size), pool


def template_means(model, batch: TaskBatch, batch_size: int) -> dict:
    """Each template's mean output-projection input over ``batch``'s clean prompts of that
    template, per layer, on the template's tokens ({template: [[tokens, heads · head_dim] per
    layer]}): the reference of ``mean`` ablation, taken once over a pool held apart from a task's
    prompts (``held_apart_means``) and given to the patchers of its splits (``Patcher(means=...)``)."""
    _, inputs = Patcher(model, batch, "given", batch_size, references=[]).per_prompt_with_head_inputs()
    return _means_by_template(inputs, batch)


def _means_by_template(layers: list[torch.Tensor], batch: TaskBatch) -> dict:
    """{template: each layer's mean over the template's rows of ``layers`` ([rows, tokens, width],
    left padded), on its last tokens}; warns where a template has one prompt (its own mean)."""
    templates = np.asarray(batch.templates)
    lengths = batch.mask.sum(1)
    alone = int(sum((templates == template).sum() == 1 for template in np.unique(templates)))
    if alone:  # its own mean: ablating that prompt's heads changes nothing (IOI has 30 template variants)
        log.warning("mean ablation: %d of %d templates have one prompt among the %d the mean is taken over, so "
                    "each is its own mean and ablating its heads changes nothing; raise the task's n", alone,
                    len(np.unique(templates)), len(templates))
    means = {}
    for template in np.unique(templates):
        rows = torch.from_numpy(np.nonzero(templates == template)[0])
        length = int(lengths[rows[0]])
        if not bool((lengths[rows] == length).all()):
            raise ValueError(f"mean ablation: the prompts of template {template} differ in token length")
        key = template.item() if hasattr(template, "item") else template
        means[key] = [z[rows.to(z.device), z.shape[1] - length:].mean(0) for z in layers]
    return means


def _mean(values: list[torch.Tensor], n: int) -> float:
    """Sum of the chunks' sums over n (each chunk summed first: the order every mean here uses)."""
    return sum(float(v.sum()) for v in values) / n
