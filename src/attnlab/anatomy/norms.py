"""What a norm of the residual stream computes, read from the module (``NormSpec``), and the two
things edge patching needs of it: the norm applied to a receiver's own input with its weight
folded into the projection that follows (``NormSpec.normalise``), and its vector-Jacobian product
(``NormSpec.input_gradient``).

Every family's norms are one of ``families.NORM_KINDS``: y = (x − c) · r · w + b, with
c = mean(x) for LayerNorms and 0 for RMS norms, r = rsqrt(mean((x − c)²) + eps), w and b per
unit (w = 1 and b = 0 where the module has none; b = 0 for RMS norms). The spec is read from
the module's parameters as its family stores them, then checked against the module's own output
on a random probe, so a norm read wrongly is refused rather than used.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

# (spec, the state of the parameters it was read from) of each norm read so far
_SPECS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def at_least_float32(x: torch.Tensor) -> torch.dtype:
    """The dtype the norms compute in: float32, or the input's if wider."""
    return torch.promote_types(x.dtype, torch.float32)


@dataclass(frozen=True, eq=False)
class NormSpec:
    """y = (x − c) · r · w + b (module docstring); ``centred``: c = mean(x), else c = 0."""

    weight: torch.Tensor  # [hidden], float32
    bias: torch.Tensor | None  # [hidden] float32, or None
    eps: float
    centred: bool

    def normalise(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x − c, r) of ``x`` [..., hidden]: the norm is (x − c) · r · w + b. r is float32 at least;
        x − c is in x's dtype for an RMS norm (x itself, no copy), float32 at least for a
        LayerNorm. r comes from one vector norm (no x² tensor: the mixed receivers' inputs are
        large, and a patched pass normalises them at every layer)."""
        dtype = at_least_float32(x)
        if self.centred:
            x = x.to(dtype) - x.mean(-1, keepdim=True, dtype=dtype)
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=dtype)
        return x, torch.rsqrt(norm.pow(2) / x.shape[-1] + self.eps)

    def input_gradient(self, x: torch.Tensor, weighted: torch.Tensor) -> torch.Tensor:
        """The vector-Jacobian product of the norm at ``x`` [..., hidden] for a stack of output
        gradients g given as ``weighted`` = w ∘ g [n, ..., hidden] (the weight folded into whatever
        produced g), in float32 at least: with x̂ = (x − c) · r,
        r · (w∘g − mean(w∘g) [centred only] − x̂ · mean(x̂ ∘ w∘g))."""
        dtype = at_least_float32(x)
        centred, inverse = self.normalise(x)
        centred, weighted = centred.to(dtype), weighted.to(dtype)
        normalised = centred * inverse
        projection = torch.einsum("n...d,...d->n...", weighted, normalised)[..., None] / x.shape[-1]
        out = weighted - weighted.mean(-1, keepdim=True) if self.centred else weighted.clone()
        return out.sub_(normalised * projection).mul_(inverse)


def _read(norm: nn.Module, kind: str, hidden: int, device) -> NormSpec:
    """The spec of a ``kind`` norm from its parameters, as the family stores them."""
    ones = torch.ones(hidden, device=device, dtype=torch.float32)
    if kind in ("rms", "rms_one_plus"):
        eps = getattr(norm, "eps", None)
        eps = getattr(norm, "variance_epsilon", None) if eps is None else eps
        weight = norm.weight.detach().float() + (1.0 if kind == "rms_one_plus" else 0.0)
        return NormSpec(weight.to(device), None, float(eps), centred=False)
    if kind == "layer":
        bias = None if norm.bias is None else norm.bias.detach().float().to(device)
        weight = ones if norm.weight is None else norm.weight.detach().float().to(device)
        return NormSpec(weight, bias, float(norm.eps), centred=True)
    if kind == "layer_no_params":  # OLMo-1's LayerNorm: F.layer_norm(x, eps=1e-5), nothing stored
        return NormSpec(ones, None, float(getattr(norm, "eps", 1e-5)), centred=True)
    raise NotImplementedError(f"norm kind {kind!r}")


def norm_spec(norm: nn.Module, kind: str, hidden: int, device) -> NormSpec:
    """The ``NormSpec`` of ``norm`` (a ``kind`` norm, ``families.NORM_KINDS``), checked against its
    own output; read again only after its parameters change."""
    state = (kind, str(device), hidden, tuple((p.data_ptr(), p._version) for p in norm.parameters()))
    cached = _SPECS.get(norm)
    if cached is not None and cached[0] == state:
        return cached[1]
    with torch.no_grad():
        try:
            spec = _read(norm, kind, hidden, device)
        except (AttributeError, TypeError) as error:  # a parameter or eps the kind stores is not there
            raise NotImplementedError(f"{type(norm).__name__} is not a '{kind}' norm as its family says "
                                      f"({error}): fix its Family in attnlab.anatomy") from None
        probe = torch.randn(3, hidden, device=device, generator=torch.Generator(device).manual_seed(0)) * 3 + 1
        centred, inverse = spec.normalise(probe)
        expected = centred * inverse * spec.weight + (0 if spec.bias is None else spec.bias)
        dtype = next(norm.parameters(), probe).dtype  # a LayerNorm refuses an input of another dtype
        if not torch.allclose(norm(probe.to(dtype)).float(), expected, rtol=1e-4, atol=1e-5):
            raise NotImplementedError(f"{type(norm).__name__} does not compute what its family's norm kind "
                                      f"'{kind}' says ({expected.shape[-1]} units): edge patching cannot "
                                      "apply it to a receiver's own input. Fix its Family in attnlab.anatomy")
    _SPECS[norm] = (state, spec)
    return spec
