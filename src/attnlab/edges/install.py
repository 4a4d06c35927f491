"""Installing an ``EdgePatch`` on a model: its hooks at every sender and every reading point and
its stand-ins for each layer's q/k/v/o projections and MLP, removed together by the handle."""

from __future__ import annotations

import functools

from torch import nn

from attnlab.edges.graph import Graph
from attnlab.edges.norms import norm_weight
from attnlab.edges.receivers import ReceiverHooks
from attnlab.edges.senders import SenderHooks
from attnlab.edges.stand_ins import AtPatchedPoints, ReceiverProjection
from attnlab.edges.state import PassState

# Decoder-layer parts an edge patch reads: every architecture here has input_layernorm,
# self_attn.{q,k,v,o}_proj and mlp; the norm before the MLP is post_attention_layernorm, except
# in sandwich-norm layers (Gemma-2/3), where that norm rescales the attention output and
# pre_feedforward_layernorm precedes the MLP.
REQUIRED = ("input_layernorm", "self_attn", "mlp", "post_attention_layernorm")


class Installed:
    """The hooks and stand-ins of one ``EdgePatch`` on one model (a handle: ``remove``)."""

    def __init__(self, patch, model):
        decoder = model.get_decoder()
        if Graph.of(model) != patch.graph:
            raise ValueError(f"the edge patch was made for {patch.graph}, the model is {Graph.of(model)}")
        self.state = PassState(patch, model)
        self.senders = SenderHooks(self.state)
        self.receivers = ReceiverHooks(self.state, self.senders)
        self.handles, self.swapped = [], []
        for index, layer in enumerate(self.state.layers):
            self._install_layer(index, layer)
        self.handles.append(decoder.norm.register_forward_hook(self.receivers.final()))

    def _install_layer(self, index: int, layer: nn.Module) -> None:
        missing = [name for name in REQUIRED if not hasattr(layer, name)]
        if missing:
            raise NotImplementedError(f"edge patching: decoder layer {type(layer).__name__} has no {missing}")
        state, senders, receivers = self.state, self.senders, self.receivers
        sandwich = hasattr(layer, "pre_feedforward_layernorm")
        o_proj = layer.self_attn.o_proj
        # without a post-norm the heads' differences give o_proj's output (``attention_output``)
        output_at_points = None if sandwich else functools.partial(senders.attention_output, index, o_proj)
        # the stand-ins go in first: the hooks below are registered on them
        self._swap(layer.self_attn, "o_proj", AtPatchedPoints(o_proj, state, ("o", index), output_at_points))
        self._swap(layer, "mlp", AtPatchedPoints(layer.mlp, state, ("mlp", index)))
        mlp_norm = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
        attention_scale = norm_weight(layer.post_attention_layernorm, state.hidden, state.device) if sandwich else None
        mlp_out = layer.post_feedforward_layernorm if sandwich else layer.mlp
        self.handles += [
            layer.register_forward_pre_hook(receivers.layer_input(index), with_kwargs=True),
            layer.self_attn.o_proj.register_forward_hook(senders.heads(index, attention_scale)),
            mlp_norm.register_forward_hook(receivers.mlp_input(index)),
            mlp_out.register_forward_hook(senders.mlp_output(index)),
        ]
        self._swap_projections(index, layer.self_attn)

    def _swap_projections(self, index: int, attention: nn.Module) -> None:
        graph = self.state.graph
        h, g = graph.n_heads, graph.n_kv_heads
        for name, rows, heads in (("q_proj", slice(0, h), h), ("k_proj", slice(h, h + g), g),
                                  ("v_proj", slice(h + g, h + 2 * g), g)):
            self._swap(attention, name, ReceiverProjection(getattr(attention, name), self.state, index, rows, heads))

    def _swap(self, parent: nn.Module, name: str, stand_in: nn.Module) -> None:
        self.swapped.append((parent, name, getattr(parent, name)))
        setattr(parent, name, stand_in)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        for module, name, original in reversed(self.swapped):
            setattr(module, name, original)
        self.state.clear()
