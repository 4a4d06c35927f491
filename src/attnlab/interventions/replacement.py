"""Another run's activations in place of this run's, at chosen tokens, for whole model parts: an
MLP's output (after its post-norm where the family has one, as it joins the residual stream) or a
block's output (the residual stream after the layer). What ``intervened(model, replace=...)``
installs; heads are patched through ``patching.heads.HeadGates`` (their output projection's input).

With ``values`` None the parts record their outputs instead (``recorded``: one tensor per forward,
in order), for the run the values come from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attnlab import anatomy

KINDS = ("mlp", "residual")


@dataclass(eq=False)
class OutputReplacement:
    """Parts ``(kind, layer)`` whose outputs [rows, tokens, hidden] are replaced where ``where``
    [rows, tokens] is True by ``values[part]`` (same shape), or recorded into ``recorded``."""

    parts: list[tuple[str, int]]
    values: dict[tuple[str, int], torch.Tensor] | None = None
    where: torch.Tensor | None = None
    recorded: dict[tuple[str, int], list[torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self):
        unknown = [part for part in self.parts if part[0] not in KINDS]
        if unknown:
            raise ValueError(f"replacement parts {unknown}: kinds are {KINDS}")
        if self.values is not None and self.where is None:
            raise ValueError("replacing outputs (values=) needs the tokens where (where=)")

    def install(self, model) -> "_Handles":
        parts = anatomy.of(model)
        handles = []
        for kind, layer in self.parts:
            if not 0 <= layer < parts.n_layers:
                raise ValueError(f"layer {layer}: the model has {parts.n_layers} layers")
            module = parts.block(layer) if kind == "residual" else (parts.norm(layer, "mlp_out") or parts.mlp(layer))
            handles.append(module.register_forward_hook(self._hook((kind, layer))))
        return _Handles(handles)

    def _hook(self, part: tuple[str, int]):
        def hook(module, args, output):
            tensor = output[0] if isinstance(output, tuple) else output
            if self.values is None:
                self.recorded.setdefault(part, []).append(tensor.detach())
                return None
            where = self.where.to(tensor.device)[..., None]
            replaced = torch.where(where, self.values[part].to(tensor.device, tensor.dtype), tensor)
            return (replaced, *output[1:]) if isinstance(output, tuple) else replaced
        return hook


@dataclass
class _Handles:
    handles: list

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
