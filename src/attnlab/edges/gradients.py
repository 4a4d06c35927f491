"""The receivers' gradients: the metric's gradient with respect to each receiver's input, summed
over backward passes (edge attribution), and the closed-form gradient through an RMS pre-norm."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnlab.edges.points import at_least_float32, select_points


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


def rms_input_gradient(x: torch.Tensor, eps: float, weighted: torch.Tensor) -> torch.Tensor:
    """The vector-Jacobian product of y = x · rsqrt(mean(x²) + eps) · w at ``x`` [..., hidden]
    for a stack of output gradients g given as ``weighted`` = w ∘ g [n, ..., hidden] (the weight
    folded into whatever produced g), in float32 at least, as the norms compute:
    r · (w ∘ g) − x · r³ · mean(x ∘ w ∘ g), with r = rsqrt(mean(x²) + eps)."""
    dtype = at_least_float32(x)
    x, weighted = x.to(dtype), weighted.to(dtype)
    inverse = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    projection = torch.einsum("n...d,...d->n...", weighted, x)[..., None] / x.shape[-1]
    return (weighted * inverse).addcmul_(x * inverse.pow(3), projection, value=-1)
