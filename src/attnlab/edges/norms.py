"""The weight and eps of an RMS norm, read from the module itself (Gemma's norms store w − 1,
and eps is ``eps`` or ``variance_epsilon``): the patched pass folds a pre-norm's weight into the
q/k/v projections and splits a post-norm's scale between heads."""

from __future__ import annotations

import weakref

import torch
from torch import nn

# (w, eps) of each norm read so far, with the state of its parameters it was read from
_NORM_WEIGHTS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def norm_weight(norm: nn.Module, hidden: int, device) -> tuple[torch.Tensor, float]:
    """(w, eps) of an RMS norm y = x · rsqrt(mean(x²) + eps) · w, read from the module itself:
    its output on a row of ones is w · rsqrt(1 + eps). Read again only after its parameters
    change (every patched pass installs the patch anew)."""
    state = (str(device), hidden, tuple((p.data_ptr(), p._version) for p in norm.parameters()))
    cached = _NORM_WEIGHTS.get(norm)
    if cached is not None and cached[0] == state:
        return cached[1]
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
    _NORM_WEIGHTS[norm] = (state, (weight, eps))
    return weight, eps
