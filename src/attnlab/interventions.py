"""One way into a model's forward pass: ``with intervened(model, ...)``.

Parts, in any combination (a block nested in another adds its parts to the outer ones):

- ``gates``: a ``sparse.GateTracker``: a sparse model's edge gates sampled for training (with
  the density penalty), or counted at inference;
- ``gate_bias``: a sparse model's gates at another bias than its own (calibration);
- ``reduce``: an ``attention.BatchReduction``: per-layer attention statistics (extraction);
- ``head_gates``: a ``pruning.HeadGates``: each head's slice gated at the input of the attention's
  output projection (o_proj; GPT-2's c_proj);
- ``arm``: ``mlp.ArmSettings``: ARM on one layer's MLP activation;
- ``activations``: an ``mlp.ActivationRecorder``: statistics of one layer's MLP activation;
- ``record``: a ``resume.LayerInputs``: every decoder layer's input and its output projection's input;
- ``resume``: a ``resume.ResumeAt``: the forward starts at one layer from recorded inputs;
- ``readout``: a ``readout.Readout``: only the positions and logits a metric reads are computed;
- ``edges``: an ``edges.EdgePatch``: each receiver (query, key, value, MLP input, logits) reads its
  own mix of the senders' clean and corrupted activations, or records them, or takes gradients.

The first three act inside the attention computation, through one function registered with
transformers' attention interface (``attend``): per block of queries it takes the scores,
applies a sparse model's gates and reduces the weights. What it does comes from the model's
config (a sparse model always gates) and from one context variable, which ``intervened``
sets on entry and resets on exit. On GPUs it hands each layer to the fused Triton kernels
(``attnlab.fused``), which compute the same quantities without a queries × keys tensor. The
other parts are forward hooks on the output projections, the decoder layers, the norms and the
MLP's activation, and stand-ins for modules (``resume``: the layers below the resumed one;
``readout``: the last MLP and the LM head; ``edges``: the q/k/v projections), installed on entry
and removed on exit, last in first out, exceptions included: nothing of a block outlives it.
Every part is found through the model's anatomy (``attnlab.anatomy``), which knows each
family's modules.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import repeat_kv

from attnlab import anatomy, fused, mlp, sparse
from attnlab.attention import BatchReduction, LayerStats
from attnlab.edges import EdgePatch
from attnlab.readout import Readout
from attnlab.resume import LayerInputs, ResumeAt

IMPLEMENTATION = sparse.IMPLEMENTATION  # the name this module registers its attention function under


@dataclasses.dataclass(frozen=True, eq=False)
class Inside:
    """What the attention function does besides attending, for the block under way."""

    gates: sparse.GateTracker | None = None
    gate_bias: sparse.GateBias | None = None
    reduce: BatchReduction | None = None

    def bias(self, module: nn.Module) -> float | None:
        """The gate bias of this module's layer: the block's, else the model's own (None: dense)."""
        if self.gate_bias is not None:
            return sparse.layer_bias(self.gate_bias, module.layer_idx)
        return sparse.gate_bias(module)


_inside: contextvars.ContextVar[Inside] = contextvars.ContextVar("attnlab_intervention", default=Inside())


def current() -> Inside:
    return _inside.get()


@contextlib.contextmanager
def intervened(model, *, gates: sparse.GateTracker | None = None,
               gate_bias: sparse.GateBias | None = None, reduce: BatchReduction | None = None,
               head_gates=None, arm=None, activations=None, record: LayerInputs | None = None,
               resume: ResumeAt | None = None, readout: Readout | None = None,
               edges: EdgePatch | None = None):
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


def recompute_context():
    """``context_fn`` for activation checkpointing (torch.utils.checkpoint, non-reentrant): the
    recomputation of a layer in the backward pass, which runs on an autograd worker thread on
    GPUs where the caller's context variables are not visible, sees its forward pass's parts."""
    forward = _inside.get()

    @contextlib.contextmanager
    def as_in_forward():
        token = _inside.set(forward)
        try:
            yield
        finally:
            _inside.reset(token)

    return contextlib.nullcontext(), as_in_forward()


# Attention arguments that change the result and that this function does not implement:
# attention sinks (gpt-oss: s_aux, sinks) and additive position biases. A call that sets one fails.
UNIMPLEMENTED_KWARGS = ("s_aux", "sinks", "position_bias")


def refuse_unimplemented(dropout: float, kwargs: dict) -> None:
    """Fail, naming the argument, rather than compute attention the model does not use."""
    given = [name for name in UNIMPLEMENTED_KWARGS if kwargs.get(name) is not None]
    if given:
        raise NotImplementedError(
            f"{IMPLEMENTATION} attention does not implement {given} (attention sinks or position "
            "biases), which this model uses; its attention cannot be reduced or gated here")
    if dropout:
        raise NotImplementedError(f"{IMPLEMENTATION} attention does not implement attention dropout "
                                  f"({dropout}); set the model config's attention dropout field to 0 "
                                  "(attention_dropout; GPT-2: attn_pdrop), or call model.eval()")


def attend(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
           softcap: float | None = None, **kwargs):
    """Eager attention (grouped-query heads repeated as eager does), with a sparse model's edge
    gates (``sparse``) and, inside ``intervened(reduce=...)``, the reduction (``attention``).

    Without a reduction, one block: every query at once, with or without a KV cache. With one,
    query rows [q0, q1) only see keys [0, q1) (causal), so each block skips the masked upper
    triangle and stays small enough to remain in cache while it is softmaxed, multiplied with
    the values and reduced; the result equals the one-block computation.
    """
    inside = _inside.get()
    refuse_unimplemented(dropout, kwargs)
    bias = inside.bias(module)
    if inside.reduce is not None:
        _check_reducible(query, key, attention_mask)
    elif bias is None:
        raise RuntimeError(f"{IMPLEMENTATION} attention on a dense model outside intervened(reduce=...): "
                           "load sparse models with attnlab.models.load_model")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    output = fused.attend(module, query, key, value, attention_mask, scaling, softcap, bias, inside.gates,
                          inside.reduce, kwargs.get("sliding_window"))
    if output is not None:  # the kernels took the layer (on GPUs: attnlab.fused)
        return output, None
    groups = query.shape[1] // key.shape[1]  # grouped-query attention: query heads per key/value head
    key = repeat_kv(key, groups)
    value = repeat_kv(value, groups)
    batch, heads, length, _ = query.shape
    stats = None
    if inside.reduce is not None:
        stats = LayerStats(inside.reduce, module.layer_idx, batch, heads, length, query.device,
                           gated=bias is not None)
    block = _Block(module.layer_idx, scaling, softcap, bias, inside.gates, key.shape[-2] - length)
    rows = _rows_per_block(query, key.shape[-2]) if stats is not None else length
    if rows >= length:
        output, weights = block(query, key, value, attention_mask, 0, length, stats)
    else:
        output, weights = torch.empty_like(query), None
        for q0 in range(0, length, rows):
            q1 = min(q0 + rows, length)
            output[:, :, q0:q1], _ = block(query, key, value, attention_mask, q0, q1, stats)
    if stats is not None:
        stats.finish()
    return output.transpose(1, 2).contiguous(), weights


def _check_reducible(query, key, attention_mask) -> None:
    if query.shape[-2] != key.shape[-2]:
        raise RuntimeError(f"the attention reduction needs the whole sequence at once (queries "
                           f"{query.shape[-2]}, keys {key.shape[-2]}): call the model with use_cache=False")
    if attention_mask is None:
        # The blocks take causality (and any sliding window) from the mask alone.
        raise RuntimeError("the attention reduction needs the model's attention mask (causal, sliding "
                           "window, padding); the model passed none")


# Score block size: small enough to stay in cache on CPUs; on GPUs large, so that a long
# prompt is a few big launches rather than many tiny ones.
BLOCK_BYTES = {"cpu": 4 * 2**20, "cuda": 256 * 2**20}


def _rows_per_block(query: torch.Tensor, keys: int) -> int:
    block_bytes = BLOCK_BYTES.get(query.device.type, BLOCK_BYTES["cpu"])
    batch, heads = query.shape[:2]
    return max(16, block_bytes // (4 * batch * heads * keys))


@dataclasses.dataclass
class _Block:
    """Attention of query rows [q0, q1) of one layer; ``offset``: the cached keys before the queries."""

    layer: int
    scaling: float
    softcap: float | None
    bias: float | None
    tracker: sparse.GateTracker | None
    offset: int

    def __call__(self, query, key, value, attention_mask, q0: int, q1: int, stats: LayerStats | None):
        keys = self.offset + q1  # later keys are causally masked for every query of the block
        logits = torch.matmul(query[:, :, q0:q1], key[:, :, :keys].transpose(2, 3)) * self.scaling
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        mask = None if attention_mask is None else attention_mask[:, :, q0:q1, :keys]
        allowed = None  # [batch or 1, 1, q, k] bool, computed only where it is needed
        if mask is None or self.tracker is not None:
            allowed = sparse.allowed_edges(mask, q1 - q0, keys, query.device)
        if mask is None:  # no mask given: causal
            scores = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
        else:
            scores = logits + mask
        # float32 at least (as eager attention), float64 kept: a float64 mask's minimum becomes
        # -inf in float32, a fully masked (padding) row NaN, and 0 · NaN reaches real tokens
        weights = nn.functional.softmax(scores, dim=-1, dtype=torch.promote_types(query.dtype, torch.float32))
        weights = weights.to(query.dtype)
        if self.bias is not None:
            weights = weights * self._gate(logits, allowed)
        if stats is not None:
            stats.add_block(weights, q0, q1)
        return torch.matmul(weights, value[:, :, :keys]), weights

    def _gate(self, logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        tracker = self.tracker
        if tracker is not None and tracker.training:
            return sparse.training_gate(tracker, self.layer, logits, self.bias, allowed)
        gate = sparse.deterministic_gate(logits, self.bias)
        if tracker is not None:
            sparse.count_open_edges(tracker, self.layer, gate, allowed)
        return gate


AttentionInterface.register(IMPLEMENTATION, attend)
AttentionMaskInterface.register(IMPLEMENTATION, eager_mask)
