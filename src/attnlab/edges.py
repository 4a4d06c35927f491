"""The component graph of a decoder model, and the part of ``intervened`` that patches its edges.

Senders write into the residual stream: the token embeddings, every attention head (its slice of
o_proj: under grouped-query attention still one per query head) and every MLP. Receivers read it:
every query head's query input, every key/value head's key and value inputs, every MLP's input
and the logits (the final norm's input). One edge is one sender feeding one later receiver; a
receiver's input is the sum of what its upstream senders wrote.

``EdgePatch`` is what ``intervened(model, edges=...)`` installs. Each receiver is given its own
input, computed from per-sender activations rather than from the one residual stream the model
carries:

- ``record``: keep every sender's contribution and the residual stream at every receiver's
  point (the clean and the corrupted runs);
- ``kept`` (with the corrupted run's ``Recording``): every edge not kept carries the sender's
  corrupted activation into its receiver, a kept one the sender's activation in this pass; each
  receiver sees its own mix, and its pre-norm is applied to that mix;
- ``gradients``: each backward pass adds the gradient of the metric with respect to every
  receiver's input (edge attribution). Receivers reading the live residual as it is are not
  given inputs of their own: a query/key/value head's gradient is its slice of the projection's
  output gradient taken back through the layer's RMS pre-norm (one vector-Jacobian product for
  all heads), an MLP's or the logits' the gradient that reaches its pre-norm's input.

A receiver's input is computed from whichever side it keeps less of: the live residual minus
(live − corrupted) of its dropped senders, or the corrupted residual plus (live − corrupted) of its
kept ones (summed by an embedding bag per receiver and token that reads only those senders'
differences). So all edges kept is the unpatched forward to the last bit (nothing is touched) and
no edge kept is the corrupted forward to float rounding (each receiver reads the corrupted
residual itself). Only the layer under way holds its receivers' inputs, and only at the tokens
the corrupted ``Recording`` keeps (from each prompt's first clean/corrupted difference on:
elsewhere every receiver reads the live residual). Receivers that read a base as it is share
one projection of it; a mixed query/key/value head's RMS pre-norm (its weight read from the
module) is folded into its projection.

Post-norms that rescale a block's output before it joins the residual (Gemma-3's
post_attention_layernorm and post_feedforward_layernorm) are RMS norms: a head's contribution is
its o_proj slice times the norm's scale of the block's whole output, so the heads' contributions
still add up to what the layer adds. Architectures whose layers lack these parts are refused.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

# Decoder-layer parts an edge patch reads: every architecture here has input_layernorm,
# self_attn.{q,k,v,o}_proj and mlp; the norm before the MLP is post_attention_layernorm, except
# in sandwich-norm layers (Gemma-2/3), where that norm rescales the attention output and
# pre_feedforward_layernorm precedes the MLP.
REQUIRED = ("input_layernorm", "self_attn", "mlp", "post_attention_layernorm")


@dataclass(frozen=True)
class Graph:
    """Senders: embeddings, then per layer its heads and its MLP. Receivers: per layer its query
    heads (q), key/value heads (k, then v) and its MLP, then the logits."""

    n_layers: int
    n_heads: int
    n_kv_heads: int

    @classmethod
    def of(cls, model) -> "Graph":
        config = model.config.get_text_config()
        return cls(config.num_hidden_layers, config.num_attention_heads,
                   getattr(config, "num_key_value_heads", None) or config.num_attention_heads)

    @property
    def n_senders(self) -> int:
        return 1 + self.n_layers * (self.n_heads + 1)

    @property
    def attention_receivers(self) -> int:  # per layer
        return self.n_heads + 2 * self.n_kv_heads

    @property
    def per_layer(self) -> int:
        return self.attention_receivers + 1

    @property
    def n_receivers(self) -> int:
        return self.n_layers * self.per_layer + 1

    def head_sender(self, layer: int, head: int) -> int:
        return 1 + layer * (self.n_heads + 1) + head

    def mlp_sender(self, layer: int) -> int:
        return 1 + layer * (self.n_heads + 1) + self.n_heads

    def attention_slice(self, layer: int) -> slice:
        return slice(layer * self.per_layer, layer * self.per_layer + self.attention_receivers)

    def layer_receivers(self, receiver: int) -> slice:
        """The receivers of ``receiver``'s layer (its query/key/value heads, then its MLP); the
        logits alone."""
        if receiver == self.logits_receiver:
            return slice(receiver, receiver + 1)
        first = receiver - receiver % self.per_layer
        return slice(first, first + self.per_layer)

    def mlp_receiver(self, layer: int) -> int:
        return layer * self.per_layer + self.attention_receivers

    @property
    def logits_receiver(self) -> int:
        return self.n_receivers - 1

    def upstream(self, receiver: int) -> int:
        """How many senders (a prefix of the senders' order) feed ``receiver``."""
        if receiver == self.logits_receiver:
            return self.n_senders
        layer, within = divmod(receiver, self.per_layer)
        before = 1 + layer * (self.n_heads + 1)
        return before + self.n_heads if within == self.attention_receivers else before

    def valid(self) -> torch.Tensor:
        """[senders, receivers] bool: which pairs are edges."""
        upstream = torch.tensor([self.upstream(r) for r in range(self.n_receivers)])
        return torch.arange(self.n_senders)[:, None] < upstream[None, :]

    @property
    def n_edges(self) -> int:
        return int(self.valid().sum())

    def sender_names(self) -> list[str]:
        names = ["embed"]
        for layer in range(self.n_layers):
            names += [f"L{layer}.H{head}" for head in range(self.n_heads)] + [f"L{layer}.MLP"]
        return names

    def receiver_names(self) -> list[str]:
        names = []
        for layer in range(self.n_layers):
            names += [f"L{layer}.H{head}.q" for head in range(self.n_heads)]
            names += [f"L{layer}.KV{head}.{kind}" for kind in "kv" for head in range(self.n_kv_heads)]
            names.append(f"L{layer}.MLP")
        return names + ["logits"]

    def edges(self) -> pd.DataFrame:
        """Every edge, sender-major: sender, receiver (indices), their names and layers (the
        embeddings' layer is -1, the logits' the number of layers)."""
        senders, receivers = self.valid().nonzero(as_tuple=True)
        senders, receivers = senders.numpy(), receivers.numpy()
        sender_layer = np.where(senders == 0, -1, (senders - 1) // (self.n_heads + 1))
        receiver_layer = receivers // self.per_layer
        return pd.DataFrame({"sender": senders, "receiver": receivers,
                             "sender_name": np.asarray(self.sender_names())[senders],
                             "receiver_name": np.asarray(self.receiver_names())[receivers],
                             "sender_layer": sender_layer, "receiver_layer": receiver_layer})

    def mask(self, senders: np.ndarray, receivers: np.ndarray) -> torch.Tensor:
        """[senders, receivers] bool with the given edges set."""
        mask = torch.zeros(self.n_senders, self.n_receivers, dtype=torch.bool)
        rows, columns = (torch.tensor(np.asarray(index), dtype=torch.long) for index in (senders, receivers))
        mask[rows, columns] = True
        return mask


@dataclass
class Recording:
    """One forward's sender contributions [senders, points, hidden] and the residual stream at
    each receiver's point [points, hidden]: each layer's input, its MLP's input (``middle``) and
    the final norm's input. Points are the tokens of the pass flattened (row × tokens + position),
    all of them or only ``points``: where the passes patched against this recording may differ
    from it. A causal model computes the same at every token before a prompt's first difference
    between its clean and corrupted ids, so those tokens read the live residual as it is."""

    points: torch.Tensor | None = None  # flat token indices; None: every token
    shape: tuple[int, int] | None = None  # (rows, tokens) of the recorded pass
    senders: torch.Tensor | None = None
    layer_inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    middle: dict[int, torch.Tensor] = field(default_factory=dict)
    final: torch.Tensor | None = None
    # the (live − corrupted) activations [points, senders, hidden] of the passes patched against
    # this recording, one buffer reused from pass to pass (a pass writes the senders it reads)
    differences: torch.Tensor | None = None


@dataclass(eq=False)
class ReceiverGradients:
    """The gradient of the metric with respect to each receiver's input, summed over the backward
    passes of the forwards that carry it: one tensor (float32 at least) per layer's receivers
    (``Graph.layer_receivers``: its query/key/value heads and its MLP; the logits alone), keyed by
    the first of them, [receivers, rows, tokens, hidden]."""

    groups: dict[int, torch.Tensor] = field(default_factory=dict)

    def add(self, first: int, count: int, within: slice, gradient: torch.Tensor) -> None:
        """Add ``gradient`` [receivers, rows, tokens, hidden] to receivers ``within`` the group of
        ``count`` receivers starting at ``first``."""
        store = self.groups.get(first)
        if store is None:
            dtype = _at_least_float32(gradient)
            store = self.groups[first] = gradient.new_zeros(count, *gradient.shape[1:], dtype=dtype)
        if store.shape[1:] != gradient.shape[1:]:
            raise ValueError(f"the receiver gradients were summed over inputs {tuple(store.shape[1:])}, this pass "
                             f"runs {tuple(gradient.shape[1:])}: use one ReceiverGradients per batch of prompts")
        store[within] += gradient

    def gradient(self, first: int) -> torch.Tensor:
        return self.groups[first]


def rms_input_gradient(x: torch.Tensor, eps: float, weighted: torch.Tensor) -> torch.Tensor:
    """The vector-Jacobian product of y = x · rsqrt(mean(x²) + eps) · w at ``x`` [..., hidden]
    for a stack of output gradients g given as ``weighted`` = w ∘ g [n, ..., hidden] (the weight
    folded into whatever produced g), in float32 at least, as the norms compute:
    r · (w ∘ g) − x · r³ · mean(x ∘ w ∘ g), with r = rsqrt(mean(x²) + eps)."""
    dtype = _at_least_float32(x)
    x, weighted = x.to(dtype), weighted.to(dtype)
    inverse = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    projection = torch.einsum("n...d,...d->n...", weighted, x)[..., None] / x.shape[-1]
    return (weighted * inverse).addcmul_(x * inverse.pow(3), projection, value=-1)


@dataclass(frozen=True, eq=False)
class Plan:
    """What each receiver reads, from a kept-edges mask: its base (live residual, or corrupted)
    and the coefficient of each upstream sender's (live − corrupted) difference."""

    coef: torch.Tensor  # [senders, receivers]: -1 dropped (live base), 1 kept (corrupted base), else 0
    live_base: torch.Tensor  # [receivers] bool
    patched: torch.Tensor  # [receivers] bool: the receiver does not read the live residual as it is
    used: torch.Tensor  # [senders] bool: some receiver reads the sender's (live − corrupted)

    @classmethod
    def of(cls, graph: Graph, kept: torch.Tensor) -> "Plan":
        valid = graph.valid()
        if kept.shape != valid.shape:
            raise ValueError(f"kept edges: a [senders, receivers] = {tuple(valid.shape)} mask, not {tuple(kept.shape)}")
        kept = kept.bool().cpu() & valid
        n_valid, n_kept = valid.sum(0), kept.sum(0)
        live_base = 2 * n_kept >= n_valid
        coef = torch.where(live_base[None, :], kept.float() - 1, kept.float()) * valid
        return cls(coef, live_base, n_kept < n_valid, coef.abs().sum(1) > 0)


@dataclass(eq=False)
class _GroupInputs:
    """What a group of receivers reading one point of the residual stream reads at the patched
    points: the receivers at offsets ``mixed_at`` (within the group) their own mixes ``mixed``
    [points, len(mixed_at), hidden]; those at ``corrupted_at`` the corrupted residual
    ``corrupted`` [points, hidden] as it is; the others the live residual as it is."""

    mixed: torch.Tensor | None
    mixed_at: list[int]
    corrupted: torch.Tensor
    corrupted_at: list[int]
    corrupted_normed: torch.Tensor | None = None  # the pre-norm of ``corrupted``, once per group


class _ReceiverProjection(nn.Module):
    """Stands in for q_proj, k_proj or v_proj of a layer whose receivers get their own inputs:
    each head's slice of the projection applied to the layer's pre-norm of that head's input."""

    def __init__(self, linear: nn.Linear, state: "_Installed", layer: int, rows: slice, heads: int):
        super().__init__()
        self.linear, self.state, self.layer, self.rows, self.heads = linear, state, layer, rows, heads

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        group = self.state.attention_inputs.get(self.layer)
        weight = self.linear.weight.view(self.heads, -1, self.linear.in_features)
        if group is None:
            out = self.linear(hidden_states)  # every head on the live residual
            if self.state.patch.gradients is not None and out.requires_grad:
                live = self.state.live_inputs[self.layer]
                out.register_hook(lambda grad: self._input_gradient(live, weight, grad))
            return out
        out, per_head = self._live_elsewhere(hidden_states)
        bias = None if self.linear.bias is None else self.linear.bias.view(self.heads, -1)
        own = [(index, offset - self.rows.start) for index, offset in enumerate(group.mixed_at)
               if self.rows.start <= offset < self.rows.stop]
        if own:
            heads = _contiguous([head for _, head in own])
            norm_weight, eps = self.state.input_norm(self.layer)
            x = group.mixed[:, _contiguous([index for index, _ in own])].transpose(0, 1)  # [own heads, points, d]
            inverse = torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=_at_least_float32(x)).pow(2)
                                  / x.shape[-1] + eps)
            # the pre-norm's weight folded into the projection: (x · r ∘ w) W_h^T = r · x (W_h ∘ w)^T
            projected = torch.bmm(x, (weight[heads] * norm_weight.to(weight.dtype)).transpose(1, 2))
            projected = projected * inverse.to(projected.dtype)
            per_head[:, heads] = (projected if bias is None else projected + bias[heads][:, None]).transpose(0, 1)
        corrupted = [offset - self.rows.start for offset in group.corrupted_at
                     if self.rows.start <= offset < self.rows.stop]
        if corrupted:
            if group.corrupted_normed is None:
                group.corrupted_normed = self.state.layers[self.layer].input_layernorm(group.corrupted)
            self._project(per_head, group.corrupted_normed, _contiguous(corrupted), weight, bias)
        as_is = _contiguous(sorted(set(range(self.heads)) - {head for _, head in own} - set(corrupted)))
        if as_is:
            self._project(per_head, _at(hidden_states, self.state.points), as_is, weight, bias)
        if self.state.points is not None:
            out.view(-1, out.shape[-1]).index_copy_(0, self.state.points, per_head.flatten(1))
        return out

    def _live_elsewhere(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The projection's output [rows, tokens, heads · e], computed on ``hidden_states`` (the
        live residual's pre-norm) at the tokens no receiver patches and left to fill at the patched
        points, and where to fill it: [points, heads, e]."""
        out = hidden_states.new_empty(*hidden_states.shape[:-1], self.linear.out_features)
        flat = out.view(-1, out.shape[-1])
        points, elsewhere = self.state.points, self.state.unpatched_points
        if points is None:
            return out, flat.view(len(flat), self.heads, -1)
        if len(elsewhere):
            flat.index_copy_(0, elsewhere, self.linear(_at(hidden_states, elsewhere)))
        return out, flat.new_empty(len(points), self.heads, flat.shape[-1] // self.heads)

    @staticmethod
    def _project(per_head: torch.Tensor, normed: torch.Tensor, heads, weight: torch.Tensor, bias) -> None:
        """per_head[:, heads] = each of ``heads``' slice of the projection of ``normed`` [points, d]."""
        projected = torch.einsum("pd,hed->phe", normed, weight[heads])
        per_head[:, heads] = projected if bias is None else projected + bias[heads]

    def _input_gradient(self, live: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> None:
        """Each head's input gradient from the projection's output gradient [b, t, heads · e]:
        its slice through the weight, then back through the layer's pre-norm at ``live``."""
        norm_weight, eps = self.state.input_norm(self.layer)
        weight = weight * norm_weight.to(weight.dtype)  # w ∘ (W_h^T g_h) = (W_h ∘ w)^T g_h
        per_head = torch.einsum("bthe,hed->hbtd", grad.view(*grad.shape[:-1], self.heads, -1), weight)
        graph = self.state.graph
        layer = graph.layer_receivers(graph.attention_slice(self.layer).start)
        self.state.patch.gradients.add(layer.start, layer.stop - layer.start, self.rows,
                                       rms_input_gradient(live, eps, per_head))


@dataclass(eq=False)
class EdgePatch:
    """The edge part of ``intervened`` (module docstring). ``kept`` needs ``corrupted``;
    ``record`` works alone or with either; ``gradients`` are taken on unpatched passes (EAP-IG
    interpolates the inputs, not the edges)."""

    graph: Graph
    kept: torch.Tensor | None = None
    corrupted: Recording | None = None
    record: Recording | None = None
    gradients: ReceiverGradients | None = None

    def __post_init__(self):
        if self.kept is not None and self.corrupted is None:
            raise ValueError("patching edges (kept=) needs the corrupted run's Recording (corrupted=)")
        if self.kept is not None and self.gradients is not None:
            raise ValueError("receiver gradients (gradients=) are taken on unpatched passes: drop kept= "
                             "(EAP-IG moves the inputs from the corrupted to the clean prompt, not the edges)")
        self.plan = None if self.kept is None else Plan.of(self.graph, self.kept)

    def install(self, model) -> "_Installed":
        return _Installed(self, model)


def _contiguous(indices: list[int]) -> list[int] | slice:
    """``indices`` as a slice where they are a run (indexing with it is a view, not a copy)."""
    if indices and indices == list(range(indices[0], indices[-1] + 1)):
        return slice(indices[0], indices[-1] + 1)
    return indices


def _at_least_float32(x: torch.Tensor) -> torch.dtype:
    """The dtype RMS norms compute in: float32, or the input's if wider."""
    return torch.promote_types(x.dtype, torch.float32)


def _at(x: torch.Tensor, points: torch.Tensor | None) -> torch.Tensor:
    """``x`` [..., rows, tokens, hidden] at ``points`` (flat token indices; None: every token):
    [..., points, hidden]."""
    flat = x.flatten(-3, -2)
    return flat if points is None else flat.index_select(-2, points.to(x.device))


# (w, eps) of each norm read so far, with the state of its parameters it was read from
_NORM_WEIGHTS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _norm_weight(norm: nn.Module, hidden: int, device) -> tuple[torch.Tensor, float]:
    """(w, eps) of an RMS norm y = x · rsqrt(mean(x²) + eps) · w, read from the module itself:
    its output on a row of ones is w · rsqrt(1 + eps). Read again only after its parameters
    change (every patched pass installs the patch anew)."""
    state = (str(device), hidden, tuple((p.data_ptr(), p._version) for p in norm.parameters()))
    cached = _NORM_WEIGHTS.get(norm)
    if cached is not None and cached[0] == state:
        return cached[1]
    eps = getattr(norm, "eps", None)
    eps = getattr(norm, "variance_epsilon", None) if eps is None else eps
    if eps is None:
        raise NotImplementedError(f"edge patching needs RMS norms (with eps or variance_epsilon); "
                                  f"{type(norm).__name__} is not one")
    with torch.no_grad():
        ones = torch.ones(1, hidden, device=device, dtype=torch.float32)
        weight = norm(ones).float()[0] * (1 + eps) ** 0.5
        probe = torch.randn(3, hidden, device=device, generator=torch.Generator(device).manual_seed(0))
        expected = probe * torch.rsqrt(probe.pow(2).mean(-1, keepdim=True) + eps) * weight
        if not torch.allclose(norm(probe).float(), expected, rtol=1e-4, atol=1e-5):
            raise NotImplementedError(f"{type(norm).__name__} is not an RMS norm: edge patching cannot "
                                      "split the block output it rescales between heads")
    _NORM_WEIGHTS[norm] = (state, (weight, eps))
    return weight, eps


class _Installed:
    """The hooks and stand-ins of one ``EdgePatch`` on one model (a handle: ``remove``)."""

    def __init__(self, patch: EdgePatch, model):
        self.patch, self.graph, self.plan = patch, patch.graph, patch.plan
        decoder = model.get_decoder()
        self.layers = decoder.layers
        if Graph.of(model) != self.graph:
            raise ValueError(f"the edge patch was made for {self.graph}, the model is {Graph.of(model)}")
        self.attention_inputs: dict[int, torch.Tensor] = {}
        self.live_inputs: dict[int, torch.Tensor] = {}  # each layer's input, kept for receiver gradients
        self.hidden, self.device = model.config.get_text_config().hidden_size, model.device
        self.deltas: torch.Tensor | None = None  # live − corrupted [points, senders, hidden] (patching only)
        self.points = None if patch.plan is None else patch.corrupted.points
        self.unpatched_points = None  # the other tokens of the pass
        if self.points is not None:
            self.points = self.points.to(model.device)
            unpatched = torch.ones(int(np.prod(patch.corrupted.shape)), dtype=torch.bool, device=model.device)
            unpatched[self.points] = False
            self.unpatched_points = unpatched.nonzero()[:, 0]
        self.handles, self.swapped = [], []
        for index, layer in enumerate(self.layers):
            missing = [name for name in REQUIRED if not hasattr(layer, name)]
            if missing:
                raise NotImplementedError(f"edge patching: decoder layer {type(layer).__name__} has no {missing}")
            sandwich = hasattr(layer, "pre_feedforward_layernorm")
            mlp_norm = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
            attention_scale = _norm_weight(layer.post_attention_layernorm, self.hidden, self.device) if sandwich else None
            mlp_out = layer.post_feedforward_layernorm if sandwich else layer.mlp
            self.handles += [
                layer.register_forward_pre_hook(self._layer_input(index), with_kwargs=True),
                layer.self_attn.o_proj.register_forward_hook(self._heads(index, attention_scale)),
                mlp_norm.register_forward_hook(self._mlp_input(index)),
                mlp_out.register_forward_hook(self._mlp_output(index)),
            ]
            self._swap_projections(index, layer.self_attn)
        self.handles.append(decoder.norm.register_forward_hook(self._final()))

    def _swap_projections(self, index: int, attention: nn.Module) -> None:
        graph = self.graph
        h, g = graph.n_heads, graph.n_kv_heads
        for name, rows, heads in (("q_proj", slice(0, h), h), ("k_proj", slice(h, h + g), g),
                                  ("v_proj", slice(h + g, h + 2 * g), g)):
            linear = getattr(attention, name)
            setattr(attention, name, _ReceiverProjection(linear, self, index, rows, heads))
            self.swapped.append((attention, name, linear))

    def at_points(self, like: torch.Tensor, own: torch.Tensor, elsewhere) -> torch.Tensor:
        """A tensor shaped like ``like`` [rows, tokens, features] holding ``own`` [points,
        features] at the patched points and ``elsewhere()`` (what the layer computes on the live
        residual) at every other token."""
        if self.points is None:
            return own.view(*like.shape[:-1], own.shape[-1])
        out = elsewhere()
        out.view(-1, out.shape[-1]).index_copy_(0, self.points, own.to(out.dtype))
        return out

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        for module, name, original in self.swapped:
            setattr(module, name, original)
        self.attention_inputs.clear()
        self.live_inputs.clear()
        self.deltas = None

    def input_norm(self, layer: int) -> tuple[torch.Tensor, float]:
        """(w, eps) of a layer's input_layernorm (``_norm_weight`` keeps it while the norm's
        parameters stay as they are)."""
        return _norm_weight(self.layers[layer].input_layernorm, self.hidden, self.device)

    # ---- senders ----
    def _sender(self, index: int, value: torch.Tensor) -> None:
        """Sender ``index`` wrote ``value`` [rows, tokens, hidden] (or several: [n, rows, ...])."""
        values = value if value.dim() == 4 else value[None]
        record = self.patch.record
        if record is not None:
            if record.senders is None:
                record.senders = values.new_empty(self.graph.n_senders, *_at(values[0], record.points).shape)
            record.senders[index:index + len(values)] = _at(values.detach(), record.points)
        self._patched_sender(index, len(values), lambda: _at(values, self.points))

    def _patched_sender(self, index: int, count: int, current) -> None:
        """Senders ``index`` to ``index + count`` wrote ``current()`` [count, points, hidden] at the
        patched points: keep their (live − corrupted) where some receiver reads it."""
        if self.plan is None or not bool(self.plan.used[index:index + count].any()):  # never read
            return
        if self.deltas is None:
            corrupted = self.patch.corrupted
            if corrupted.differences is None:  # token-major: a receiver's sums at one token read
                # one block of the buffer (its senders' rows), which stays in cache
                senders, points, hidden = corrupted.senders.shape
                # NaN until written: a sum reading a sender this pass did not write shows
                corrupted.differences = corrupted.senders.new_full((points, senders, hidden), float("nan"))
            self.deltas = corrupted.differences
        torch.sub(current(), self.patch.corrupted.senders[index:index + count],
                  out=self.deltas[:, index:index + count].transpose(0, 1))

    def _heads(self, index: int, scale):
        n_heads = self.graph.n_heads

        first = self.graph.head_sender(index, 0)

        def record(module, args, output):
            unread = self.plan is None or not bool(self.plan.used[first:first + n_heads].any())
            if self.patch.record is None and unread:
                return
            z = args[0]  # o_proj's input, the heads' outputs side by side; a bias is no sender's
            if self.patch.record is None:  # only the patched points are read
                self._patched_sender(first, n_heads, lambda: self._head_outputs(
                    module, _at(z, self.points), _at(output, self.points), scale))
            else:  # recorded: no graph (a recording pass may be taking gradients)
                self._sender(first, self._head_outputs(module, z.detach(), output.detach(), scale))
        return record

    def _head_outputs(self, o_proj: nn.Module, z: torch.Tensor, output: torch.Tensor, scale) -> torch.Tensor:
        """Each head's contribution [heads, ..., hidden] from o_proj's input ``z`` [..., heads · e]
        and output ``output`` [..., hidden]."""
        n_heads = self.graph.n_heads
        weight = o_proj.weight.view(o_proj.out_features, n_heads, -1)
        heads = torch.einsum("...he,dhe->h...d", z.view(*z.shape[:-1], n_heads, -1), weight)
        if scale is not None:  # a post-norm of the block's output: the same scale for every head
            weight_norm, eps = scale
            heads = heads * (torch.rsqrt(output.float().pow(2).mean(-1, keepdim=True) + eps) * weight_norm)
        return heads

    def _mlp_output(self, index: int):
        def record(module, args, output):
            self._sender(self.graph.mlp_sender(index), output)
        return record

    # ---- receivers ----
    def _inputs(self, receivers: slice, live: torch.Tensor, corrupted: torch.Tensor | None,
                upstream: int) -> "_GroupInputs | None":
        """What ``receivers``, all fed by the first ``upstream`` senders, read at the patched
        points, where the live residual stream is ``live`` [rows, tokens, hidden] and the
        corrupted run's ``corrupted`` [points, hidden]; None where every one reads ``live`` as
        it is."""
        plan = self.plan
        if plan is None or not bool(plan.patched[receivers].any()):
            return None
        coef, on_live = plan.coef[:upstream, receivers], plan.live_base[receivers]
        mixing = coef.abs().sum(0) > 0
        mixed_at = mixing.nonzero()[:, 0].tolist()
        mixed = (self._mixed([receivers.start + at for at in mixed_at], on_live[mixing], _at(live, self.points),
                             corrupted, upstream) if mixed_at else None)
        return _GroupInputs(mixed, mixed_at, corrupted, (~mixing & ~on_live).nonzero()[:, 0].tolist())

    def _single_receiver(self, module: nn.Module, receiver: int, live: torch.Tensor, output: torch.Tensor,
                         corrupted: torch.Tensor | None, upstream: int) -> torch.Tensor | None:
        """The output of the pre-norm ``module`` of a lone receiver (an MLP, the logits) on its own
        input, given its ``output`` on the ``live`` residual; None where it reads ``live`` as it
        is and no gradient is asked for."""
        group = self._inputs(slice(receiver, receiver + 1), live, corrupted, upstream)
        if group is not None:  # forward: not this hook again
            own = group.corrupted if group.mixed is None else group.mixed[:, 0]
            return self.at_points(output, module.forward(own), output.clone)
        gradients = self.patch.gradients
        if gradients is None or not live.requires_grad:
            return None
        own = live.view_as(live)  # its gradient is the part that flows through this norm alone
        layer = self.graph.layer_receivers(receiver)
        within = slice(receiver - layer.start, receiver - layer.start + 1)
        own.register_hook(lambda grad: gradients.add(layer.start, layer.stop - layer.start, within, grad[None]))
        return module.forward(own)

    def _mixed(self, receivers: list[int], on_live: torch.Tensor, live: torch.Tensor,
               corrupted: torch.Tensor, upstream: int) -> torch.Tensor:
        """base + Σ_s coef[s, r] (live − corrupted)_s [points, receivers, hidden] for each of
        ``receivers`` (fed by the first ``upstream`` senders; its base the live residual where
        ``on_live``, else the corrupted one). The sums read only the senders each receiver mixes
        (an embedding bag per receiver and token over the differences): a dense product over
        every sender some receiver of the group mixes costs ~4x the flops at a circuit's
        crossing, and runs only ~2x faster per flop on a CPU."""
        coef = self.plan.coef[:upstream, receivers].T  # [receivers, senders]
        rows, senders = coef.nonzero(as_tuple=True)  # receiver-major
        deltas, device = self.deltas, live.device
        points, width, hidden = deltas.shape
        counts = torch.bincount(rows, minlength=len(receivers))
        starts = torch.cumsum(counts, 0) - counts  # each receiver's first sender in ``senders``
        token = torch.arange(points, device=device)[:, None]
        indices = (token * width + senders.to(device)[None]).flatten()  # rows of deltas [points · senders, hidden]
        offsets = (token * len(senders) + starts.to(device)[None]).flatten()  # a bag per token and receiver
        weights = coef[rows, senders].to(device, deltas.dtype).repeat(points)
        inputs = F.embedding_bag(indices, deltas.view(-1, hidden), offsets, mode="sum",
                                 per_sample_weights=weights).view(points, len(receivers), hidden)
        most_on_live = 2 * int(on_live.sum()) >= len(on_live)
        majority, minority = (live, corrupted) if most_on_live else (corrupted, live)
        inputs += majority[:, None]  # every row, in place; then the others' bases corrected
        others = _contiguous((on_live != most_on_live).nonzero()[:, 0].tolist())
        if others:
            inputs[:, others] += (minority - majority)[:, None]
        return inputs

    def _layer_input(self, index: int):
        graph = self.graph

        def hook(module, args, kwargs):
            live = args[0] if args else kwargs["hidden_states"]
            replaced = None
            if index == 0:
                self.attention_inputs.clear()
                self.live_inputs.clear()
                if self.patch.gradients is not None and torch.is_grad_enabled() and not live.requires_grad:
                    live = replaced = live.detach().requires_grad_(True)  # a graph to take gradients on
                self._sender(0, live)
            if self.patch.gradients is not None:
                self.live_inputs[index] = live
            record = self.patch.record
            if record is not None:
                if index == 0:
                    record.shape = tuple(live.shape[:2])
                record.layer_inputs[index] = _at(live.detach(), record.points)
            if index == 0 and self.plan is not None and self.patch.corrupted.shape != tuple(live.shape[:2]):
                raise ValueError(f"edge patching: this pass runs {tuple(live.shape[:2])} [rows, tokens], the "
                                 f"corrupted recording {self.patch.corrupted.shape}: record the corrupted run "
                                 "of the same batch of prompts")
            corrupted = self.patch.corrupted.layer_inputs[index] if self.plan is not None else None
            inputs = self._inputs(graph.attention_slice(index), live, corrupted,
                                  graph.upstream(graph.attention_slice(index).start))
            if inputs is not None:
                self.attention_inputs[index] = inputs
            if replaced is None:
                return None
            if args:
                return (replaced, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": replaced}
        return hook

    def _mlp_input(self, index: int):
        graph = self.graph

        def hook(module, args, output):
            live = args[0]
            if self.patch.record is not None:
                self.patch.record.middle[index] = _at(live.detach(), self.patch.record.points)
            self.attention_inputs.pop(index, None)
            receiver = graph.mlp_receiver(index)
            corrupted = self.patch.corrupted.middle[index] if self.plan is not None else None
            return self._single_receiver(module, receiver, live, output, corrupted, graph.upstream(receiver))
        return hook

    def _final(self):
        graph = self.graph

        def hook(module, args, output):
            live = args[0]
            if self.patch.record is not None:
                self.patch.record.final = _at(live.detach(), self.patch.record.points)
            corrupted = self.patch.corrupted.final if self.plan is not None else None
            return self._single_receiver(module, graph.logits_receiver, live, output, corrupted, graph.n_senders)
        return hook
