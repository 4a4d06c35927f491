"""One way into a model's forward pass: ``with intervened(model, ...)``.

Parts, in any combination (a block nested in another adds its parts to the outer ones):

- ``gates``: a ``sparse.GateTracker``: a sparse model's edge gates sampled for training (with
  the density penalty), or counted at inference;
- ``gate_bias``: a sparse model's gates at another bias than its own (calibration);
- ``reduce``: an ``attention.reduction.BatchReduction``: per-layer attention statistics (extraction);
- ``head_gates``: a ``patching.heads.HeadGates``: each head's slice gated at the input of the attention's
  output projection (o_proj; GPT-2's c_proj);
- ``arm``: ``mlp.ArmSettings``: ARM on one layer's MLP activation;
- ``activations``: an ``mlp.ActivationRecorder``: statistics of one layer's MLP activation;
- ``record``: a ``resume.LayerInputs``: every decoder layer's input and its output projection's input;
- ``resume``: a ``resume.ResumeAt``: the forward starts at one layer from recorded inputs;
- ``readout``: a ``readout.Readout``: only the positions and logits a metric reads are computed;
- ``edges``: an ``edges.EdgePatch``: each receiver (query, key, value, MLP input, logits) reads its
  own mix of the senders' clean and corrupted activations, or records them, or takes gradients;
- ``replace``: a ``replacement.OutputReplacement``: MLP or block outputs replaced at chosen tokens
  by another run's, or recorded (mediation).

The first three act inside the attention computation, through one function registered with
transformers' attention interface (``attention.function.attend``, re-exported here): per block of queries it takes the scores,
applies a sparse model's gates and reduces the weights. What it does comes from the model's
config (a sparse model always gates) and from one context variable, which ``intervened``
sets on entry and resets on exit. On GPUs it hands each layer to the fused Triton kernels
(``attnlab.attention.fused``), which compute the same quantities without a queries × keys tensor. The
other parts are forward hooks on the output projections, the decoder layers, the norms and the
MLP's activation, and stand-ins for modules (``resume``: the layers below the resumed one;
``readout``: the last MLP and the LM head; ``edges``: the q/k/v projections), installed on entry
and removed on exit, last in first out, exceptions included: nothing of a block outlives it.
Every part is found through the model's anatomy (``attnlab.anatomy``), which knows each
family's modules.
"""

from __future__ import annotations

import contextlib
import dataclasses

from attnlab import anatomy
from attnlab.attention import sparse
from attnlab.attention.reduction import BatchReduction
from attnlab.interventions import mlp
from attnlab.attention.function import (BLOCK_BYTES, IMPLEMENTATION, UNIMPLEMENTED_KWARGS, Inside, _inside, attend,
                                        current, recompute_context, refuse_unimplemented)
from attnlab.interventions.edges import EdgePatch
from attnlab.interventions.readout import Readout
from attnlab.interventions.replacement import OutputReplacement
from attnlab.interventions.resume import LayerInputs, ResumeAt

__all__ = ["BLOCK_BYTES", "IMPLEMENTATION", "UNIMPLEMENTED_KWARGS", "Inside", "attend", "current", "intervened",
           "recompute_context", "refuse_unimplemented"]


@contextlib.contextmanager
def intervened(model, *, gates: sparse.GateTracker | None = None,
               gate_bias: sparse.GateBias | None = None, reduce: BatchReduction | None = None,
               head_gates=None, arm=None, activations=None, record: LayerInputs | None = None,
               resume: ResumeAt | None = None, readout: Readout | None = None,
               edges: EdgePatch | None = None, replace: OutputReplacement | None = None):
    """Run ``model`` with the given parts (module docstring) inside the block; yield what the
    attention function sees."""
    inside = _merged(model, gates=gates, gate_bias=gate_bias, reduce=reduce)
    in_attention = any(part is not None for part in (gates, gate_bias, reduce))
    previous = model.config._attn_implementation
    handles = []
    token = _inside.set(inside)
    try:
        if in_attention and previous != IMPLEMENTATION:
            model.set_attn_implementation(IMPLEMENTATION)
        if head_gates is not None:
            parts = anatomy.of(model)
            handles += [parts.out_projection(index).register_forward_pre_hook(head_gates.hook(index))
                        for index in range(parts.n_layers)]
        if arm is not None or activations is not None:
            handles += mlp.hooks(model, arm, activations)
        if record is not None:
            handles += record.hooks(model)
        if resume is not None:
            handles.append(resume.install(model))
        if readout is not None:
            handles.append(readout.install(model))
        if edges is not None:
            handles.append(edges.install(model))
        if replace is not None:
            handles.append(replace.install(model))
        yield inside
    finally:
        for handle in reversed(handles):  # last in, first out: parts that replace the same module nest
            handle.remove()
        if model.config._attn_implementation != previous:
            model.set_attn_implementation(previous)
        _inside.reset(token)


def _merged(model, **given) -> Inside:
    """The enclosing block's parts with ``given`` on top, checked against the model."""
    given = {name: value for name, value in given.items() if value is not None}
    if ("gates" in given or "gate_bias" in given) and not sparse.is_sparse(model):
        raise ValueError("edge gates (gates=, gate_bias=) need a sparse model: see sparse.make_sparse")
    if "gate_bias" in given:
        given["gate_bias"] = sparse.checked_bias(model, given["gate_bias"])
    inside = dataclasses.replace(_inside.get(), **given)
    if inside.reduce is not None and inside.gates is not None and inside.gates.training:
        raise ValueError("training gates and the attention reduction do not mix: the reduction "
                         "splits a layer into blocks, the training draw is one per layer")
    return inside
