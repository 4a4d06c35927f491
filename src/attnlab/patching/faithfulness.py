"""How far a circuit's output is from the full model's on a task batch: what ACDC prunes against
and Edge Pruning trains on (``patching.acdc``, ``patching.edge_pruning``).

Two measures (``pruning.edges.faithfulness``), each against the clean forward of the same
prompts:

- ``kl``: the KL divergence KL(full ‖ circuit) of the next-token distributions at each row's
  last position over the whole vocabulary, averaged over rows (ACDC's and Edge Pruning's default);
- ``metric``: the task metric (the one every sweep counts with). ACDC's distance is |1 − explained
  effect| of the circuit, (m̄_circuit − m̄_corrupted) / (m̄_clean − m̄_corrupted) over the prompts;
  Edge Pruning's loss the mean over prompts of ((m_circuit − m_clean) / (m̄_clean − m̄_corrupted))²,
  a per-prompt distance as the KL is.
"""

from __future__ import annotations

import torch

KINDS = ("kl", "metric")


class Faithfulness:
    """The clean references of ``circuits``' mini-batches and the distance of a circuit from them."""

    def __init__(self, circuits, kind: str):
        if kind not in KINDS:
            raise ValueError(f"faithfulness: one of {KINDS}, not {kind!r}")
        self.circuits, self.kind = circuits, kind
        batch = circuits.batch
        self.references, clean = [], 0.0
        with torch.no_grad():  # one clean pass per mini-batch gives both the reference and the metric
            for index in range(len(batch.chunks(circuits.batch_size))):
                logits = circuits.patched_logits(index, every_token=kind == "kl")
                metric = self._metric(logits, index)
                clean += float(metric.sum())
                self.references.append(torch.log_softmax(logits[:, -1].double(), -1) if kind == "kl" else metric)
        self.clean = clean / batch.n_prompts
        self.corrupted = circuits.corrupted_metric()
        self.span = self.clean - self.corrupted
        if kind == "metric" and abs(self.span) < 1e-12:
            raise ValueError(f"faithfulness 'metric': the clean and corrupted metrics are equal ({self.clean:.4g}), "
                             "so no circuit's explained effect is defined; use faithfulness: kl")
        self.rows = len(batch.clean)

    @property
    def batches(self) -> int:
        return len(self.references)

    def _metric(self, logits: torch.Tensor, index: int) -> torch.Tensor:
        rows = self.circuits.batch.chunks(self.circuits.batch_size)[index]
        return self.circuits.batch.metric(logits, self.circuits.batch.prompts_of(rows)).double()

    def batch_term(self, index: int, kept: torch.Tensor | None = None, weights: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """Mini-batch ``index``'s share of the distance (summed over the mini-batches it is the
        whole): the KL summed over its rows over every row; for ``metric``, its metric summed over
        its prompts over every prompt (``kept``: ACDC) or its squared gaps likewise (``weights``:
        Edge Pruning)."""
        circuits = self.circuits
        logits = circuits.patched_logits(index, kept=kept, weights=weights, every_token=self.kind == "kl")
        reference = self.references[index]
        if self.kind == "kl":
            own = torch.log_softmax(logits[:, -1].double(), -1)
            return (reference.exp() * (reference - own)).sum() / self.rows
        metric = self._metric(logits, index)
        if weights is None:
            return metric.sum() / circuits.batch.n_prompts
        return (((metric - reference) / self.span) ** 2).sum() / circuits.batch.n_prompts

    def distance(self, kept: torch.Tensor) -> float:
        """ACDC's distance of the circuit keeping ``kept`` from the full model: the KL, or
        |1 − explained effect|."""
        with torch.no_grad():
            total = float(sum(self.batch_term(index, kept=kept) for index in range(self.batches)))
        if self.kind == "kl":
            return total
        return abs(1.0 - (total - self.corrupted) / self.span)
