"""A loaded model's parts, found through its family (``families``): the one place that names a
model's submodules. Hooks, stand-ins, gates and kernels ask an ``Anatomy`` for a block, a
projection, a norm or the MLP's activation; the answer costs nothing per forward (attribute
lookups when an intervention is installed, none inside the forward).

A part that an intervention replaces for a while is reached as a ``Slot`` (its parent and its
attribute), so the replacement and its undoing name nothing either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnlab.anatomy.families import STAGES, Family, family_of
from attnlab.anatomy.norms import NormSpec, norm_spec

@dataclass(frozen=True)
class Slot:
    """Where a part sits: ``getattr(parent, name)``; ``set`` replaces it (``get`` reads it back)."""

    parent: nn.Module
    name: str

    def get(self) -> nn.Module:
        return getattr(self.parent, self.name)

    def set(self, module: nn.Module) -> None:
        setattr(self.parent, self.name, module)


def of(model, stages=STAGES) -> "Anatomy":
    """The anatomy of ``model`` (a transformers causal LM, or a PEFT wrapper of one): a few
    attribute lookups, made where an intervention is installed, never inside a forward."""
    return Anatomy(model, stages)


class MissingPart(NotImplementedError):
    """A part the model's family places somewhere is not there (a modified or unusual model)."""


def _part(parent: nn.Module, name: str, family: Family, where: str) -> nn.Module:
    """``getattr(parent, name)``, or a ``MissingPart`` that says what was looked for and where."""
    part = getattr(parent, name, None)
    if part is None:
        raise MissingPart(f"{where} ({type(parent).__name__}) has no {name}, which the {family.name} family "
                          "places there (attnlab.anatomy.families): the model does not have its family's layout")
    return part


class Anatomy:
    """The parts of one model (module docstring)."""

    def __init__(self, model, stages=STAGES):
        config = model.config.get_text_config()
        self.family: Family = family_of(config.model_type, type(model).__name__, stages)
        self.model, self.config = model, config
        self.decoder = model.get_decoder()
        self.n_layers = config.num_hidden_layers
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.hidden = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.n_heads

    # ---- blocks ----
    @property
    def blocks(self) -> nn.ModuleList:
        return _part(self.decoder, self.family.blocks, self.family, "the decoder")

    def block(self, layer: int) -> nn.Module:
        return self.blocks[layer]

    def attention(self, layer: int) -> nn.Module:
        return _part(self.block(layer), self.family.attention, self.family, f"block {layer}")

    def attention_slot(self, layer: int) -> Slot:
        return Slot(self.block(layer), self.family.attention)

    # ---- projections ----
    def projection_slot(self, layer: int, which: str) -> Slot:
        """``which``: "q", "k", "v", "o", or "qkv" for a family that fuses them."""
        return Slot(self.attention(layer), self.family.projections[which])

    def projection(self, layer: int, which: str) -> nn.Module:
        slot = self.projection_slot(layer, which)
        return _part(slot.parent, slot.name, self.family, f"block {layer}'s attention")

    def out_projection(self, layer: int) -> nn.Module:
        """The attention's output projection (o_proj, c_proj): its input is the heads' outputs
        side by side [..., heads · head_dim]."""
        return self.projection(layer, "o")

    def input_projections(self) -> tuple[tuple[str, slice], ...]:
        """The projections of a block's attention that read the residual stream, each with the
        receivers it computes among the block's query heads, key heads and value heads (in that
        order): q, k and v apart, or one fused qkv."""
        h, g = self.n_heads, self.n_kv_heads
        if self.family.fused_qkv:
            return (("qkv", slice(0, h + 2 * g)),)
        return (("q", slice(0, h)), ("k", slice(h, h + g)), ("v", slice(h + g, h + 2 * g)))

    def qkv_slots(self) -> list[int]:
        """For a fused qkv: where each receiver of ``input_projections``' order (query heads, key
        heads, value heads) sits among the projection's head-sized row blocks (stacked: in that
        order; interleaved: query j at 3j, its key at 3j + 1, its value at 3j + 2)."""
        h, g = self.n_heads, self.n_kv_heads
        if self.family.qkv_layout == "stacked":
            return list(range(h + 2 * g))
        if h != g:
            raise NotImplementedError(f"an interleaved qkv with grouped-query heads ({h} query, {g} key/value)")
        return [3 * j for j in range(h)] + [3 * j + 1 for j in range(h)] + [3 * j + 2 for j in range(h)]

    @property
    def parallel(self) -> bool:
        """Whether the attention and the MLP of a block both read its input (families.py)."""
        field = self.family.parallel_field
        return field is not None and bool(getattr(self.config, field, False))

    def qk_norm_slots(self, layer: int) -> tuple[Slot, Slot] | None:
        """The attention's query and key norms (None where the family has none)."""
        if self.family.qk_norm is None:
            return None
        return tuple(Slot(self.attention(layer), name) for name in self.family.qk_norms)

    # ---- norms of the residual stream ----
    def norm(self, layer: int, place: str) -> nn.Module | None:
        """The norm at ``place`` ("attention_in", "attention_out", "mlp_in", "mlp_out") of a block,
        None where the family has none there."""
        name = self.family.norms[place]
        return None if name is None else _part(self.block(layer), name, self.family, f"block {layer}")

    @property
    def final_norm(self) -> nn.Module:
        return _part(self.decoder, self.family.final_norm, self.family, "the decoder")

    def spec(self, norm: nn.Module, device, width: int | None = None) -> NormSpec:
        """What ``norm`` (one of this model's norms: of the residual stream, or a query/key norm
        over ``width`` units) computes (``norms.NormSpec``)."""
        return norm_spec(norm, self.family.norm_kind, width or self.hidden, device)

    # ---- the MLP ----
    def mlp_slot(self, layer: int) -> Slot:
        return Slot(self.block(layer), self.family.mlp)

    def mlp(self, layer: int) -> nn.Module:
        return _part(self.block(layer), self.family.mlp, self.family, f"block {layer}")

    def mlp_activation(self, layer: int) -> nn.Module:
        """The activation module of a block's MLP: its input is the pre-activation (gate_proj(x),
        c_fc(x)), its output the activation ``a`` the MLP analysis and ARM read."""
        return _part(self.mlp(layer), self.family.mlp_parts["activation"], self.family, f"block {layer}'s MLP")

    # ---- ends ----
    @property
    def input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def output_embeddings(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def replace_output_embeddings(self, module: nn.Module) -> None:
        self.model.set_output_embeddings(module)

    # ---- training ----
    def dropout_settings(self) -> dict[str, float]:
        """The config's dropout fields (attention dropout first) and their values."""
        return {name: float(getattr(self.config, name, 0.0) or 0.0) for name in self.family.dropout}

    def module_names(self, parts: tuple[str, ...]) -> list[str]:
        """Names, relative to a block, of the modules ``parts`` ("q", "k", "v", "o", "qkv") name in
        this family (which ones exist differs: a fused family has qkv), e.g. for LoRA targets."""
        names = []
        for part in parts:
            if part in self.family.projections:
                names.append(f"{self.family.attention}.{self.family.projections[part]}")
        return names


def linear_weight(module: nn.Module) -> torch.Tensor:
    """A projection's weight as ``nn.Linear`` stores it, [out, in] (GPT-2's Conv1D stores [in, out]:
    its transpose, a view)."""
    if type(module).__name__ == "Conv1D":
        return module.weight.t()
    return module.weight


def heads_in(module: nn.Module, heads: int) -> torch.Tensor:
    """An input projection's weight per head, [heads, head_dim, in] (a view, no copy): head h's
    slice of q/k/v_proj (or of GPT-2's fused c_attn, whose q, k and v heads follow each other)."""
    if type(module).__name__ == "Conv1D":  # [in, out]
        return module.weight.view(module.weight.shape[0], heads, -1).permute(1, 2, 0)
    return module.weight.view(heads, -1, module.weight.shape[1])


def heads_out(module: nn.Module, heads: int) -> torch.Tensor:
    """The output projection's weight per head, [heads, head_dim, out] (a view, no copy): head
    h's output is z_h @ heads_out[h] (o_proj's columns of head h; GPT-2's c_proj rows)."""
    if type(module).__name__ == "Conv1D":  # [in = heads · head_dim, out]
        return module.weight.view(heads, -1, module.weight.shape[1])
    return module.weight.view(module.weight.shape[0], heads, -1).permute(1, 2, 0)


def out_features(module: nn.Module) -> int:
    return linear_weight(module).shape[0]


def in_features(module: nn.Module) -> int:
    return linear_weight(module).shape[1]
