"""The receivers' gradients: the metric's gradient with respect to each receiver's input, summed
over backward passes (edge attribution). The closed-form gradient through a pre-norm is the norm's
own (``anatomy.NormSpec.input_gradient``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnlab.interventions.edges.points import at_least_float32, select_points


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
        return select_points(x, self.points)

    def add(self, first: int, count: int, within: slice, gradient: torch.Tensor) -> None:
        """Add ``gradient`` [receivers, points, hidden] (``at_points``) to receivers ``within``
        the group of ``count`` receivers starting at ``first``."""
        store = self.groups.get(first)
        if store is None:
            dtype = at_least_float32(gradient)
            store = self.groups[first] = gradient.new_zeros(count, *gradient.shape[1:], dtype=dtype)
        if store.shape[1:] != gradient.shape[1:]:
            raise ValueError(f"the receiver gradients were summed over inputs {tuple(store.shape[1:])}, this pass "
                             f"runs {tuple(gradient.shape[1:])}: use one ReceiverGradients per batch of prompts")
        store[within] += gradient

    def gradient(self, first: int) -> torch.Tensor:
        return self.groups[first]
