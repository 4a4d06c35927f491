"""The MLP side of the meaningless-token effect: activation statistics and ARM.

Both work on one decoder layer's MLP activation ``a = act_fn(gate_proj(x))``
(SiLU in Llama/Qwen2/OLMo, GELU-tanh in Gemma-3; GPT-2's plain MLP: ``a = act(c_fc(x))``,
GELU), reached with a forward hook on the layer's activation module (``anatomy``): its input
is the pre-activation ``g = gate_proj(x)`` (``c_fc(x)``) and its output is ``a``.

ARM (Activation Redistribution Module, arXiv 2510.01032), per token, i.e. on
each token's activation vector ``a`` of the intermediate size ``d``:

1. ``eps = 1.4826 * MAD(|a|) * c``, with ``MAD(v) = median(|v - median(v)|)`` (the lower
   median for an even count, as ``torch.median``);
2. ``S`` = share of entries with ``|a| < eps``; ``fraction = clip(S, pmin, pmax)``;
3. the ``n = round(fraction * d)`` entries of smallest ``|a|`` are redrawn,
   keeping their sign: a positive (or zero) entry from ``U[0, q_p]`` with
   ``q_p`` the p-th percentile of ``a``, a negative one from ``U[min(a), 0]``.
   ``mode: replace`` (the paper's code) puts the draw in place of the entry;
   ``mode: add`` (the paper's text) adds it to the entry.

The uniform draws come from a counter-based hash of (seed, position among the
prompt's real tokens, token id, unit), not from a generator stream over the
batch tensor, so they too are the same whatever the batch, its padding, or an
out-of-memory retry with a smaller batch.

Statistics are taken per token, not over the whole batch tensor, so that a
token's result does not depend on which prompts share its batch, on padding,
or on whether it is processed in the prefill or in a decoding step. All of it
runs on the activation's device (no transfer to the CPU for a percentile).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from attnlab import anatomy
from attnlab.config.checks import HeadRangeError

log = logging.getLogger(__name__)

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
ARM_MODES = ("replace", "add")


@dataclass(frozen=True)
class ArmSettings:
    """ARM hyperparameters; defaults are mid-range of the paper's c 0.1-0.3 and p 90-99.5."""

    layer: int = 0
    c: float = 0.2
    p: float = 95.0
    pmin: float = 0.02
    pmax: float = 0.25
    mode: str = "replace"
    seed: int = 0

    def __post_init__(self):
        if self.mode not in ARM_MODES:
            raise ValueError(f"ARM mode {self.mode!r}: expected one of {ARM_MODES}")
        if not 0 <= self.pmin <= self.pmax <= 1:
            raise ValueError(f"ARM needs 0 <= pmin <= pmax <= 1, got pmin={self.pmin}, pmax={self.pmax}")
        if not 0 < self.p <= 100:
            raise ValueError(f"ARM percentile p={self.p} must be in (0, 100]")


def _kth(values: torch.Tensor, k: int) -> torch.Tensor:
    """k-th smallest (1-based) along the last dimension, keeping it."""
    return values.kthvalue(k, dim=-1, keepdim=True).values


_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A well-mixing bijection of 32-bit integers held in int64 (lowbias32 with the
    multipliers of Wellons' hash-prospector search, both below 2**31): each product stays
    below 2**63, as signed int64 overflow is not defined. In place on ``x``."""
    x ^= x >> 16
    x.mul_(0x21F0AAAD).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(0x735A2D97).bitwise_and_(_MASK32)
    x ^= x >> 15
    return x


def _mix(key: torch.Tensor, value: torch.Tensor, salt: int) -> torch.Tensor:
    """Fold one field into a key. The salt keeps fields apart (without it, position 0 and
    unit 11 of token 11 would cancel, as _hash32(0) = 0), so draws repeat only by chance."""
    return _hash32(key ^ _hash32((value.long() + salt) & _MASK32))


def token_keys(seed: int, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per token from (seed, position, token id): what its draws depend on."""
    key = _hash32(torch.full_like(positions, (seed + 0x243F6A88) & _MASK32, dtype=torch.long))
    key = _mix(key, positions, 0x85A308D3)
    return _mix(key, tokens.to(positions.device), 0x13198A2E)


def uniform_draws(keys: torch.Tensor, units: torch.Tensor, d: int | None = None) -> torch.Tensor:
    """U[0, 1) for each (token key [..., 1], unit index [..., m] below ``d``), in float32
    (24 bits), identical on every device."""
    d = int(units.max()) + 1 if d is None else d
    # Hashing the d unit indices once and gathering keeps the per-entry work to one hash.
    unit_hashes = _hash32((torch.arange(d, device=units.device) + 0x03707344) & _MASK32)
    bits = _hash32(unit_hashes[units] ^ keys)
    return (bits >> 8).float().mul_(2.0 ** -24)


def redistribute(a: torch.Tensor, settings: ArmSettings, positions: torch.Tensor,
                 tokens: torch.Tensor) -> torch.Tensor:
    """ARM applied to every token vector (last dimension) of ``a``; a new tensor.

    ``positions`` and ``tokens`` ([...], ``a.shape[:-1]``) are each token's position among
    its prompt's real tokens and its id: with ``settings.seed`` they fix its draws.
    """
    d = a.shape[-1]
    if positions.shape != a.shape[:-1] or tokens.shape != a.shape[:-1]:
        raise ValueError(f"ARM: positions {tuple(positions.shape)} and tokens {tuple(tokens.shape)} "
                         f"must match the activation's token shape {tuple(a.shape[:-1])}")
    rows = a.reshape(-1, d)
    work = rows.float()
    magnitude = work.abs()
    median = _kth(magnitude, (d + 1) // 2)
    mad = _kth((magnitude - median).abs(), (d + 1) // 2)
    eps = MAD_TO_SIGMA * mad * settings.c
    share = (magnitude < eps).float().mean(-1, keepdim=True)
    count = (share.clamp(settings.pmin, settings.pmax) * d).round().long()  # [rows, 1]
    # The count largest-possible selection, sorted by |a|; each row keeps its first `count`.
    most = max(1, math.ceil(settings.pmax * d))
    smallest = magnitude.topk(most, dim=-1, largest=False, sorted=True).indices
    take = torch.arange(most, device=a.device).expand_as(smallest) < count
    upper = _kth(work, max(1, math.ceil(settings.p / 100 * d))).clamp(min=0)
    lower = work.min(-1, keepdim=True).values.clamp(max=0)
    # Draws only for the candidates (at most pmax of the units), keyed by unit index.
    keys = token_keys(settings.seed, positions.reshape(-1, 1).to(a.device), tokens.reshape(-1, 1))
    uniform = uniform_draws(keys, smallest, d)
    candidates = work.gather(-1, smallest)
    draws = torch.where(candidates >= 0, uniform * upper, uniform * lower)
    if settings.mode == "add":
        draws = candidates + draws
    return work.scatter(-1, smallest, torch.where(take, draws, candidates)).to(a.dtype).reshape(a.shape)


def _act_fn(model, layer: int) -> torch.nn.Module:
    """Layer ``layer``'s MLP activation module (``anatomy``: act_fn, GPT-2's act)."""
    parts = anatomy.of(model, stages=("MLP analysis and ARM",))
    if not 0 <= layer < parts.n_layers:
        raise HeadRangeError(f"MLP layer {layer}: the model has {parts.n_layers} layers "
                             f"(0-based: 0..{parts.n_layers - 1})")
    act_fn = parts.mlp_activation(layer)
    if any(parts.mlp_activation(other) is act_fn for other in range(parts.n_layers) if other != layer):
        raise TypeError(f"layer {layer} shares its MLP activation module with another layer; "
                        "a hook on it would fire for both")
    return act_fn


def hooks(model, arm: ArmSettings | None, recorder: ActivationRecorder | None) -> list:
    """The forward hooks of ARM (on its layer's act_fn) and of an activation recorder (on its
    layer's, after ARM's where both are one), installed by ``interventions.intervened``."""
    recorded = None if recorder is None else _act_fn(model, recorder.layer)  # fails before any hook is in
    handles = [] if arm is None else _arm_hooks(model, arm)
    if recorded is not None:
        handles.append(recorded.register_forward_hook(recorder.hook))
    return handles


def _arm_hooks(model, settings: ArmSettings) -> list:
    """ARM on the configured layer for every forward (prefill and decoding)."""
    # (token ids, positions) of the forwards under way, innermost last: the causal-LM wrapper
    # sees input_ids even where it hands its decoder only embeddings (Gemma-3 multimodal).
    stack: list[tuple[torch.Tensor, torch.Tensor] | None] = []

    def enter(module, args, kwargs):
        stack.append(_tokens_and_positions(args, kwargs))

    def leave(module, args, kwargs, output):
        stack.pop()

    def hook(module, args, output):
        known = [entry for entry in stack if entry is not None]
        if not known:
            raise RuntimeError("ARM keys its random draws by token id and position: call the model "
                               "with input_ids, not inputs_embeds")
        tokens, positions = known[-1]
        return redistribute(output, settings, positions, tokens)

    act_fn = _act_fn(model, settings.layer)
    handles = []
    for module in dict.fromkeys([model, anatomy.of(model).decoder]):
        handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(module.register_forward_hook(leave, with_kwargs=True, always_call=True))
    handles.append(act_fn.register_forward_hook(hook))
    log.info("ARM on layer %d's MLP activation: %s", settings.layer, settings)
    return handles


def _tokens_and_positions(args, kwargs) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Token ids [B, T] and their positions among each prompt's real tokens, for a model
    call in prefill or a decoding step, with or without left padding (None: no input_ids)."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor):
        return None
    batch, length = ids.shape
    positions = kwargs.get("position_ids")
    mask = kwargs.get("attention_mask")
    if positions is not None:
        positions = positions[0] if positions.dim() == 3 else positions  # multimodal RoPE: [3, B, T]
    elif isinstance(mask, torch.Tensor) and mask.dim() == 2:
        # the mask covers the cache too; its running count is the real-token position
        positions = (mask.long().cumsum(-1) - 1)[:, -length:]
    else:
        cache = kwargs.get("cache_position")
        if cache is None:
            past = kwargs.get("past_key_values")
            start = past.get_seq_length() if past is not None else 0
            cache = torch.arange(start, start + length, device=ids.device)
        positions = cache
    return ids, positions.to(ids.device).expand(batch, length)


# ---- statistics ----

STATISTICS = {
    "near_zero": "share of |a| below the threshold",
    "l1": "sum of |a| over the intermediate units",
    "l2": "Euclidean norm of a",
    "gini": "Gini coefficient of |a| (0: all equal, 1: one unit holds everything)",
    "gate_variance": "variance of the pre-activation g = gate_proj(x) (GPT-2: c_fc(x)) over the prompt's "
                     "question tokens, mean over units",
}


def gini(values: torch.Tensor) -> torch.Tensor:
    """Gini coefficient of non-negative values along the last dimension."""
    n = values.shape[-1]
    ordered = values.sort(dim=-1).values
    weights = 2 * torch.arange(1, n + 1, device=values.device, dtype=values.dtype) - n - 1
    total = ordered.sum(-1)
    return torch.where(total > 0, (ordered * weights).sum(-1) / (n * total), torch.zeros_like(total))


def token_statistics(a: torch.Tensor, threshold: float) -> dict[str, torch.Tensor]:
    """Per-token statistics of activation vectors ``a`` [..., d]."""
    magnitude = a.float().abs()
    return {"near_zero": (magnitude < threshold).float().mean(-1),
            "l1": magnitude.sum(-1),
            "l2": magnitude.square().sum(-1).sqrt(),
            "gini": gini(magnitude)}


def prompt_statistics(a: torch.Tensor, g: torch.Tensor, mask: torch.Tensor,
                      threshold: float) -> dict[str, torch.Tensor]:
    """Per-prompt means over the masked tokens of ``a``, ``g`` [B, T, d] (mask [B, T]).

    Token statistics are averaged over the prompt's masked tokens; the gate
    variance is taken per unit over those tokens (the paper's Var[z_j]) and
    then averaged over units.
    """
    weights = mask.float()
    count = weights.sum(-1)
    out = {name: (value * weights).sum(-1) / count
           for name, value in token_statistics(a, threshold).items()}
    g = g.float()
    mean = (g * weights[..., None]).sum(1) / count[:, None]
    spread = ((g - mean[:, None]).square() * weights[..., None]).sum(1) / count[:, None]
    out["gate_variance"] = spread.mean(-1)
    out["n_tokens"] = count
    return out


class LayerRecorded(Exception):
    """Raised by an ``ActivationRecorder`` with ``stop_forward`` once its layer is recorded: the
    rest of the forward (later layers, the LM head) cannot change what it recorded."""


class ActivationRecorder:
    """Per-prompt statistics and a histogram of one layer's ``a`` over the tokens selected by
    ``mask`` (set before each forward), from ``hook`` (on that layer's act_fn, see ``hooks``).
    With ``stop_forward`` the hook ends the forward there (``LayerRecorded``), for a caller that
    needs nothing else of it: the first layer of 30 is 1/30 of the pass."""

    def __init__(self, layer: int, threshold: float, edges: np.ndarray, stop_forward: bool = False):
        self.layer, self.threshold, self.edges = layer, threshold, edges
        self.stop_forward = stop_forward
        self.counts = np.zeros(len(edges) + 1, np.int64)  # underflow, bins, overflow
        self.rows: list[dict[str, np.ndarray]] = []
        self.mask: torch.Tensor | None = None

    def hook(self, module, args, output):
        if self.mask is None:
            raise RuntimeError("ActivationRecorder.mask must be set before each forward")
        mask = self.mask.to(output.device)
        stats = prompt_statistics(output, args[0], mask, self.threshold)
        self.rows.append({k: v.cpu().numpy() for k, v in stats.items()})
        values = output.float()[mask].flatten()
        edges = torch.as_tensor(self.edges, device=values.device, dtype=values.dtype)
        # bucketize: 0 below the first edge, len(edges) at/above the last
        index = torch.bucketize(values, edges, right=True)
        self.counts += torch.bincount(index, minlength=len(self.edges) + 1).cpu().numpy()
        if self.stop_forward:
            raise LayerRecorded

    def table(self) -> pd.DataFrame:
        return pd.DataFrame({k: np.concatenate([r[k] for r in self.rows]) for k in self.rows[0]})

    def histogram(self) -> pd.DataFrame:
        """Counts per bin; the first and last rows count values outside the edges."""
        low = np.r_[-np.inf, self.edges]
        high = np.r_[self.edges, np.inf]
        return pd.DataFrame({"low": low, "high": high, "count": self.counts})


def _mean_ci(values: np.ndarray) -> tuple[float, float, float]:
    """Mean over prompts and its 95% interval, from Student's t (n − 1 degrees of freedom):
    with few prompts the normal 1.96 is too narrow."""
    from scipy.stats import t

    values = np.asarray(values, float)
    mean = float(values.mean())
    n = len(values)
    half = float(t.ppf(0.975, n - 1)) * float(values.std(ddof=1)) / np.sqrt(n) if n > 1 else float("nan")
    return mean, mean - half, mean + half


def summarise_statistics(stats: dict[str, pd.DataFrame], baseline: str) -> pd.DataFrame:
    """Per condition: each statistic's mean over prompts with a 95% t interval, and its paired
    difference from the baseline condition with a 95% t interval, over the prompts both have
    (``n_paired``: how many; fewer than ``n_prompts`` where either lost some)."""
    reference = stats[baseline].set_index("id")
    rows = []
    for condition, frame in stats.items():
        frame = frame.set_index("id")
        row = {"condition": condition, "n_prompts": len(frame),
               "n_tokens": int(frame["n_tokens"].sum()),
               "n_paired": int(frame.index.isin(reference.index).sum())}
        for name in STATISTICS:
            row[name], row[f"{name}_ci_low"], row[f"{name}_ci_high"] = _mean_ci(frame[name])
            paired = (frame[name] - reference[name].reindex(frame.index)).dropna()
            delta = _mean_ci(paired) if len(paired) else (float("nan"),) * 3
            row[f"{name}_delta"], row[f"{name}_delta_ci_low"], row[f"{name}_delta_ci_high"] = delta
        rows.append(row)
    return pd.DataFrame(rows)
