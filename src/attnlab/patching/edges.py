"""Edge circuits: every edge's score by edge attribution patching with integrated gradients
(EAP-IG), and the exact metric of a circuit that keeps the top-n edges.

The prompts, metric and corrupted inputs are a head sweep's (``patching.batch.TaskBatch``); the edges
are those of ``edges.Graph`` and every pass goes through ``intervened(model, edges=...)``.

- Scores: score(s → r) = (a_s(clean) − a_s(corrupted)) · mean over k = 1..steps of
  ∂m/∂x_r at the input embeddings corrupted + (k / steps)(clean − corrupted), summed over positions
  and prompts, with m the task metric's mean over prompts: a linear estimate of how much the
  metric drops when that one edge carries the corrupted activation. The Riemann sum ends at the
  clean input, so ``steps=1`` is plain edge attribution patching (EAP, the gradient at the
  clean input). Hanna et al.'s code takes k = 0..steps−1 (ending next to the corrupted input);
  for steps ≥ 5 the two differ by a step of the sum. Cost: a recording forward of the corrupted
  run and ``steps`` forward-and-backward passes per batch of prompts (the last one, at the clean
  input, records the clean run). Its memory grows with the points of a mini-batch (the tokens from
  each prompt's first clean/corrupted difference on): every receiver's gradient and every
  sender's clean and corrupted activation at each point. ``score_chunk`` bounds it: the points
  are taken ``score_chunk`` at a time, each chunk with its own recording forward and ``steps``
  passes (the scores are a sum over points, so the chunks add up to the same matrix; the passes
  multiply by the chunks).
- Evaluation: a circuit keeps n edges (ranked by |score|); every other edge carries its sender's
  corrupted activation (``edges.EdgePatch``). Keeping every edge is the clean forward, none the
  corrupted one. The corrupted run of each batch is recorded once and reused for every n, as long
  as the recordings kept fit ``cache_bytes`` (None: all of them); a batch past it is recorded
  again at every evaluation (one more forward for that batch). A recording holds every sender's
  activation at the batch's points: at OLMo-7B's width about 9 MB per IOI prompt and layer in float32.
- Sweep: n on a log grid, refined around the first crossing of the threshold by log-spaced
  rounds until the crossing is found to the edge (``curves.refined_sweep``); the count's
  interval comes from ``counting.count_heads``, which works on any ranked components.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from attnlab import anatomy
from attnlab.interventions import intervened
from attnlab.interventions.edges import EdgePatch, Graph, Plan, ReceiverGradients, Recording
from attnlab.interventions.readout import Readout
from attnlab.patching.batch import LOGITS_KEPT, TaskBatch


class EdgeCircuits:
    """A task batch's edge scores and circuit metrics on one model, in mini-batches."""

    def __init__(self, model, batch: TaskBatch, batch_size: int, refine_points: int = 12,
                 score_chunk: int | None = None, cache_bytes: int | None = None):
        if score_chunk is not None and score_chunk < 1:
            raise ValueError(f"score_chunk is the points (tokens) scored per pass: at least 1, not {score_chunk}")
        if cache_bytes is not None and cache_bytes < 0:
            raise ValueError(f"cache_bytes bounds the corrupted recordings kept: 0 or more, not {cache_bytes}")
        self.model, self.batch, self.refine_points = model, batch, refine_points
        model.requires_grad_(False)
        self.graph = Graph.of(model)
        self.edges = self.graph.edges()
        self.batch_size, self.score_chunk, self.cache_bytes = batch_size, score_chunk, cache_bytes
        self.device = model.device
        self.positions = batch.positions
        # each mini-batch's corrupted recording (None: not kept, recorded again when needed) and metric
        self._kept: list[Recording | None] | None = None
        self._corrupted_metrics: list[torch.Tensor] | None = None
        self._table: torch.Tensor | None = None  # one senders' table for every batch's patched passes

    # ---- passes ----
    def _chunks(self) -> list[slice]:
        return self.batch.chunks(self.batch_size)

    def _logits(self, rows: slice, patch: EdgePatch, ids: torch.Tensor | None = None,
                embeds: torch.Tensor | None = None, every_token: bool = False) -> torch.Tensor:
        readout = Readout(LOGITS_KEPT, None if every_token else self.batch.read_tokens)
        inputs = {"inputs_embeds": embeds} if embeds is not None else {"input_ids": ids[rows].to(self.device)}
        with intervened(self.model, edges=patch, readout=readout):
            return self.model(**inputs, attention_mask=self.batch.mask[rows].to(self.device),
                              position_ids=self.positions[rows].to(self.device), use_cache=False,
                              logits_to_keep=LOGITS_KEPT).logits

    def _record(self, ids: torch.Tensor, rows: slice, points: torch.Tensor | None = None
                ) -> tuple[Recording, torch.Tensor]:
        # the points on the model's device: every layer of a pass selects them
        recording = Recording(points=None if points is None else points.to(self.device))
        with torch.no_grad():
            logits = self._logits(rows, EdgePatch(self.graph, record=recording), ids=ids)
        return recording, self.batch.metric(logits, self.batch.prompts_of(rows))

    def _record_corrupted(self) -> None:
        """Each mini-batch's corrupted run recorded and its metric kept; the recordings kept while
        they fit ``cache_bytes``."""
        if self._kept is not None:
            return
        self._kept, self._corrupted_metrics, held = [], [], 0
        for rows in self._chunks():
            recording, metric = self._record(self.batch.corrupted, rows, self.batch.differing_points(rows))
            held += recording_bytes(recording)  # a prefix is kept: past the first that does not fit, none
            self._kept.append(recording if self.cache_bytes is None or held <= self.cache_bytes else None)
            self._corrupted_metrics.append(metric)
            del recording  # one not kept is freed before the next is recorded

    def corrupted_run(self, index: int) -> Recording:
        """Mini-batch ``index``'s corrupted recording: the kept one, or recorded again."""
        self._record_corrupted()
        if self._kept[index] is not None:
            return self._kept[index]
        rows = self._chunks()[index]
        return self._record(self.batch.corrupted, rows, self.batch.differing_points(rows))[0]

    @property
    def corrupted(self) -> list[Recording]:
        """Every mini-batch's corrupted recording (those not kept recorded again, all held at once)."""
        return [self.corrupted_run(index) for index in range(len(self._chunks()))]

    @property
    def recordings_kept(self) -> tuple[int, int]:
        """(mini-batches whose corrupted recording is kept between evaluations, mini-batches)."""
        self._record_corrupted()
        return sum(recording is not None for recording in self._kept), len(self._kept)

    # ---- scores ----
    def scores(self, steps: int = 5) -> torch.Tensor:
        """[senders, receivers] EAP-IG score of every edge (0 where there is no edge)."""
        if steps < 1:
            raise ValueError(f"EAP-IG needs at least 1 step, not {steps}")
        scores = torch.zeros(self.graph.n_senders, self.graph.n_receivers, dtype=torch.float64)
        embed = anatomy.of(self.model).input_embeddings
        for rows in tqdm(self._chunks(), desc="edge scores", unit="batch", mininterval=10):
            with torch.no_grad():
                clean_in = embed(self.batch.clean[rows].to(self.device))
                corrupted_in = embed(self.batch.corrupted[rows].to(self.device))
            points = self.batch.differing_points(rows)  # elsewhere clean − corrupted is 0
            size = len(points) if self.score_chunk is None else self.score_chunk
            for start in range(0, len(points), max(size, 1)):
                scores += self._scores_at(rows, points[start:start + size], clean_in, corrupted_in, steps)
        return scores.float()

    def _scores_at(self, rows: slice, points: torch.Tensor, clean_in: torch.Tensor, corrupted_in: torch.Tensor,
                   steps: int) -> torch.Tensor:
        """The scores' terms at ``points`` of mini-batch ``rows``: the corrupted run recorded there,
        then ``steps`` forward-and-backward passes keeping the receivers' gradients there."""
        graph = self.graph
        corrupted = Recording(points=points.to(self.device), keeps_elsewhere=False)
        with torch.no_grad():
            self._logits(rows, EdgePatch(graph, record=corrupted), ids=self.batch.corrupted)
        points = points.to(self.device)
        gradients, clean = ReceiverGradients(points=points), Recording(points=points, keeps_elsewhere=False)
        for k in range(1, steps + 1):
            # the last step is the clean input itself: its pass records the clean run too
            embeds = clean_in if k == steps else corrupted_in + (k / steps) * (clean_in - corrupted_in)
            patch = EdgePatch(graph, gradients=gradients, record=clean if k == steps else None)
            logits = self._logits(rows, patch, embeds=embeds)
            metric = self.batch.metric(logits, self.batch.prompts_of(rows)).sum() / self.batch.n_prompts
            metric.backward()
        return _edge_scores(graph, clean.senders.sub_(corrupted.senders), gradients, steps)

    # ---- circuits ----
    def kept(self, order: np.ndarray, n: int) -> torch.Tensor:
        """The mask keeping the first n edges of ``order`` (indices into ``self.edges``)."""
        chosen = self.edges.iloc[np.asarray(order[:n], dtype=int)]
        return self.graph.mask(chosen["sender"].to_numpy(), chosen["receiver"].to_numpy())

    def per_prompt(self, kept: torch.Tensor | None = None) -> tuple[float, np.ndarray]:
        """The mean metric and each prompt's with only the ``kept`` edges carrying the clean
        activations (None: the clean forward, unpatched)."""
        plan = None if kept is None else Plan.of(self.graph, kept)  # one for every batch
        with torch.no_grad():
            values = [self._batch_metric(index, rows, kept, plan) for index, rows in enumerate(self._chunks())]
        return sum(float(v.sum()) for v in values) / self.batch.n_prompts, torch.cat(values).double().cpu().numpy()

    def _batch_metric(self, index: int, rows: slice, kept: torch.Tensor | None, plan: Plan | None) -> torch.Tensor:
        """Mini-batch ``index``'s metric with the ``kept`` edges (its own frame: a recording made
        again for it is freed before the next mini-batch's is made)."""
        if kept is None:
            return self.batch.metric(self._logits(rows, EdgePatch(self.graph), ids=self.batch.clean),
                                     self.batch.prompts_of(rows))
        corrupted = self._with_table(self.corrupted_run(index))
        patch = EdgePatch(self.graph, kept=kept, corrupted=corrupted, plan=plan)
        metric = self.batch.metric(self._logits(rows, patch, ids=self.batch.clean), self.batch.prompts_of(rows))
        corrupted.table = None  # the shared table: the next batch's
        return metric

    def _with_table(self, corrupted: Recording) -> Recording:
        """``corrupted`` given a view of the one senders' table every batch's patched pass uses in
        turn (each pass writes every row it reads: ``Recording.table``), grown to the largest."""
        senders, points, hidden = corrupted.senders.shape
        size = (senders + 2) * points * hidden
        if self._table is None or self._table.numel() < size or self._table.dtype != corrupted.senders.dtype:
            # NaN until first written, so that a sum reading a row no pass wrote shows in the first
            # metrics (after that the rows hold an earlier pass's values: the rule stands)
            self._table = corrupted.senders.new_full((size,), float("nan"))
        corrupted.table = self._table[:size].view(senders + 2, points, hidden)
        return corrupted

    def patched_logits(self, index: int, kept: torch.Tensor | None = None, weights: torch.Tensor | None = None,
                       every_token: bool = False) -> torch.Tensor:
        """Mini-batch ``index``'s logits at the last positions on its clean prompts, with only the
        ``kept`` edges carrying the clean activations, or each edge its ``weights`` mix of clean
        and corrupted (differentiable in them), or neither (the clean forward); ``every_token``:
        every token's logit (a KL divergence), else those the metric reads."""
        chunk = self._chunks()[index]
        if kept is None and weights is None:
            patch = EdgePatch(self.graph)
        else:
            patch = EdgePatch(self.graph, kept=kept, weights=weights,
                              corrupted=self.corrupted_run(index) if weights is not None
                              else self._with_table(self.corrupted_run(index)))
        try:
            return self._logits(chunk, patch, ids=self.batch.clean, every_token=every_token)
        finally:
            if patch.corrupted is not None:
                patch.corrupted.table = None  # the shared table: the next batch's

    def metric(self, kept: torch.Tensor | None = None) -> float:
        return self.per_prompt(kept)[0]

    def corrupted_metric(self) -> float:
        self._record_corrupted()
        return float(sum(metric.sum() for metric in self._corrupted_metrics)) / self.batch.n_prompts


def recording_bytes(recording: Recording) -> int:
    """The bytes of the tensors ``recording`` holds."""
    tensors = [recording.senders, recording.final, recording.table, *recording.layer_inputs.values(),
               *recording.middle.values(), *recording.head_inputs.values(), *recording.attention_outputs.values(),
               *recording.elsewhere.values()]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors if tensor is not None)


def _edge_scores(graph: Graph, differences: torch.Tensor, gradients: ReceiverGradients, steps: int) -> torch.Tensor:
    """Σ over the points (flat row × token indices: the recordings' and the gradients') and
    hidden units of (clean − corrupted) sender activations ``differences`` [senders, points,
    hidden] · the receivers' gradients summed over the steps, over ``steps``: [senders,
    receivers]. One matrix product per layer's receivers (its heads' and its MLP's), one for the
    logits."""
    scores = torch.zeros(graph.n_senders, graph.n_receivers, dtype=torch.float64)
    flat = differences.flatten(1)  # [senders, points x hidden], a view

    def block(receivers: slice) -> torch.Tensor:
        """[senders upstream of the last of ``receivers``, receivers]."""
        gradient = gradients.gradient(receivers.start)  # [receivers, points, hidden]
        if gradient.shape[1:] != differences.shape[1:]:
            raise ValueError(f"receiver gradients at {tuple(gradient.shape[1:])} [points, hidden], sender "
                             f"differences at {tuple(differences.shape[1:])}: keep both at the same points")
        return (flat[:graph.upstream(receivers.stop - 1)] @ gradient.flatten(1).T.to(flat.dtype) / steps).double().cpu()
    for layer in range(graph.n_layers):
        attention, mlp = graph.attention_slice(layer), graph.mlp_receiver(layer)
        both = block(graph.layer_receivers(mlp))  # the attention columns' extra rows (this layer's heads) unused
        scores[:graph.upstream(attention.start), attention] = both[:graph.upstream(attention.start), :-1]
        scores[:graph.upstream(mlp), mlp] = both[:, -1]
    scores[:, graph.logits_receiver] = block(graph.layer_receivers(graph.logits_receiver))[:, 0]
    return scores


def ranked_edges(graph: Graph, scores: torch.Tensor) -> pd.DataFrame:
    """Every edge with its score and rank by |score| (1: the largest; ties in edge order)."""
    edges = graph.edges()
    senders, receivers = (torch.from_numpy(edges[column].to_numpy(copy=True)) for column in ("sender", "receiver"))
    edges["score"] = scores[senders, receivers].numpy()
    edges["rank"] = edges["score"].abs().rank(ascending=False, method="first").astype(int)
    return edges
