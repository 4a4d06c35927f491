"""The modules a patched pass puts in place of a layer's own: o_proj and the MLP, computed only at
the patched points (``AtPatchedPoints``), and q_proj, k_proj and v_proj, which project each
receiver's own input (``ReceiverProjection``)."""

from __future__ import annotations

import torch
from torch import nn

from attnlab.edges.gradients import rms_input_gradient
from attnlab.edges.points import at_least_float32, contiguous, select_points
from attnlab.edges.state import GroupInputs, PassState


class AtPatchedPoints(nn.Module):
    """Stands in for a layer's o_proj or MLP. On a patched pass it runs only at the patched
    points: before a prompt's first clean/corrupted difference every pass computes the same, so
    there it returns what the corrupted recording kept. On a recording pass it keeps its output at
    those tokens."""

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


class ReceiverProjection(nn.Module):
    """Stands in for q_proj, k_proj or v_proj of a layer whose receivers get their own inputs:
    each head's slice of the projection applied to the layer's pre-norm of that head's input."""

    def __init__(self, linear: nn.Linear, state: PassState, layer: int, rows: slice, heads: int):
        super().__init__()
        self.linear, self.state, self.layer, self.rows, self.heads = linear, state, layer, rows, heads
        self.key = ("qkv", layer, rows.start)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        group = self.state.attention_inputs.get(self.layer)
        weight = self.linear.weight.view(self.heads, -1, self.linear.in_features)
        if group is None:  # every head on the live residual
            return self._on_live(hidden_states, weight)
        out, per_head = self._live_elsewhere(hidden_states)
        bias = None if self.linear.bias is None else self.linear.bias.view(self.heads, -1)
        mixed = self._project_mixed(per_head, group, weight, bias)
        corrupted = self._project_corrupted(per_head, group, weight, bias)
        as_is = contiguous(sorted(set(range(self.heads)) - set(mixed) - set(corrupted)))
        if as_is:
            self._project(per_head, select_points(hidden_states, self.state.points), as_is, weight, bias)
        if self.state.points is not None:
            out.view(-1, out.shape[-1]).index_copy_(0, self.state.points, per_head.flatten(1))
        return out

    def _on_live(self, hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The projection of the live residual's pre-norm ``hidden_states``, as the layer's own
        (on a restricted pass only at the patched points); on a pass taking receiver gradients,
        its output gradient gives every head's input gradient."""
        state = self.state
        if state.restricted:
            return state.at_patched_points(hidden_states, self.key, self.linear)
        out = self.linear(hidden_states)
        state.keep_elsewhere(self.key, out)
        if state.patch.gradients is not None and out.requires_grad:
            live = state.live_inputs[self.layer]
            out.register_hook(lambda grad: self._input_gradient(live, weight, grad))
        return out

    def _project_mixed(self, per_head: torch.Tensor, group: GroupInputs, weight: torch.Tensor, bias) -> list[int]:
        """Fill ``per_head`` [points, heads, e] for the heads reading mixes of their own: their
        slices of the projection of their inputs' pre-norms. Returns those heads."""
        own = [(index, offset - self.rows.start) for index, offset in enumerate(group.mixed_at)
               if self.rows.start <= offset < self.rows.stop]
        if not own:
            return []
        heads = contiguous([head for _, head in own])
        norm_weight, eps = self.state.input_norm(self.layer)
        x = group.mixed[contiguous([index for index, _ in own])]  # [own heads, points, d]
        inverse = torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=at_least_float32(x)).pow(2)
                              / x.shape[-1] + eps)
        # the pre-norm's weight folded into the projection: (x · r ∘ w) W_h^T = r · x (W_h ∘ w)^T
        projected = torch.bmm(x, (weight[heads] * norm_weight.to(weight.dtype)).transpose(1, 2))
        projected = projected * inverse.to(projected.dtype)
        per_head[:, heads] = (projected if bias is None else projected + bias[heads][:, None]).transpose(0, 1)
        return [head for _, head in own]

    def _project_corrupted(self, per_head: torch.Tensor, group: GroupInputs, weight: torch.Tensor,
                           bias) -> list[int]:
        """Fill ``per_head`` for the heads reading the corrupted residual as it is (its pre-norm
        computed once for the layer's group). Returns those heads."""
        corrupted = [offset - self.rows.start for offset in group.corrupted_at
                     if self.rows.start <= offset < self.rows.stop]
        if corrupted:
            if group.corrupted_normed is None:
                group.corrupted_normed = self.state.layers[self.layer].input_layernorm(group.corrupted)
            self._project(per_head, group.corrupted_normed, contiguous(corrupted), weight, bias)
        return corrupted

    def _live_elsewhere(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The projection's output [rows, tokens, heads · e], left to fill at the patched points
        (elsewhere every pass computes what the corrupted recording kept), and where to fill it:
        [points, heads, e]. ``hidden_states``: the live residual's pre-norm."""
        points = self.state.points
        if points is None:
            out = hidden_states.new_empty(*hidden_states.shape[:-1], self.linear.out_features)
            return out, out.view(-1, self.heads, out.shape[-1] // self.heads)
        out = self.state.recorded_elsewhere(hidden_states, self.key)
        return out, out.new_empty(len(points), self.heads, out.shape[-1] // self.heads)

    @staticmethod
    def _project(per_head: torch.Tensor, normed: torch.Tensor, heads, weight: torch.Tensor, bias) -> None:
        """per_head[:, heads] = each of ``heads``' slice of the projection of ``normed`` [points, d]."""
        projected = torch.einsum("pd,hed->phe", normed, weight[heads])
        per_head[:, heads] = projected if bias is None else projected + bias[heads]

    def _input_gradient(self, live: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> None:
        """Each head's input gradient from the projection's output gradient [b, t, heads · e]:
        its slice through the weight, then back through the layer's pre-norm at ``live``, at the
        points the gradients are kept at."""
        gradients = self.state.patch.gradients
        norm_weight, eps = self.state.input_norm(self.layer)
        weight = weight * norm_weight.to(weight.dtype)  # w ∘ (W_h^T g_h) = (W_h ∘ w)^T g_h
        grad = gradients.at_points(grad)
        per_head = torch.einsum("phe,hed->hpd", grad.view(len(grad), self.heads, -1), weight)
        graph = self.state.graph
        layer = graph.layer_receivers(graph.attention_slice(self.layer).start)
        gradients.add(layer.start, layer.stop - layer.start, self.rows,
                      rms_input_gradient(gradients.at_points(live), eps, per_head))
