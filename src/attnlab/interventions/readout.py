"""Compute of a forward only what its reader reads: the last positions and a few tokens' logits.

A task metric reads the logits of the last position (Greater-Than on digit tokenizers: the last
two), and a logit difference only a few tokens' logits (IOI: the indirect object and the
subject). ``intervened(model, readout=Readout(positions, tokens))``, with the model called with
``logits_to_keep=positions``, computes the logits of ``tokens`` alone (-inf for every other
token; None: all of them): the LM head is most of a forward on Gemma-3's 262,144-token
vocabulary, because transformers slices the last positions out of the hidden states and on that
strided view torch multiplies row by row, reading the whole output embedding once per row.

``fast`` goes further, for exact patching: the last decoder layer's MLP runs at the read
positions alone and the LM head's input is made contiguous. The values read are those of the
whole forward up to float rounding. Without it, the read logits come out of the same kernel as
the whole head's and equal them to the last bit (checked on both embedded models: the sweeps and
attribution give the numbers they gave before there was a readout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnlab import anatomy


@dataclass(frozen=True, eq=False)
class Readout:
    """The last ``positions`` positions and the logits of ``tokens`` (None: every token); ``fast``:
    the last MLP at those positions only and a contiguous LM head input (module docstring)."""

    positions: int
    tokens: torch.Tensor | None = None
    fast: bool = False

    def install(self, model) -> "_Restore":
        parts = anatomy.of(model)
        last = parts.mlp_slot(parts.n_layers - 1)
        head = parts.output_embeddings
        restore = _Restore(parts, last, last.get(), head)
        if self.fast:
            last.set(_LastPositionsMLP(restore.mlp, self.positions, parts.family.contiguous_inputs))
        if self.tokens is not None and type(head) is nn.Linear:
            parts.replace_output_embeddings(_SelectedLogits(head, self.tokens.to(head.weight.device), self.fast))
        elif self.fast:
            restore.hook = head.register_forward_pre_hook(contiguous_input)
        return restore


@dataclass
class _Restore:
    """Puts back what ``Readout.install`` replaced (a handle, like a hook's)."""

    parts: anatomy.Anatomy
    last: anatomy.Slot
    mlp: nn.Module
    head: nn.Module
    hook: object = None

    def remove(self) -> None:
        if self.hook is not None:
            self.hook.remove()
        self.parts.replace_output_embeddings(self.head)
        self.last.set(self.mlp)


class _LastPositionsMLP(nn.Module):
    """Stands in for the last layer's MLP: computed at the last ``keep`` positions only, zero
    elsewhere. Nothing follows the last layer but the final norm and the LM head, which reads the
    last positions only (logits_to_keep), so the other positions are never read."""

    def __init__(self, mlp: nn.Module, keep: int, contiguous: bool = False):
        super().__init__()
        self.mlp, self.keep, self.contiguous = mlp, keep, contiguous

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        last = hidden_states[:, -self.keep:]
        # a view of the last positions, as before for every family; GPT-2's Conv1D views its input,
        # which needs it contiguous (a copy: the same values)
        last = self.mlp(last.contiguous() if self.contiguous else last)
        if not torch.is_tensor(last):  # an MLP that returns more (router logits): run it whole
            return self.mlp(hidden_states)
        out = hidden_states.new_zeros(*hidden_states.shape[:-1], last.shape[-1])
        out[:, -self.keep:] = last
        return out


class _SelectedLogits(nn.Module):
    """Stands in for the LM head: the logits of ``tokens`` only, -inf for every other token;
    ``contiguous``: from a contiguous copy of its input, else from the view it is given."""

    def __init__(self, head: nn.Linear, tokens: torch.Tensor, contiguous: bool):
        super().__init__()
        self.out_features, self.tokens, self.contiguous = head.out_features, tokens, contiguous
        self.weight = head.weight[tokens]
        self.bias = None if head.bias is None else head.bias[tokens]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.contiguous:
            hidden_states = hidden_states.contiguous()
        selected = nn.functional.linear(hidden_states, self.weight, self.bias)
        out = selected.new_full((*selected.shape[:-1], self.out_features), float("-inf"))
        out[..., self.tokens] = selected
        return out


def contiguous_input(module, args):
    """A forward pre-hook: the module's input made contiguous (same values)."""
    return (args[0].contiguous(), *args[1:])
