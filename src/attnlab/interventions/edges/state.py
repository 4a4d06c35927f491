"""What the hooks and stand-ins of one installed ``EdgePatch`` share: the patch and the model's
layers, the tokens a patched pass computes (``points``), the senders' table, and what the pass
holds for the layer under way."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnlab.anatomy import NormSpec
from attnlab.interventions.edges.points import select_points


@dataclass(eq=False)
class GroupInputs:
    """What a group of receivers reading one point of the residual stream reads at the patched
    points: the receivers at offsets ``mixed_at`` (within the group) their own mixes ``mixed``
    [len(mixed_at), points, hidden]; those at ``corrupted_at`` the corrupted residual
    ``corrupted`` [points, hidden] as it is; the others the live residual as it is."""

    mixed: torch.Tensor | None
    mixed_at: list[int]
    corrupted: torch.Tensor
    corrupted_at: list[int]
    corrupted_normed: torch.Tensor | None = None  # the pre-norm of ``corrupted``, once per group


class PassState:
    """The state of one ``EdgePatch`` (``patch``) installed on one model, read and written by its
    sender hooks, receiver hooks and stand-ins."""

    def __init__(self, patch, model, parts):
        self.patch, self.graph, self.plan = patch, patch.graph, patch.plan
        self.parts = parts  # the model's anatomy
        # the receivers' inputs of the layer under way (its query/key/value heads)
        self.attention_inputs: dict[int, GroupInputs] = {}
        self.live_inputs: dict[int, torch.Tensor] = {}  # each layer's input, kept for receiver gradients
        self.heads_written: set[int] = set()  # layers whose heads' differences this pass has written
        # with edge weights: each sender's (live − corrupted) [points, hidden], kept in the graph
        # (no table written in place: autograd reads every one in the backward pass)
        self.weighted = patch.weights is not None
        self.differences: dict[int, torch.Tensor] = {}
        self.hidden, self.device = parts.hidden, model.device
        self.points = None if patch.plan is None else patch.corrupted.points
        self.unpatched_points = None  # the other tokens of the pass
        if self.points is not None:
            self.points = self.points.to(model.device)
            self.unpatched_points = patch.corrupted.unpatched(model.device)
        # tokens before every prompt's first difference are not recomputed (all edges kept: the
        # unpatched forward, untouched)
        self.restricted = (self.points is not None and len(self.unpatched_points) > 0
                           and bool(self.plan.patched.any()))

    def clear(self) -> None:
        """Forget what the last pass held (a pass starts at layer 0; the patch is removed)."""
        self.attention_inputs.clear()
        self.live_inputs.clear()
        self.heads_written.clear()
        self.differences.clear()

    def input_norm(self, layer: int) -> NormSpec | None:
        """What the norm before a layer's attention computes (``anatomy.norm_spec`` keeps it while
        the norm's parameters stay as they are); None where the family has none (OLMo-2)."""
        norm = self.parts.norm(layer, "attention_in")
        return None if norm is None else self.parts.spec(norm, self.device)

    def input_normed(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The norm before a layer's attention (the module itself) applied to ``x``."""
        norm = self.parts.norm(layer, "attention_in")
        return x if norm is None else norm(x)

    def table(self) -> torch.Tensor:
        """The corrupted recording's table (``Recording.table``), made at the first pass patched
        against it; NaN until written, so a sum reading a row no pass wrote shows in the metrics."""
        corrupted = self.patch.corrupted
        if corrupted.table is None:
            senders, points, hidden = corrupted.senders.shape
            corrupted.table = corrupted.senders.new_full((senders + 2, points, hidden), float("nan"))
        return corrupted.table

    # ---- the tokens before each prompt's first difference ----
    def keep_elsewhere(self, key: tuple, out: torch.Tensor) -> None:
        """On a recording pass that keeps only some points, keep ``out`` [rows, tokens, features]
        at the others."""
        record = self.patch.record
        if record is not None and record.points is not None and record.keeps_elsewhere:
            record.elsewhere[key] = select_points(out.detach(), record.unpatched(out.device))

    def recorded_elsewhere(self, like: torch.Tensor, key: tuple) -> torch.Tensor:
        """[rows, tokens, features] (``like``'s rows and tokens) holding the corrupted recording's
        ``key`` output at the tokens before each prompt's first difference (every pass computes
        the same there), left to fill at the patched points."""
        recorded = self.patch.corrupted.elsewhere[key]
        out = recorded.new_empty(*like.shape[:-1], recorded.shape[-1])
        out.view(-1, recorded.shape[-1]).index_copy_(0, self.unpatched_points, recorded)
        return out

    def at_patched_points(self, x: torch.Tensor, key: tuple, module) -> torch.Tensor:
        """``module`` (token by token) of ``x`` [rows, tokens, features] computed at the patched
        points; elsewhere the corrupted recording's output."""
        return self.at_points(x, module(select_points(x, self.points)), lambda: self.recorded_elsewhere(x, key))

    def at_points(self, like: torch.Tensor, own: torch.Tensor, elsewhere) -> torch.Tensor:
        """A tensor shaped like ``like`` [rows, tokens, features] holding ``own`` [points,
        features] at the patched points and ``elsewhere()`` (what the layer computes on the live
        residual) at every other token."""
        if self.points is None:
            return own.view(*like.shape[:-1], own.shape[-1])
        out = elsewhere()
        out.view(-1, out.shape[-1]).index_copy_(0, self.points, own.to(out.dtype))
        return out
