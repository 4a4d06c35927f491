"""A forward pass resumed at a decoder layer from activations recorded on an earlier pass.

Exact head patching (``pruning.Patcher.exact``) runs the prompts once, recording every decoder
layer's input (the residual stream) and the input of its attention output projection (o_proj:
the per-query-head outputs, concatenated) with ``LayerInputs``. Ablating one head of layer L
changes nothing below L, nor L's attention: so each layer's heads are then patched in one
batched pass that starts at L (``ResumeAt``). The layers below L return L's recorded input
instead of computing it, and L's attention returns o_proj applied to its recorded input, so
the hooks on o_proj (the head gates) still apply; positions before the first one the ablation
changes can be skipped too, their keys and values taken from the recorded forward's cache
(``prefix_cache``). The model's own forward runs around them
(embeddings, masks, rotary embeddings, the layers above, the norm and the LM head), so every
architecture whose decoder layers call ``self_attn`` and whose attention ends in ``o_proj``
resumes unchanged. ``intervened(model, record=..., resume=...)`` installs both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import Cache


def decoder_layers(model) -> nn.ModuleList:
    return model.get_decoder().layers


@dataclass
class LayerInputs:
    """Each decoder layer's input and its o_proj's input, recorded on one forward (detached), and
    the model's cache of that forward's keys and values (``cache``: set by the caller, who runs
    the forward with ``use_cache=True``)."""

    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    attention: dict[int, torch.Tensor] = field(default_factory=dict)
    cache: Cache | None = None

    def hooks(self, model) -> list:
        handles = []
        for index, layer in enumerate(decoder_layers(model)):
            handles.append(layer.register_forward_pre_hook(self._record_hidden(index), with_kwargs=True))
            handles.append(layer.self_attn.o_proj.register_forward_pre_hook(self._record_attention(index)))
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


class _LastPositionsMLP(nn.Module):
    """Stands in for the last layer's MLP: computed at the last ``keep`` positions only, zero
    elsewhere. Nothing follows the last layer but the final norm and the LM head, which reads the
    last positions only (logits_to_keep), so the other positions are never read."""

    def __init__(self, mlp: nn.Module, keep: int):
        super().__init__()
        self.mlp, self.keep = mlp, keep

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        last = self.mlp(hidden_states[:, -self.keep:])
        if not torch.is_tensor(last):  # an MLP that returns more (router logits): run it whole
            return self.mlp(hidden_states)
        out = hidden_states.new_zeros(*hidden_states.shape[:-1], last.shape[-1])
        out[:, -self.keep:] = last
        return out


class _RecordedAttention(nn.Module):
    """Stands in for the resumed layer's attention: o_proj of its recorded input."""

    def __init__(self, o_proj: nn.Module, attention: torch.Tensor):
        super().__init__()
        self.o_proj = o_proj
        self.attention = attention

    def forward(self, *args, **kwargs):
        return self.o_proj(self.attention), None


@dataclass(eq=False)
class ResumeAt:
    """Resume the forward at decoder layer ``layer``: ``hidden`` is its input and ``attention``
    its o_proj's input ([rows, tokens, heads x head_dim]), both as ``LayerInputs`` recorded them
    (repeated along the rows for batched variants). ``logits_to_keep``: the positions the caller
    reads, the last ones (the model must be called with the same ``logits_to_keep``); the last
    layer's MLP runs on those alone. ``tokens``: the only token ids whose logits the caller reads
    (None: all); the others come out as -inf."""

    layer: int
    hidden: torch.Tensor
    attention: torch.Tensor
    logits_to_keep: int
    tokens: torch.Tensor | None = None

    def install(self, model) -> "_Restore":
        layers = decoder_layers(model)
        if not 0 <= self.layer < len(layers):
            raise ValueError(f"cannot resume at layer {self.layer}: the model has {len(layers)} layers")
        restore = _Restore(layers, {index: layers[index] for index in range(self.layer)},
                           layers[self.layer], layers[self.layer].self_attn, layers[-1], layers[-1].mlp)
        for index in range(self.layer):
            layers[index] = _RecordedOutput(self.hidden)
        layers[self.layer].self_attn = _RecordedAttention(restore.attention.o_proj, self.attention)
        layers[-1].mlp = _LastPositionsMLP(restore.mlp, self.logits_to_keep)
        head = model.get_output_embeddings()
        if self.tokens is not None and type(head) is nn.Linear:
            restore.model, restore.head = model, head
            model.set_output_embeddings(_SelectedLogits(head, self.tokens.to(head.weight.device)))
        else:
            restore.head_hook = head.register_forward_pre_hook(contiguous_input)
        return restore


class _SelectedLogits(nn.Module):
    """Stands in for the LM head: the logits of ``tokens`` only, -inf for every other token. A
    logit difference reads a few tokens; the whole head is most of a resumed pass on a large
    vocabulary (Gemma-3: 262,144 tokens)."""

    def __init__(self, head: nn.Linear, tokens: torch.Tensor):
        super().__init__()
        self.out_features, self.tokens = head.out_features, tokens
        self.weight = head.weight[tokens]
        self.bias = None if head.bias is None else head.bias[tokens]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        selected = nn.functional.linear(hidden_states, self.weight, self.bias)
        out = selected.new_full((*selected.shape[:-1], self.out_features), float("-inf"))
        out[..., self.tokens] = selected
        return out


def contiguous_input(module, args):
    """The LM head's input made contiguous. transformers slices the last positions out of the
    hidden states (logits_to_keep), and on that strided [rows, 2, d] view torch multiplies row by
    row (bmm), reading the whole output embedding once per row: for 144 rows of SmolLM2 this was
    most of a resumed pass. The values are those of the sliced view."""
    return (args[0].contiguous(), *args[1:])


@dataclass
class _Restore:
    """Puts back what ``ResumeAt.install`` replaced (a handle, like a hook's)."""

    layers: nn.ModuleList
    below: dict[int, nn.Module]
    resumed: nn.Module
    attention: nn.Module
    last: nn.Module
    mlp: nn.Module
    head_hook: object = None
    model: nn.Module | None = None  # with head: the LM head replaced by _SelectedLogits
    head: nn.Module | None = None

    def remove(self) -> None:
        if self.head_hook is not None:
            self.head_hook.remove()
        if self.model is not None:
            self.model.set_output_embeddings(self.head)
        for index, layer in self.below.items():
            self.layers[index] = layer
        self.resumed.self_attn = self.attention
        self.last.mlp = self.mlp


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
