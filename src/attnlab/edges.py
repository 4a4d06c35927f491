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
- ``perturb``: a zero tensor that requires grad is added to every receiver's input, so that one
  backward pass gives the gradient of the metric at each receiver (edge attribution).

A receiver's input is computed from whichever side it keeps less of: the live residual minus
(live − corrupted) of its dropped senders, or the corrupted residual plus (live − corrupted) of its
kept ones. So all edges kept is the unpatched forward to the last bit (nothing is touched) and
no edge kept is the corrupted forward to float rounding (each receiver reads the corrupted
residual itself). Only the layer under way holds its receivers' inputs.

Post-norms that rescale a block's output before it joins the residual (Gemma-3's
post_attention_layernorm and post_feedforward_layernorm) are RMS norms: a head's contribution is
its o_proj slice times the norm's scale of the block's whole output, so the heads' contributions
still add up to what the layer adds. Architectures whose layers lack these parts are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
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
    """One forward's sender contributions [senders, rows, tokens, hidden] and the residual stream
    at each receiver's point: each layer's input, its MLP's input (``middle``) and the final
    norm's input."""

    senders: torch.Tensor | None = None
    layer_inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    middle: dict[int, torch.Tensor] = field(default_factory=dict)
    final: torch.Tensor | None = None
    # the (live − corrupted) rows of the passes patched against this recording, reused from pass
    # to pass: zeros at first, then always finite, which is all a row multiplied by 0 needs
    differences: torch.Tensor | None = None


@dataclass(eq=False)
class Perturbation:
    """Zero leaves added to the receivers' inputs (the same across passes, so their gradients add
    up), one per group of receivers that read one point of the residual stream, keyed by the
    group's first receiver: [receivers of the group, rows, tokens, hidden]."""

    groups: dict[int, torch.Tensor] = field(default_factory=dict)

    def leaf(self, first: int, like: torch.Tensor, count: int) -> torch.Tensor:
        store = self.groups.get(first)
        if store is None:
            store = torch.zeros(count, *like.shape, device=like.device, dtype=like.dtype, requires_grad=True)
            self.groups[first] = store
        if store.shape[1:] != like.shape:
            raise ValueError(f"the perturbation was made for inputs {tuple(store.shape[1:])}, this pass runs "
                             f"{tuple(like.shape)}: use one Perturbation per batch of prompts")
        return store

    def gradient(self, first: int) -> torch.Tensor:
        return self.groups[first].grad


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


class _ReceiverProjection(nn.Module):
    """Stands in for q_proj, k_proj or v_proj of a layer whose receivers get their own inputs:
    each head's slice of the projection applied to the layer's pre-norm of that head's input."""

    def __init__(self, linear: nn.Linear, state: "_Installed", layer: int, rows: slice, heads: int):
        super().__init__()
        self.linear, self.state, self.layer, self.rows, self.heads = linear, state, layer, rows, heads

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        inputs = self.state.attention_inputs.get(self.layer)
        if inputs is None:
            return self.linear(hidden_states)
        normed = self.state.layers[self.layer].input_layernorm(inputs[self.rows])  # [heads, b, t, d]
        weight = self.linear.weight.view(self.heads, -1, self.linear.in_features)
        out = torch.einsum("hbtd,hed->bthe", normed, weight).flatten(2)
        return out if self.linear.bias is None else out + self.linear.bias


@dataclass(eq=False)
class EdgePatch:
    """The edge part of ``intervened`` (module docstring). ``kept`` needs ``corrupted``;
    ``record`` and ``perturb`` work alone or with it."""

    graph: Graph
    kept: torch.Tensor | None = None
    corrupted: Recording | None = None
    record: Recording | None = None
    perturb: Perturbation | None = None

    def __post_init__(self):
        if self.kept is not None and self.corrupted is None:
            raise ValueError("patching edges (kept=) needs the corrupted run's Recording (corrupted=)")
        self.plan = None if self.kept is None else Plan.of(self.graph, self.kept)

    def install(self, model) -> "_Installed":
        return _Installed(self, model)


def _norm_weight(norm: nn.Module, hidden: int, device) -> tuple[torch.Tensor, float]:
    """(w, eps) of an RMS norm y = x · rsqrt(mean(x²) + eps) · w, read from the module itself:
    its output on a row of ones is w · rsqrt(1 + eps)."""
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
        self.deltas: torch.Tensor | None = None  # live − corrupted, per sender (patching only)
        self.handles, self.swapped = [], []
        hidden = model.config.get_text_config().hidden_size
        for index, layer in enumerate(self.layers):
            missing = [name for name in REQUIRED if not hasattr(layer, name)]
            if missing:
                raise NotImplementedError(f"edge patching: decoder layer {type(layer).__name__} has no {missing}")
            sandwich = hasattr(layer, "pre_feedforward_layernorm")
            mlp_norm = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
            attention_scale = _norm_weight(layer.post_attention_layernorm, hidden, model.device) if sandwich else None
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

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        for module, name, original in self.swapped:
            setattr(module, name, original)
        self.attention_inputs.clear()
        self.deltas = None

    # ---- senders ----
    def _sender(self, index: int, value: torch.Tensor) -> None:
        """Sender ``index`` wrote ``value`` [rows, tokens, hidden] (or several: [n, rows, ...])."""
        values = value if value.dim() == 4 else value[None]
        stop = index + len(values)
        record = self.patch.record
        if record is not None:
            if record.senders is None:
                record.senders = values.new_empty(self.graph.n_senders, *values.shape[1:])
            record.senders[index:stop] = values.detach()
        if self.plan is not None and bool(self.plan.used[index:stop].any()):  # others are never read
            recorded = self.patch.corrupted.senders
            if recorded.shape[1:] != values.shape[1:]:
                raise ValueError(f"edge patching: this pass runs {tuple(values.shape[1:])} [rows, tokens, hidden], "
                                 f"the corrupted recording holds {tuple(recorded.shape[1:])}: record the "
                                 "corrupted run of the same batch of prompts")
            if self.deltas is None:  # a sender no receiver reads is never written: the matrix product
                # in _mixed multiplies its row by 0, so it must be finite (Recording.differences)
                if self.patch.corrupted.differences is None:
                    self.patch.corrupted.differences = torch.zeros_like(recorded)
                self.deltas = self.patch.corrupted.differences
            torch.sub(values, self.patch.corrupted.senders[index:stop], out=self.deltas[index:stop])

    def _heads(self, index: int, scale):
        n_heads = self.graph.n_heads

        first = self.graph.head_sender(index, 0)

        def record(module, args, output):
            unread = self.plan is None or not bool(self.plan.used[first:first + n_heads].any())
            if self.patch.record is None and unread:
                return
            z = args[0]  # o_proj's input, the heads' outputs side by side; a bias is no sender's
            weight = module.weight.view(module.out_features, n_heads, -1)
            heads = torch.einsum("bthe,dhe->hbtd", z.view(*z.shape[:-1], n_heads, -1), weight)
            if scale is not None:  # a post-norm of the block's output: the same scale for every head
                weight_norm, eps = scale
                heads = heads * (torch.rsqrt(output.float().pow(2).mean(-1, keepdim=True) + eps) * weight_norm)
            self._sender(self.graph.head_sender(index, 0), heads)
        return record

    def _mlp_output(self, index: int):
        def record(module, args, output):
            self._sender(self.graph.mlp_sender(index), output)
        return record

    # ---- receivers ----
    def _inputs(self, receivers: slice, live: torch.Tensor, corrupted: torch.Tensor | None,
                upstream: int) -> torch.Tensor | None:
        """The inputs [receivers, rows, tokens, hidden] of ``receivers``, all fed by the first
        ``upstream`` senders, whose point in the live residual stream is ``live``; None where
        every one of them reads ``live`` as it is."""
        inputs = None
        plan = self.plan
        if plan is not None and bool(plan.patched[receivers].any()):
            inputs = self._mixed(plan, receivers, live, corrupted, upstream)
        if self.patch.perturb is not None:
            count = receivers.stop - receivers.start
            leaf = self.patch.perturb.leaf(receivers.start, live, count)
            inputs = (live.expand(count, *live.shape) if inputs is None else inputs) + leaf
        return inputs

    def _mixed(self, plan: Plan, receivers: slice, live: torch.Tensor, corrupted: torch.Tensor,
               upstream: int) -> torch.Tensor:
        """base + Σ_s coef[s, r] (live − corrupted)_s for each receiver r, as one matrix product
        on top of the base most of them read (the others corrected by the bases' difference)."""
        coef = plan.coef[:upstream, receivers]  # [senders, receivers]
        used = coef.abs().sum(1).nonzero()[:, 0]
        if not len(used):  # every receiver reads its base as it is
            on_live = plan.live_base[receivers].to(live.device)[:, None, None, None]
            return torch.where(on_live, live, corrupted)
        deltas = self.deltas[:upstream]
        if coef.shape[1] == 1:  # one receiver (an MLP, the logits): add its senders one by one
            base = live if bool(plan.live_base[receivers][0]) else corrupted
            inputs = base.clone()
            for sender in used.tolist():
                inputs.add_(deltas[sender], alpha=float(coef[sender, 0]))
            return inputs[None]
        if 4 * len(used) < upstream:  # a few senders: gather them; else the whole prefix (a view)
            coef, deltas = coef[used], deltas.index_select(0, used.to(deltas.device))
        on_live = plan.live_base[receivers]
        majority, minority = (live, corrupted) if 2 * int(on_live.sum()) >= len(on_live) else (corrupted, live)
        inputs = torch.addmm(majority.reshape(1, -1), coef.T.to(live.device, live.dtype), deltas.flatten(1))
        others = (on_live != (majority is live)).nonzero()[:, 0]
        if len(others):
            inputs[others.to(live.device)] += (minority - majority).reshape(1, -1)
        return inputs.view(-1, *live.shape)

    def _layer_input(self, index: int):
        graph = self.graph

        def hook(module, args, kwargs):
            live = args[0] if args else kwargs["hidden_states"]
            if index == 0:
                self.attention_inputs.clear()
                self._sender(0, live)
            record = self.patch.record
            if record is not None:
                record.layer_inputs[index] = live.detach()
            corrupted = self.patch.corrupted.layer_inputs[index] if self.plan is not None else None
            inputs = self._inputs(graph.attention_slice(index), live, corrupted,
                                  graph.upstream(graph.attention_slice(index).start))
            if inputs is not None:
                self.attention_inputs[index] = inputs
        return hook

    def _mlp_input(self, index: int):
        graph = self.graph

        def hook(module, args, output):
            live = args[0]
            if self.patch.record is not None:
                self.patch.record.middle[index] = live.detach()
            self.attention_inputs.pop(index, None)
            receiver = graph.mlp_receiver(index)
            corrupted = self.patch.corrupted.middle[index] if self.plan is not None else None
            inputs = self._inputs(slice(receiver, receiver + 1), live, corrupted, graph.upstream(receiver))
            return None if inputs is None else module.forward(inputs[0])  # forward: not this hook again
        return hook

    def _final(self):
        graph = self.graph

        def hook(module, args, output):
            live = args[0]
            if self.patch.record is not None:
                self.patch.record.final = live.detach()
            receiver = graph.logits_receiver
            corrupted = self.patch.corrupted.final if self.plan is not None else None
            inputs = self._inputs(slice(receiver, receiver + 1), live, corrupted, graph.n_senders)
            return None if inputs is None else module.forward(inputs[0])
        return hook
