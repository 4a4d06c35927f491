"""Installing an ``EdgePatch`` on a model: its hooks at every sender and every reading point and
its stand-ins for each layer's projections and MLP, removed together by the handle. The parts
come from the model's anatomy (``attnlab.anatomy``): pre-norm blocks (Llama, Qwen2, GPT-2, OLMo),
sandwich norms (Gemma-3) and post-norms (OLMo-2)."""

from __future__ import annotations

import functools

from torch import nn

from attnlab import anatomy
from attnlab.interventions.edges.graph import Graph
from attnlab.interventions.edges.receivers import ReceiverHooks
from attnlab.interventions.edges.senders import SenderHooks
from attnlab.interventions.edges.stand_ins import AtPatchedPoints, ReadingPoint, ReceiverProjection
from attnlab.interventions.edges.state import PassState


class Installed:
    """The hooks and stand-ins of one ``EdgePatch`` on one model (a handle: ``remove``)."""

    def __init__(self, patch, model):
        parts = anatomy.of(model, stages=("edge circuits",))
        if Graph.of(model) != patch.graph:
            raise ValueError(f"the edge patch was made for {patch.graph}, the model is {Graph.of(model)}")
        self.state = PassState(patch, model, parts)
        self.senders = SenderHooks(self.state)
        self.receivers = ReceiverHooks(self.state, self.senders)
        self.handles, self.swapped = [], []
        try:
            for index in range(parts.n_layers):
                self._install_layer(parts, index)
            self.handles.append(parts.final_norm.register_forward_hook(self.receivers.final()))
        except BaseException:
            self.remove()
            raise

    def _install_layer(self, parts: anatomy.Anatomy, index: int) -> None:
        state, senders, receivers = self.state, self.senders, self.receivers
        attention_out = parts.norm(index, "attention_out")
        attention_scale = None if attention_out is None else _post_norm(parts, attention_out, index, state.device)
        o_slot = parts.projection_slot(index, "o")
        o_proj = o_slot.get()
        # without a post-norm the heads' differences give the output projection's output
        output_at_points = None if attention_out is not None else functools.partial(senders.attention_output, index, o_proj)
        # the stand-ins go in first: the hooks below are registered on them
        self._swap(o_slot, AtPatchedPoints(o_proj, state, ("o", index), output_at_points))
        mlp_slot = parts.mlp_slot(index)
        mlp = AtPatchedPoints(mlp_slot.get(), state, ("mlp", index))
        mlp_reads = parts.norm(index, "mlp_in")
        if mlp_reads is None:  # no norm before the MLP: it reads the residual stream as it is
            mlp_reads = ReadingPoint()
            self._swap(mlp_slot, nn.Sequential(mlp_reads, mlp))
        else:
            self._swap(mlp_slot, mlp)
        mlp_out = parts.norm(index, "mlp_out") or mlp_slot.get()
        self.handles += [
            parts.block(index).register_forward_pre_hook(receivers.layer_input(index), with_kwargs=True),
            o_slot.get().register_forward_hook(senders.heads(index, attention_scale)),
            mlp_reads.register_forward_hook(receivers.mlp_input(index)),
            mlp_out.register_forward_hook(senders.mlp_output(index)),
        ]
        self._swap_projections(parts, index)

    def _swap_projections(self, parts: anatomy.Anatomy, index: int) -> None:
        after = {}  # a query/key norm over every head at once goes into the projection's stand-in
        if parts.family.qk_norm == "all":
            for which, slot in zip("qk", parts.qk_norm_slots(index)):
                after[which] = slot.get()
                self._swap(slot, nn.Identity())
        for which, rows in parts.input_projections():
            slot = parts.projection_slot(index, which)
            order = parts.qkv_slots() if which == "qkv" else None
            self._swap(slot, ReceiverProjection(slot.get(), self.state, index, rows, after.get(which), order))

    def _swap(self, slot: anatomy.Slot, stand_in: nn.Module) -> None:
        self.swapped.append((slot, slot.get()))
        slot.set(stand_in)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        for slot, original in reversed(self.swapped):
            slot.set(original)
        self.handles, self.swapped = [], []
        self.state.clear()


def _post_norm(parts: anatomy.Anatomy, norm: nn.Module, layer: int, device) -> anatomy.NormSpec:
    """A post-norm of a layer's attention output: an RMS norm, whose scale of the block's whole
    output each head's contribution takes (a centring norm would not split between heads)."""
    spec = parts.spec(norm, device)
    if spec.centred or spec.bias is not None:
        raise NotImplementedError(f"edge patching: layer {layer}'s attention output passes a centring norm "
                                  f"({type(norm).__name__}), which cannot be split between its heads")
    return spec
