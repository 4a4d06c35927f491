"""A forward pass resumed at a decoder layer from activations recorded on an earlier pass.

Exact head patching (``patching.heads.Patcher.exact``) runs the prompts once, recording every decoder
layer's input (the residual stream) and the input of its attention output projection (o_proj,
c_proj: the per-query-head outputs, concatenated) with ``LayerInputs``. Ablating one head of layer L
changes nothing below L, nor L's attention: so each layer's heads are then patched in one
batched pass that starts at L (``ResumeAt``). The layers below L return L's recorded input
instead of computing it, and L's attention returns o_proj applied to its recorded input, so
the hooks on o_proj (the head gates) still apply; positions before the first one the ablation
changes can be skipped too, their keys and values taken from the recorded forward's cache
(``prefix_cache``). The model's own forward runs around them
(embeddings, masks, rotary or learned positions, the layers above, the norm and the LM head), so
every family the anatomy knows (``attnlab.anatomy``: its blocks' attention ends in an output
projection, o_proj or GPT-2's c_proj) resumes unchanged. ``intervened(model, record=..., resume=...)`` installs both; a resumed pass
usually reads only a few logits (``readout``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import Cache

from attnlab import anatomy


@dataclass
class LayerInputs:
    """Each decoder layer's input and its o_proj's input, recorded on one forward (detached), and
    the model's cache of that forward's keys and values (``cache``: set by the caller, who runs
    the forward with ``use_cache=True``)."""

    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    attention: dict[int, torch.Tensor] = field(default_factory=dict)
    cache: Cache | None = None

    def hooks(self, model) -> list:
        parts, handles = anatomy.of(model), []
        for index in range(parts.n_layers):
            handles.append(parts.block(index).register_forward_pre_hook(self._record_hidden(index), with_kwargs=True))
            handles.append(parts.out_projection(index).register_forward_pre_hook(self._record_attention(index)))
        return handles

    def _record_hidden(self, index: int):
        def record(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.hidden[index] = hidden.detach()
        return record

    def _record_attention(self, index: int):
        def record(module, args):
            self.attention[index] = args[0].detach()
        return record


class _RecordedOutput(nn.Module):
    """Stands in for a decoder layer below the resumed one: returns the resumed layer's input."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if hidden_states.shape != self.hidden.shape:
            raise ValueError(f"resumed forward: the model runs {tuple(hidden_states.shape)} hidden states, "
                             f"the recorded layer input is {tuple(self.hidden.shape)}; pass the inputs "
                             "the recording was made from, repeated as the recorded tensors are")
        return self.hidden


class _RecordedAttention(nn.Module):
    """Stands in for the resumed layer's attention: o_proj of its recorded input."""

    def __init__(self, projection: nn.Module, attention: torch.Tensor):
        super().__init__()
        self.projection = projection  # the attention's output projection
        self.attention = attention

    def forward(self, *args, **kwargs):
        return self.projection(self.attention), None


@dataclass(eq=False)
class ResumeAt:
    """Resume the forward at decoder layer ``layer``: ``hidden`` is its input and ``attention``
    its o_proj's input ([rows, tokens, heads x head_dim]), both as ``LayerInputs`` recorded them
    (repeated along the rows for batched variants)."""

    layer: int
    hidden: torch.Tensor
    attention: torch.Tensor

    def install(self, model) -> "_Restore":
        parts = anatomy.of(model)
        layers = parts.blocks
        if not 0 <= self.layer < len(layers):
            raise ValueError(f"cannot resume at layer {self.layer}: the model has {len(layers)} layers")
        slot = parts.attention_slot(self.layer)
        restore = _Restore(layers, {index: layers[index] for index in range(self.layer)}, slot, slot.get())
        for index in range(self.layer):
            layers[index] = _RecordedOutput(self.hidden)
        slot.set(_RecordedAttention(parts.out_projection(self.layer), self.attention))
        return restore


@dataclass
class _Restore:
    """Puts back what ``ResumeAt.install`` replaced (a handle, like a hook's)."""

    blocks: nn.ModuleList
    below: dict[int, nn.Module]
    slot: anatomy.Slot
    attention: nn.Module

    def remove(self) -> None:
        for index, layer in self.below.items():
            self.blocks[index] = layer
        self.slot.set(self.attention)


def cached_positions(cache: Cache) -> int:
    """Positions every layer of ``cache`` holds from the first on (a sliding-window layer keeps
    only its window's last positions: none from the first, once the prompt is longer)."""
    return min(layer.keys.shape[-2] if layer.get_seq_length() == layer.keys.shape[-2] else 0
               for layer in cache.layers)


def prefix_cache(model, cache: Cache, start: int, copies: int) -> Cache | None:
    """A new cache holding the keys and values of positions [0, ``start``) of every layer of
    ``cache`` (a whole forward's), tiled ``copies`` times along the rows: a forward given it runs
    positions from ``start`` on as if the prefix had been computed again. None for ``start`` 0.
    ``start`` must not exceed ``cached_positions(cache)``."""
    if start > cached_positions(cache):
        raise ValueError(f"a resumed forward from position {start} needs the first {start} positions of "
                         f"every layer cached; {cached_positions(cache)} are (a sliding window shorter than the prompt)")
    if start == 0:
        return None
    prefix = DynamicCache(config=model.config)
    for index, layer in enumerate(cache.layers):
        prefix.update(layer.keys[:, :, :start].repeat(copies, 1, 1, 1),
                      layer.values[:, :, :start].repeat(copies, 1, 1, 1), index)
    return prefix
