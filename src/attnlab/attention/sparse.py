"""Edge-gated ("sparse") attention, registered through transformers' attention interface.

Per layer and head, with causal logits ``s_ij = q_i·k_j·scaling`` (after any
soft-capping, before masks), every edge (i, j) has a gate on ``s_ij + b``
(arXiv 2512.05865; docs/sparsify.md):

- training: ``e_ij ~ Bernoulli(σ(s_ij + b))``, drawn as ``1[s_ij + b + logistic noise > 0]``,
  with the straight-through estimator ``e + σ − stopgrad(σ)`` (σ of the noisy logit as an option);
- inference: ``e_ij = 1[s_ij + b > 0]``;
- output ``y_i = Σ_j softmax(s)_ij · e_ij · v_j``: the softmax runs over every
  causal key and is *not* renormalised after gating.

The penalty is the expected density, the mean of ``σ(s_ij + b)`` over causal
edges, heads and layers. A model is sparse when its config carries
``attnlab_sparse: {gate_bias: b}`` (a list of one b per layer after a per-layer
calibration, sparsify.calibrate); ``activate`` (called by the project's loader)
then selects the attention function of ``attnlab.interventions`` for every forward
pass: generation, the MLP analysis, pruning, extraction. That function applies the
gates defined here; the same computation reduces the weights for extraction, so
received attention and λ of a sparse model come from its gated weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from attnlab import anatomy

CONFIG_KEY = "attnlab_sparse"  # in config.json: {"gate_bias": b, "base": ..., ...}
IMPLEMENTATION = "attnlab"  # the attention implementation that gates (registered by attnlab.interventions)
# The attention a saved sparse copy's config.json names. Plain transformers cannot run it and
# refuses it by echoing its name ('Specified attn_implementation="..." is not supported': read
# in 4.57, 5.17 and 5.23), so the name itself tells whoever opens the folder the two ways that work.
# attnlab's loaders read it as IMPLEMENTATION (``opened_as_gated``). No "/" (transformers would
# fetch it as a hub kernel) and none of the words it matches (flash, sdpa, flex, paged, eager).
SAVED_IMPLEMENTATION = (
    "attnlab gated attention, which plain transformers cannot run. Open this sparse copy with "
    "attnlab.models.load_model(folder, device, dtype), or with AutoModelForCausalLM.from_pretrained(folder, "
    "trust_remote_code=True) where attnlab is installed; its README.md says more")


GateBias = float | list[float]  # one bias for every layer, or one per layer (calibrated per layer)


def gate_bias(module: nn.Module) -> float | None:
    """The gate bias of a sparse model's attention module (its layer's), None for a dense model."""
    config = getattr(module, "config", None)
    settings = getattr(config, CONFIG_KEY, None)
    if not settings:
        return None
    return layer_bias(settings["gate_bias"], module.layer_idx)


def layer_bias(bias: GateBias, layer: int) -> float:
    """One layer's value of a global or per-layer gate bias."""
    return float(bias[layer] if isinstance(bias, list) else bias)


def deterministic_gate(logits: torch.Tensor, bias: float) -> torch.Tensor:
    """Inference gate: an edge is open exactly when ``s + b > 0``."""
    return (logits.float() + bias > 0).to(logits.dtype)


GATE_GRADIENTS = ("expected", "noisy")


def stochastic_gate(logits: torch.Tensor, bias: float, generator: torch.Generator | None,
                    gradient: str = "expected") -> tuple[torch.Tensor, torch.Tensor]:
    """(straight-through gate, σ(s + b)): a Bernoulli(σ(s + b)) sample, exactly 0/1 forward.

    Its gradient is that of σ(s + b) (``expected``, docs/sparsify.md) or of σ(s + b + noise), the
    sample's own logistic noise (``noisy``, as in a co-author's public kernel): the latter
    reaches edges far from the threshold more strongly.
    """
    if gradient not in GATE_GRADIENTS:
        raise ValueError(f"gate gradient must be one of {GATE_GRADIENTS}, not {gradient!r}")
    # float32 whatever the autocast: in bfloat16, 1 - 1e-6 rounds to 1 (infinite noise)
    # and the density penalty's mean loses digits.
    gate_logits = logits.float() + bias
    expected = torch.sigmoid(gate_logits)
    uniform = torch.rand(gate_logits.shape, generator=generator, device=logits.device,
                         dtype=torch.float32).clamp_(1e-6, 1 - 1e-6)
    noise = torch.log(uniform) - torch.log1p(-uniform)  # logistic: P(x + noise > 0) = σ(x)
    hard = (gate_logits + noise > 0).float()
    surrogate = expected if gradient == "expected" else torch.sigmoid(gate_logits + noise)
    return (hard + (surrogate - surrogate.detach())).to(logits.dtype), expected


@dataclass
class GateTracker:
    """What the gated attention records inside ``interventions.intervened(model, gates=tracker)``.

    ``training``: sample gates and collect the expected-density penalty.
    Otherwise the deterministic gate is used and, per layer, open and allowed
    edges are counted per head (density at inference).
    """

    training: bool = False
    generator: torch.Generator | None = None
    gradient: str = "expected"  # the straight-through surrogate (stochastic_gate)
    # Where the fused kernels' seeds are drawn (None: ``generator``): a host generator, as a draw
    # from a CUDA one waits for the queued work
    seed_generator: torch.Generator | None = None
    # Generator state before each layer's draw: a recomputation of the layer (gradient
    # checkpointing, in the backward pass) replays exactly the gates of the forward pass.
    noise_states: dict[int, torch.Tensor] = field(default_factory=dict)
    # The fused kernels draw from counters, not from state: one seed per layer, derived from one
    # draw of the generator per tracker (so a replayed layer draws the same gates).
    seeds: dict[int, int] = field(default_factory=dict)
    base_seed: int | None = None
    expected_sum: list[torch.Tensor] = field(default_factory=list)  # per layer call, scalar
    # Counts: tensors on the device from both paths (0.0 before the first layer), read once a
    # step, not once a layer, so that the GPU never waits on the host mid-forward).
    sampled_open: float | torch.Tensor = 0.0
    edges: float | torch.Tensor = 0.0
    open_per_head: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [heads]
    edges_per_head: dict[int, torch.Tensor] = field(default_factory=dict)
    # A diagnostic of the eager path at inference: per layer and head, the allowed edges whose gate
    # logit s + b lies within this distance of 0 (the edges float rounding could flip), the open
    # ones (0 < s + b < d: rounding could close them) apart from the closed ones (-d < s + b <= 0:
    # rounding could open them); None: not counted
    near_threshold: float | None = None
    near_open_per_head: dict[int, torch.Tensor] = field(default_factory=dict)
    near_closed_per_head: dict[int, torch.Tensor] = field(default_factory=dict)

    def expected_density(self) -> torch.Tensor:
        """Mean of σ(s + b) over causal edges, heads and layers of the last forward(s)."""
        return torch.stack(self.expected_sum).sum() / self.edges  # a tensor division: no read of the count

    def training_density(self) -> float:
        return float(self.sampled_open) / float(self.edges)

    def layer_seed(self, layer: int) -> tuple[int, bool]:
        """(Philox seed of ``layer``'s gate noise, whether this call recomputes the layer)."""
        if layer in self.seeds:
            return self.seeds[layer], True
        if self.generator is None:
            raise RuntimeError("a training GateTracker needs a torch.Generator for the gate noise")
        if self.base_seed is None:
            source = self.seed_generator or self.generator
            self.base_seed = int(torch.randint(0, 2 ** 31 - 1, (), generator=source, device=source.device))
        self.seeds[layer] = (self.base_seed + 1_000_003 * (layer + 1)) % (2 ** 31 - 1)
        return self.seeds[layer], False

    def inference_density(self) -> float:
        """Share of allowed edges open under the deterministic gate, over every layer and head."""
        opened, allowed = self.density_counts()
        return sum(float(v.sum()) for v in opened.values()) / sum(float(v.sum()) for v in allowed.values())

    def density_counts(self) -> tuple[dict, dict]:
        """(open, allowed) edges per layer and head, on the host."""
        return ({layer: v.cpu() for layer, v in self.open_per_head.items()},
                {layer: v.cpu() for layer, v in self.edges_per_head.items()})

    def density_per_head(self) -> dict[int, torch.Tensor]:
        """Share of allowed edges open per head, on the host (the fused path counts on the device
        and this is where the counts are read: the eager and fused paths then compare as they are)."""
        return {layer: (self.open_per_head[layer] / self.edges_per_head[layer]).cpu()
                for layer in sorted(self.open_per_head)}


def allowed_edges(attention_mask: torch.Tensor | None, queries: int, keys: int,
                  device) -> torch.Tensor:
    """[batch or 1, 1, q, k] bool: the edges the model's mask lets through (causal, window, padding)."""
    if attention_mask is not None:
        return attention_mask[..., :keys] == 0
    offset = keys - queries  # with a KV cache the queries are the last positions
    rows = torch.arange(queries, device=device)[:, None] + offset
    return (torch.arange(keys, device=device)[None, :] <= rows)[None, None]


def training_gate(tracker: GateTracker, layer: int, logits: torch.Tensor, bias: float,
                   allowed: torch.Tensor) -> torch.Tensor:
    """Sampled gates; the first pass of a layer records the penalty, a recomputation of the
    layer (gradient checkpointing) replays the same draw and the same graph without recording."""
    generator = tracker.generator
    if generator is None:
        raise RuntimeError("a training GateTracker needs a torch.Generator for the gate noise")
    recomputing = layer in tracker.noise_states
    if recomputing:
        current = generator.get_state()
        generator.set_state(tracker.noise_states[layer])
    else:
        tracker.noise_states[layer] = generator.get_state()
    gate, expected = stochastic_gate(logits, bias, generator, tracker.gradient)
    allowed = allowed.expand_as(gate)
    expected_sum = (expected * allowed).sum()
    if recomputing:
        generator.set_state(current)
    else:
        tracker.expected_sum.append(expected_sum)
        # counted as integers, as at inference, and left on the device until read (a GPU would
        # otherwise wait for every layer)
        tracker.sampled_open = tracker.sampled_open + ((gate.detach() > 0) & allowed).sum()
        tracker.edges = tracker.edges + allowed.sum()
    return gate


def count_open_edges(tracker: GateTracker, layer: int, gate: torch.Tensor, allowed: torch.Tensor,
                     gate_logits: torch.Tensor | None = None) -> None:
    """Add one call's open and allowed edge counts per head of ``layer`` (and, where the tracker
    asks and ``gate_logits`` s + b are given, the allowed edges near the threshold)."""
    allowed = allowed.expand_as(gate)
    if tracker.near_threshold is not None and gate_logits is not None:
        near = (gate_logits.abs() < tracker.near_threshold) & allowed
        for counts, side in ((tracker.near_open_per_head, gate_logits > 0), (tracker.near_closed_per_head, gate_logits <= 0)):
            counts[layer] = counts.get(layer, 0) + (near & side).sum(dim=(0, 2, 3))
    # Counted as integers (a bfloat16 sum, a bf16 model on CUDA, is exact only up to 256), and left
    # on the device until read (``density_per_head``): a copy per layer would stall a GPU.
    open_edges = ((gate > 0) & allowed).sum(dim=(0, 2, 3)).double()
    add_open_edges(tracker, layer, open_edges, allowed.sum(dim=(0, 2, 3)).double())


def add_open_edges(tracker: GateTracker, layer: int, open_edges: torch.Tensor, edges: torch.Tensor) -> None:
    """Add open and allowed edge counts per head ([heads], float64) of one call of ``layer``."""
    if layer in tracker.open_per_head:
        tracker.open_per_head[layer] += open_edges
        tracker.edges_per_head[layer] += edges
    else:
        tracker.open_per_head[layer], tracker.edges_per_head[layer] = open_edges, edges


def is_sparse(model) -> bool:
    return bool(getattr(model.config.get_text_config(), CONFIG_KEY, None))


def opened_as_gated(config) -> None:
    """A saved copy's config (its attention ``SAVED_IMPLEMENTATION``) set to run the registered
    gated attention, in place; any other config is left as it is."""
    if getattr(config, "_attn_implementation", None) == SAVED_IMPLEMENTATION:
        config._attn_implementation = IMPLEMENTATION  # transformers' setter passes it to sub-configs


def make_sparse(model, gate_bias: GateBias, **provenance) -> None:
    """Mark ``model`` as sparse (its config carries the gate bias) and select the gated attention;
    a model of a family the anatomy does not know is refused."""
    anatomy.of(model, stages=("sparse post-training",))
    settings = {"gate_bias": checked_bias(model, gate_bias), "implementation": IMPLEMENTATION, **provenance}
    for config in _configs(model):
        setattr(config, CONFIG_KEY, settings)
    _select_gated_attention(model)


def _select_gated_attention(model) -> None:
    """Switch ``model`` to the gated attention, which ``attnlab.attention.function`` registers on
    import (it sits above this module: imports point down, so this one cannot import it; every
    loader, ``models.load_model``, and ``attnlab.interventions`` import it)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if IMPLEMENTATION not in ALL_ATTENTION_FUNCTIONS:
        raise RuntimeError(f"the gated attention '{IMPLEMENTATION}' is not registered: load models with "
                           "attnlab.models.load_model, or import attnlab.attention.function first")
    model.set_attn_implementation(IMPLEMENTATION)


def set_gate_bias(model, gate_bias: GateBias) -> None:
    """Change the gate bias of a sparse model in place (its gated attention reads it per call)."""
    if not is_sparse(model):
        raise ValueError("set_gate_bias needs a sparse model (see make_sparse)")
    bias = checked_bias(model, gate_bias)
    for config in _configs(model):
        getattr(config, CONFIG_KEY)["gate_bias"] = bias


def checked_bias(model, gate_bias: GateBias) -> GateBias:
    """A float, or a list of floats with one bias per decoder layer."""
    if not isinstance(gate_bias, (list, tuple)):
        return float(gate_bias)
    layers = model.config.get_text_config().num_hidden_layers
    if len(gate_bias) != layers:
        raise ValueError(f"a per-layer gate bias needs one value per decoder layer ({layers}), "
                         f"got {len(gate_bias)}")
    return [float(b) for b in gate_bias]


def _configs(model) -> list:
    """The model's config and its text config (the same object for text-only models)."""
    return list({id(c): c for c in (model.config, model.config.get_text_config())}.values())


def activate(model) -> None:
    """Select the gated attention when the model's config says it is sparse (called on load)."""
    if is_sparse(model):
        _select_gated_attention(model)
