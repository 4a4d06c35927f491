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

A receiver's input is computed from whichever side it keeps less of (``Plan``): the live
residual minus (live − corrupted) of its dropped senders, or the corrupted residual plus
(live − corrupted) of its kept ones, summed by an embedding bag per token and receiver that
reads only those rows of a table holding the senders' differences and the two bases (``Mix``).
So all edges kept is the unpatched forward to the last bit (nothing is touched) and no edge kept
is the corrupted forward to float rounding (each receiver reads the corrupted residual itself).
Only the layer under way holds its receivers' inputs, and only at the tokens the corrupted
``Recording`` keeps: from each prompt's first clean/corrupted difference on. Before it every
pass computes what the corrupted run computed, so a patching pass runs the layers' q/k/v/o
projections and MLPs only at the patched tokens and takes their outputs elsewhere from the
recording. Receivers that read a base as it is share one projection of it; a mixed
query/key/value head's RMS pre-norm (its weight read from the module) is folded into its
projection. The heads' differences are W_O,h (z_h − corrupted z_h) from o_proj's inputs, and
o_proj's output at the patched tokens the corrupted run's plus their sum (without a post-norm
of the attention block: with one, each head's output is scaled by it and subtracted).

Post-norms that rescale a block's output before it joins the residual (Gemma-3's
post_attention_layernorm and post_feedforward_layernorm) are RMS norms: a head's contribution is
its o_proj slice times the norm's scale of the block's whole output, so the heads' contributions
still add up to what the layer adds. Architectures whose layers lack these parts are refused.
"""

from __future__ import annotations

import functools
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

    def reading_points(self) -> list[slice]:
        """The receivers reading each point of the residual stream, in the model's order: each
        layer's query/key/value heads (its input), its MLP (its middle), then the logits."""
        points = []
        for layer in range(self.n_layers):
            mlp = self.mlp_receiver(layer)
            points += [self.attention_slice(layer), slice(mlp, mlp + 1)]
        return points + [slice(self.logits_receiver, self.logits_receiver + 1)]

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
    head_inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # o_proj's input [points, heads · e]
    attention_outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # o_proj's output [points, hidden]
    # the outputs of each layer's q/k/v/o projections and MLP at the tokens not in ``points``
    # [tokens, features], where every pass patched against this recording computes the same
    elsewhere: dict[tuple, torch.Tensor] = field(default_factory=dict)
    # what the passes patched against this recording sum receivers' inputs from, [senders + 2,
    # points, hidden] (``Mix``): each sender's (live − corrupted), then the live and the corrupted
    # residual at the reading point under way. One buffer reused from pass to pass: a pass writes
    # every row it reads before reading it
    table: torch.Tensor | None = None

    def unpatched(self, device) -> torch.Tensor:
        """The flat indices of the tokens not in ``points`` (``points`` and ``shape`` set)."""
        other = torch.ones(int(np.prod(self.shape)), dtype=torch.bool, device=device)
        other[self.points.to(device)] = False
        return other.nonzero()[:, 0]


@dataclass(eq=False)
class ReceiverGradients:
    """The gradient of the metric with respect to each receiver's input, summed over the backward
    passes of the forwards that carry it: one tensor (float32 at least) per layer's receivers
    (``Graph.layer_receivers``: its query/key/value heads and its MLP; the logits alone), keyed by
    the first of them, [receivers, points, hidden], at the flat token indices ``points`` (None:
    every token; EAP needs only those where clean and corrupted activations differ)."""

    points: torch.Tensor | None = None
    groups: dict[int, torch.Tensor] = field(default_factory=dict)

    def at_points(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., rows, tokens, features] at the points: [..., points, features]."""
        return _at(x, self.points)

    def add(self, first: int, count: int, within: slice, gradient: torch.Tensor) -> None:
        """Add ``gradient`` [receivers, points, hidden] (``at_points``) to receivers ``within``
        the group of ``count`` receivers starting at ``first``."""
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


@dataclass(eq=False)
class Mix:
    """The inputs of the receivers of one reading point that sum senders, at the patched points:
    receiver i's input is Σ coefs[j] · table[rows[j]] over its ``counts[i]`` entries (the table
    of ``Recording.table``: the senders' (live − corrupted), then the live and the corrupted
    residual): its base with coefficient 1, then its senders' differences, −1 each from the live
    base (the senders it drops) or +1 from the corrupted one (those it keeps)."""

    receivers: list[int]
    rows: torch.Tensor  # long, receiver-major
    coefs: torch.Tensor
    counts: torch.Tensor  # long, per receiver

    def bags(self, points: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indices, offsets, weights) of an embedding bag per point and receiver (point-major:
        the receivers of a point read their rows while they are in cache) over the table viewed
        as [rows · points, hidden]."""
        point = torch.arange(points)[:, None]
        indices = (self.rows[None] * points + point).flatten()
        offsets = (point * len(self.rows) + (torch.cumsum(self.counts, 0) - self.counts)[None]).flatten()
        return indices.to(device), offsets.to(device), self.coefs.to(device, dtype).repeat(points)


@dataclass(frozen=True, eq=False)
class Plan:
    """What each receiver reads, from a kept-edges mask: the live residual minus (live −
    corrupted) of its dropped senders, or the corrupted residual plus (live − corrupted) of its
    kept ones, whichever sums fewer (``base``: force one). Receivers that build on an earlier
    receiver's sum were tried: ~1/3 fewer rows at a circuit's crossing, but slower on a CPU."""

    live_base: torch.Tensor  # [receivers] bool
    patched: torch.Tensor  # [receivers] bool: the receiver does not read the live residual as it is
    mixing: torch.Tensor  # [receivers] bool: it reads a sum of its own (else a base as it is)
    used: torch.Tensor  # [senders] bool: some receiver reads the sender's (live − corrupted)
    mixes: dict[int, Mix]  # by the first receiver of each reading point

    @property
    def terms(self) -> int:
        """Rows summed per patched point, over every receiver (its base included)."""
        return sum(len(mix.rows) for mix in self.mixes.values())

    @classmethod
    def of(cls, graph: Graph, kept: torch.Tensor, base: str | None = None) -> "Plan":
        valid = _valid(graph)
        if tuple(kept.shape) != valid.shape:
            raise ValueError(f"kept edges: a [senders, receivers] = {valid.shape} mask, not {tuple(kept.shape)}")
        if base not in (None, "live", "corrupted"):
            raise ValueError(f"base: 'live', 'corrupted' or None (whichever sums fewer), not {base!r}")
        kept = kept.bool().cpu().numpy() & valid
        dropped = valid & ~kept
        if base is None:  # on a tie, and where nothing is dropped, the live one
            on_live = dropped.sum(0) <= kept.sum(0)
        else:
            on_live = np.full(graph.n_receivers, base == "live")
        summed = np.where(on_live[None], dropped, kept)  # [senders, receivers]
        mixing = summed.any(0)
        mixes = {}
        for point in graph.reading_points():
            receivers = np.arange(point.start, point.stop)[mixing[point]]
            if len(receivers):
                mixes[point.start] = _mix(graph.n_senders, receivers, on_live, summed)
        patched = ~on_live | mixing  # a live base with nothing dropped reads the live residual as it is
        return cls(*(torch.from_numpy(a) for a in (on_live, patched, mixing, summed.any(1))), mixes)


@functools.lru_cache(maxsize=8)
def _valid(graph: Graph) -> np.ndarray:
    valid = graph.valid().numpy()
    valid.flags.writeable = False
    return valid


def _mix(n_senders: int, receivers: np.ndarray, on_live: np.ndarray, summed: np.ndarray) -> Mix:
    """The entries of ``receivers``' sums (one reading point): base, then senders."""
    which, sender = np.nonzero(summed[:, receivers].T)  # receiver-major
    live = on_live[receivers]
    owner = np.concatenate([np.arange(len(receivers)), which])
    rows = np.concatenate([np.where(live, n_senders, n_senders + 1), sender])
    coefs = np.concatenate([np.ones(len(receivers)), np.where(live[which], -1.0, 1.0)])
    order = np.argsort(owner, kind="stable")  # each receiver's base, then its senders
    return Mix(receivers.tolist(), torch.from_numpy(rows[order]).long(), torch.from_numpy(coefs[order]).float(),
               torch.from_numpy(np.bincount(owner, minlength=len(receivers))).long())


@dataclass(eq=False)
class _GroupInputs:
    """What a group of receivers reading one point of the residual stream reads at the patched
    points: the receivers at offsets ``mixed_at`` (within the group) their own mixes ``mixed``
    [len(mixed_at), points, hidden]; those at ``corrupted_at`` the corrupted residual
    ``corrupted`` [points, hidden] as it is; the others the live residual as it is."""

    mixed: torch.Tensor | None
    mixed_at: list[int]
    corrupted: torch.Tensor
    corrupted_at: list[int]
    corrupted_normed: torch.Tensor | None = None  # the pre-norm of ``corrupted``, once per group


class _AtPatchedPoints(nn.Module):
    """Stands in for a layer's o_proj or MLP. On a patched pass it runs only at the patched
    points: before a prompt's first clean/corrupted difference every pass computes the same, so
    there it returns what the corrupted recording kept. On a recording pass it keeps its output at
    those tokens."""

    def __init__(self, module: nn.Module, state: "_Installed", key: tuple, at_points=None):
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


class _ReceiverProjection(nn.Module):
    """Stands in for q_proj, k_proj or v_proj of a layer whose receivers get their own inputs:
    each head's slice of the projection applied to the layer's pre-norm of that head's input."""

    def __init__(self, linear: nn.Linear, state: "_Installed", layer: int, rows: slice, heads: int):
        super().__init__()
        self.linear, self.state, self.layer, self.rows, self.heads = linear, state, layer, rows, heads
        self.key = ("qkv", layer, rows.start)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        group = self.state.attention_inputs.get(self.layer)
        weight = self.linear.weight.view(self.heads, -1, self.linear.in_features)
        if group is None:  # every head on the live residual
            if self.state.restricted:
                return self.state.at_patched_points(hidden_states, self.key, self.linear)
            out = self.linear(hidden_states)
            self.state.keep_elsewhere(self.key, out)
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
            x = group.mixed[_contiguous([index for index, _ in own])]  # [own heads, points, d]
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
    plan: "Plan | None" = None  # of ``kept`` (made from it when not given)

    def __post_init__(self):
        if self.kept is not None and self.corrupted is None:
            raise ValueError("patching edges (kept=) needs the corrupted run's Recording (corrupted=)")
        if self.kept is not None and self.gradients is not None:
            raise ValueError("receiver gradients (gradients=) are taken on unpatched passes: drop kept= "
                             "(EAP-IG moves the inputs from the corrupted to the clean prompt, not the edges)")
        if self.plan is not None and self.kept is None:
            raise ValueError("plan= is the plan of the kept edges: give kept= with it")
        if self.plan is None and self.kept is not None:
            self.plan = Plan.of(self.graph, self.kept)

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
        self.heads_written: set[int] = set()  # layers whose heads' differences this pass has written
        self.hidden, self.device = model.config.get_text_config().hidden_size, model.device
        self.points = None if patch.plan is None else patch.corrupted.points
        self.unpatched_points = None  # the other tokens of the pass
        if self.points is not None:
            self.points = self.points.to(model.device)
            self.unpatched_points = patch.corrupted.unpatched(model.device)
        # tokens before every prompt's first difference are not recomputed (all edges kept: the
        # unpatched forward, untouched)
        self.restricted = (self.points is not None and len(self.unpatched_points) > 0
                           and bool(self.plan.patched.any()))
        self.handles, self.swapped = [], []
        for index, layer in enumerate(self.layers):
            missing = [name for name in REQUIRED if not hasattr(layer, name)]
            if missing:
                raise NotImplementedError(f"edge patching: decoder layer {type(layer).__name__} has no {missing}")
            sandwich = hasattr(layer, "pre_feedforward_layernorm")
            o_proj = layer.self_attn.o_proj
            output_at_points = None if sandwich else functools.partial(self._attention_output, index, o_proj)
            self._swap(layer.self_attn, "o_proj", _AtPatchedPoints(o_proj, self, ("o", index), output_at_points))
            self._swap(layer, "mlp", _AtPatchedPoints(layer.mlp, self, ("mlp", index)))
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
            self._swap(attention, name, _ReceiverProjection(getattr(attention, name), self, index, rows, heads))

    def _swap(self, parent: nn.Module, name: str, stand_in: nn.Module) -> None:
        self.swapped.append((parent, name, getattr(parent, name)))
        setattr(parent, name, stand_in)

    def keep_elsewhere(self, key: tuple, out: torch.Tensor) -> None:
        """On a recording pass that keeps only some points, keep ``out`` [rows, tokens, features]
        at the others."""
        record = self.patch.record
        if record is not None and record.points is not None:
            record.elsewhere[key] = _at(out.detach(), record.unpatched(out.device))

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
        return self.at_points(x, module(_at(x, self.points)), lambda: self.recorded_elsewhere(x, key))

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
        for module, name, original in reversed(self.swapped):
            setattr(module, name, original)
        self.attention_inputs.clear()
        self.live_inputs.clear()
        self.heads_written.clear()

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

    def _table(self) -> torch.Tensor:
        """The corrupted recording's table (``Recording.table``), made at the first pass patched
        against it; NaN until written, so a sum reading a row no pass wrote shows in the metrics."""
        corrupted = self.patch.corrupted
        if corrupted.table is None:
            senders, points, hidden = corrupted.senders.shape
            corrupted.table = corrupted.senders.new_full((senders + 2, points, hidden), float("nan"))
        return corrupted.table

    def _patched_sender(self, index: int, count: int, current) -> None:
        """Senders ``index`` to ``index + count`` wrote ``current()`` [count, points, hidden] at the
        patched points: keep their (live − corrupted) where some receiver reads it."""
        if self.plan is None or not bool(self.plan.used[index:index + count].any()):  # never read
            return
        torch.sub(current(), self.patch.corrupted.senders[index:index + count],
                  out=self._table()[index:index + count])

    def _head_differences(self, o_proj: nn.Module, first: int, z: torch.Tensor, corrupted_z: torch.Tensor) -> None:
        """The heads' (live − corrupted) from o_proj's inputs at the patched points, ``z`` and
        ``corrupted_z`` [points, heads · e]: W_O,h (z_h − corrupted z_h), written straight into
        the table (one product instead of a product and a difference)."""
        n_heads = self.graph.n_heads
        difference = (z - corrupted_z).view(len(z), n_heads, -1).transpose(0, 1)  # [heads, points, e]
        weight = o_proj.weight.view(o_proj.out_features, n_heads, -1).permute(1, 2, 0)  # [heads, e, hidden]
        torch.bmm(difference, weight.to(difference.dtype), out=self._table()[first:first + n_heads])

    def _heads(self, index: int, scale):
        n_heads = self.graph.n_heads

        first = self.graph.head_sender(index, 0)

        def record(module, args, output):
            unread = self.plan is None or not bool(self.plan.used[first:first + n_heads].any())
            if self.patch.record is None and unread:
                return
            z = args[0]  # o_proj's input, the heads' outputs side by side; a bias is no sender's
            module = module.module  # the o_proj the stand-in runs
            record = self.patch.record
            if record is not None:  # recorded: no graph (a recording pass may be taking gradients)
                if scale is None:  # the heads' differences are linear in o_proj's input
                    record.head_inputs[index] = _at(z.detach(), record.points)
                    record.attention_outputs[index] = _at(output.detach(), record.points)
                self._sender(first, self._head_outputs(module, z.detach(), output.detach(), scale))
            elif index in self.heads_written:
                return
            elif scale is None and index in self.patch.corrupted.head_inputs:  # only patched points are read
                self._head_differences(module, first, _at(z, self.points), self.patch.corrupted.head_inputs[index])
            else:
                self._patched_sender(first, n_heads, lambda: self._head_outputs(
                    module, _at(z, self.points), _at(output, self.points), scale))
        return record

    def _attention_output(self, index: int, o_proj: nn.Module, z: torch.Tensor) -> torch.Tensor:
        """o_proj's output at the patched points from its input there, ``z`` [points, heads · e].
        Where some receiver reads the heads' differences, they are computed first (into the
        table) and the output is the corrupted run's plus their sum: o_proj's product, once."""
        first, n_heads, corrupted = self.graph.head_sender(index, 0), self.graph.n_heads, self.patch.corrupted
        if not bool(self.plan.used[first:first + n_heads].any()) or index not in corrupted.attention_outputs:
            return o_proj(z)
        self._head_differences(o_proj, first, z, corrupted.head_inputs[index])
        self.heads_written.add(index)
        return torch.sum(self._table()[first:first + n_heads], 0).add_(corrupted.attention_outputs[index])

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
    def _inputs(self, receivers: slice, live: torch.Tensor, corrupted: torch.Tensor | None) -> "_GroupInputs | None":
        """What ``receivers``, one reading point's, read at the patched points, where the live
        residual stream is ``live`` [rows, tokens, hidden] and the corrupted run's ``corrupted``
        [points, hidden]; None where every one reads ``live`` as it is."""
        plan = self.plan
        if plan is None or not bool(plan.patched[receivers].any()):
            return None
        mix = plan.mixes.get(receivers.start)
        mixed = None if mix is None else self._mixed(mix, live, corrupted)
        mixed_at = [] if mix is None else [receiver - receivers.start for receiver in mix.receivers]
        as_corrupted = plan.patched[receivers] & ~plan.mixing[receivers]  # nothing kept
        return _GroupInputs(mixed, mixed_at, corrupted, as_corrupted.nonzero()[:, 0].tolist())

    def _single_receiver(self, module: nn.Module, receiver: int, live: torch.Tensor, output: torch.Tensor,
                         corrupted: torch.Tensor | None) -> torch.Tensor | None:
        """The output of the pre-norm ``module`` of a lone receiver (an MLP, the logits) on its own
        input, given its ``output`` on the ``live`` residual; None where it reads ``live`` as it
        is and no gradient is asked for."""
        group = self._inputs(slice(receiver, receiver + 1), live, corrupted)
        if group is not None:  # forward: not this hook again
            own = group.corrupted if group.mixed is None else group.mixed[0]
            return self.at_points(output, module.forward(own), output.clone)
        gradients = self.patch.gradients
        if gradients is None or not live.requires_grad:
            return None
        own = live.view_as(live)  # its gradient is the part that flows through this norm alone
        layer = self.graph.layer_receivers(receiver)
        within = slice(receiver - layer.start, receiver - layer.start + 1)
        own.register_hook(lambda grad: gradients.add(layer.start, layer.stop - layer.start, within,
                                                     gradients.at_points(grad)[None]))
        return module.forward(own)

    def _mixed(self, mix: Mix, live: torch.Tensor, corrupted: torch.Tensor) -> torch.Tensor:
        """The inputs [receivers, points, hidden] of ``mix``'s receivers: an embedding bag per
        point and receiver over the table, reading only the rows each one sums (a dense product
        over every sender some receiver of the point sums costs ~4x the flops at a circuit's
        crossing and runs only ~2x faster per flop on a CPU)."""
        table, base = self._table(), self.graph.n_senders
        table[base].copy_(_at(live, self.points))
        table[base + 1].copy_(corrupted)
        points, hidden = table.shape[1:]
        indices, offsets, weights = mix.bags(points, table.dtype, table.device)
        inputs = F.embedding_bag(indices, table.view(-1, hidden), offsets, mode="sum", per_sample_weights=weights)
        return inputs.view(points, len(mix.receivers), hidden).transpose(0, 1)

    def _layer_input(self, index: int):
        graph = self.graph

        def hook(module, args, kwargs):
            live = args[0] if args else kwargs["hidden_states"]
            replaced = None
            if index == 0:
                self.attention_inputs.clear()
                self.live_inputs.clear()
                self.heads_written.clear()
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
            inputs = self._inputs(graph.attention_slice(index), live, corrupted)
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
            return self._single_receiver(module, receiver, live, output, corrupted)
        return hook

    def _final(self):
        graph = self.graph

        def hook(module, args, output):
            live = args[0]
            if self.patch.record is not None:
                self.patch.record.final = _at(live.detach(), self.patch.record.points)
            corrupted = self.patch.corrupted.final if self.plan is not None else None
            return self._single_receiver(module, graph.logits_receiver, live, output, corrupted)
        return hook
