"""The modules a patched pass puts in place of a layer's own: the output projection and the MLP,
computed only at the patched points (``AtPatchedPoints``), the projections that read the residual
stream (q, k and v, or GPT-2's fused qkv), which project each receiver's own input
(``ReceiverProjection``), and the reading point of an MLP with no norm before it
(``ReadingPoint``)."""

from __future__ import annotations

import torch
from torch import nn

from attnlab import anatomy
from attnlab.interventions.edges.points import contiguous, select_points
from attnlab.interventions.edges.state import GroupInputs, PassState


class AtPatchedPoints(nn.Module):
    """Stands in for a layer's output projection or MLP. On a patched pass it runs only at the
    patched points: before a prompt's first clean/corrupted difference every pass computes the
    same, so there it returns what the corrupted recording kept. On a recording pass it keeps its
    output at those tokens."""

    def __init__(self, module: nn.Module, state: PassState, key: tuple, at_points=None):
        super().__init__()
        self.module, self.state, self.key = module, state, key
        self.at_points = module if at_points is None else at_points  # what it computes at the points

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = self.state
        if state.restricted:
            return state.at_patched_points(x, self.key, self.at_points)
        out = self.module(x)
        state.keep_elsewhere(self.key, out)
        return out


class ReadingPoint(nn.Identity):
    """Where the MLP of a block without a norm before it (OLMo-2) reads the residual stream: the
    receiver hooks of a pre-norm go on this identity instead."""


class ReceiverProjection(nn.Module):
    """Stands in for a projection that reads the residual stream (q_proj, k_proj, v_proj, or a
    fused qkv) in a layer whose receivers get their own inputs: each head's slice of the
    projection applied to the layer's pre-norm of that head's input. ``after``: a query/key norm
    over every head at once (OLMo-2), applied here to each head's own projection (the model's own
    is set aside while the patch is installed), so a head's output depends on its input alone."""

    def __init__(self, linear: nn.Module, state: PassState, layer: int, rows: slice, after: nn.Module | None = None,
                 order: list[int] | None = None):
        super().__init__()
        self.linear, self.state, self.layer, self.rows = linear, state, layer, rows
        self.heads, self.after = rows.stop - rows.start, after
        self.key = ("qkv", layer, rows.start)
        # receiver i of ``rows`` (query heads, key heads, value heads) is head-sized row block
        # order[i] of the projection (Anatomy.qkv_slots: a fused qkv's layout); the per-head
        # tensors here are indexed by block
        self.order = list(range(self.heads)) if order is None else list(order)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        group = self.state.attention_inputs.get(self.layer)
        if group is None:  # every head on the live residual
            return self._on_live(hidden_states)
        out, per_head = self._live_elsewhere(hidden_states)
        mixed = self._project_mixed(per_head, group)
        corrupted = self._project_corrupted(per_head, group)
        as_is = contiguous(sorted(set(range(self.heads)) - set(mixed) - set(corrupted)))
        if as_is:
            self._project(per_head, select_points(hidden_states, self.state.points), as_is)
        if self.state.points is not None:
            out.view(-1, out.shape[-1]).index_copy_(0, self.state.points, per_head.flatten(1))
        return out

    def whole(self, normed: torch.Tensor) -> torch.Tensor:
        """The projection (and ``after``) of ``normed``, as the model computes it."""
        out = self.linear(normed)
        return out if self.after is None else self.after(out)

    def _on_live(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The projection of the live residual's pre-norm ``hidden_states``, as the layer's own
        (on a restricted pass only at the patched points); on a pass taking receiver gradients,
        its output gradient gives every head's input gradient."""
        state = self.state
        if state.restricted:
            return state.at_patched_points(hidden_states, self.key, self.whole)
        out = self.whole(hidden_states)
        state.keep_elsewhere(self.key, out)
        if state.patch.gradients is not None and out.requires_grad:
            live = state.live_inputs[self.layer]
            out.register_hook(lambda grad: self._input_gradient(live, grad))
        return out

    def _project_mixed(self, per_head: torch.Tensor, group: GroupInputs) -> list[int]:
        """Fill ``per_head`` [points, heads, e] for the heads reading mixes of their own: their
        slices of the projection of their inputs' pre-norms. Returns those heads."""
        own = [(index, self.order[offset - self.rows.start]) for index, offset in enumerate(group.mixed_at)
               if self.rows.start <= offset < self.rows.stop]
        if not own:
            return []
        heads = contiguous([head for _, head in own])
        x = group.mixed[contiguous([index for index, _ in own])]  # [own heads, points, d]
        spec = self.state.input_norm(self.layer)
        if self.after is not None:  # the whole projection of each head's own input, then its slice
            normed = x if spec is None else self._normed(spec, x).to(x.dtype)
            whole = self.whole(normed).view(*x.shape[:2], self.heads, -1)  # [own heads, points, heads, e]
            own_heads = [head for _, head in own]
            per_head[:, own_heads] = whole[torch.arange(len(own)), :, own_heads].transpose(0, 1)
            return own_heads
        weight, bias = self._weights()
        weight = weight[heads]
        if spec is None:
            projected = torch.bmm(x, weight.transpose(1, 2))
        else:  # the pre-norm's weight folded into the projection: ((x − c) · r ∘ w) W_h^T = r · (x − c)(W_h ∘ w)^T
            centred, inverse = spec.normalise(x)
            projected = torch.bmm(centred.to(x.dtype), (weight * spec.weight.to(weight.dtype)).transpose(1, 2))
            projected = projected * inverse.to(projected.dtype)
            if spec.bias is not None:  # and its bias: + W_h b
                projected = projected + (weight @ spec.bias.to(weight.dtype))[:, None]
        per_head[:, heads] = (projected if bias is None else projected + bias[heads][:, None]).transpose(0, 1)
        return [head for _, head in own]

    @staticmethod
    def _normed(spec: anatomy.NormSpec, x: torch.Tensor) -> torch.Tensor:
        centred, inverse = spec.normalise(x)
        out = centred.to(inverse.dtype) * inverse * spec.weight
        return out if spec.bias is None else out + spec.bias

    def _project_corrupted(self, per_head: torch.Tensor, group: GroupInputs) -> list[int]:
        """Fill ``per_head`` for the heads reading the corrupted residual as it is (its pre-norm
        computed once for the layer's group). Returns those heads."""
        corrupted = [self.order[offset - self.rows.start] for offset in group.corrupted_at
                     if self.rows.start <= offset < self.rows.stop]
        if corrupted:
            if group.corrupted_normed is None:
                group.corrupted_normed = self.state.input_normed(self.layer, group.corrupted)
            self._project(per_head, group.corrupted_normed, contiguous(corrupted))
        return corrupted

    def _live_elsewhere(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The projection's output [rows, tokens, heads · e], left to fill at the patched points
        (elsewhere every pass computes what the corrupted recording kept), and where to fill it:
        [points, heads, e]. ``hidden_states``: the live residual's pre-norm."""
        points, features = self.state.points, anatomy.out_features(self.linear)
        if points is None:
            out = hidden_states.new_empty(*hidden_states.shape[:-1], features)
            return out, out.view(-1, self.heads, features // self.heads)
        out = self.state.recorded_elsewhere(hidden_states, self.key)
        return out, out.new_empty(len(points), self.heads, features // self.heads)

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The projection's weight per head [heads, e, in] and bias [heads, e] (or None)."""
        bias = self.linear.bias
        return anatomy.heads_in(self.linear, self.heads), None if bias is None else bias.view(self.heads, -1)

    def _project(self, per_head: torch.Tensor, normed: torch.Tensor, heads) -> None:
        """per_head[:, heads] = each of ``heads``' slice of the projection of ``normed`` [points, d]."""
        if self.after is not None:
            per_head[:, heads] = self.whole(normed).view(len(normed), self.heads, -1)[:, heads]
            return
        weight, bias = self._weights()
        projected = torch.einsum("pd,hed->phe", normed, weight[heads])
        per_head[:, heads] = projected if bias is None else projected + bias[heads]

    def _input_gradient(self, live: torch.Tensor, grad: torch.Tensor) -> None:
        """Each head's input gradient from the projection's output gradient [b, t, heads · e]:
        its slice back through ``after`` (where there is one), the weight and the layer's
        pre-norm at ``live``, at the points the gradients are kept at."""
        gradients, spec = self.state.patch.gradients, self.state.input_norm(self.layer)
        weight = anatomy.heads_in(self.linear, self.heads)  # [heads, e, d]
        if spec is not None:
            weight = weight * spec.weight.to(weight.dtype)  # w ∘ (W_h^T g_h) = (W_h ∘ w)^T g_h
        grad, x = gradients.at_points(grad), gradients.at_points(live)
        if self.after is None:
            per_head = torch.einsum("phe,hed->hpd", grad.view(len(grad), self.heads, -1), weight)
        else:
            per_head = self._through_after(x, grad, weight)
        graph = self.state.graph
        layer = graph.layer_receivers(graph.attention_slice(self.layer).start)
        per_head = per_head[self.order]  # from the projection's blocks to the receivers' order
        gradients.add(layer.start, layer.stop - layer.start, self.rows,
                      per_head if spec is None else spec.input_gradient(x, per_head))

    def _through_after(self, x: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """[heads, points, d]: head h's output gradient (its slice of ``grad`` [points, heads · e],
        zero elsewhere) back through ``after`` at the projection of ``x``'s pre-norm, then the
        weight (``weight`` [heads, e, d], the pre-norm's weight folded in)."""
        spec = self.state.input_norm(self.layer)
        with torch.no_grad():
            normed = x if spec is None else self._normed(spec, x)
            projected = self.linear(normed.to(anatomy.linear_weight(self.linear).dtype))  # [points, heads · e]
        after = anatomy.norm_spec(self.after, self.state.parts.family.norm_kind, projected.shape[-1], projected.device)
        own = torch.eye(self.heads, dtype=grad.dtype, device=grad.device)  # head h keeps its own slice
        slices = (own[:, None, :, None] * grad.view(1, len(grad), self.heads, -1)).flatten(2)  # [heads, points, h · e]
        through = after.input_gradient(projected, slices * after.weight.to(slices.dtype))
        return torch.einsum("hpf,fd->hpd", through.to(weight.dtype), weight.flatten(0, 1))
