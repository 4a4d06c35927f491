"""The indirect effect of each component of a model on a condition's effect, in both directions.

For one direction (``runs.Direction``) the recipient run is given the source run's activation of
one component at every token that has a counterpart, and the metric (the continuation's
log-probability) is measured again. Effects are signed as treated − baseline: denoising (the
baseline run given the treated run's component) reports M(patched) − M(baseline); noising (the
treated run given the baseline's) M(treated) − M(patched). A component carrying the whole effect
gives the total effect in both.

Components: every head (its slice of the attention's output-projection input), by exact patching
in resumed passes (``patching.heads.Patcher.exact_per_prompt``) or, where that costs too much, by
attribution patching (``HEAD_METHODS``); the MLP's output and the residual stream (block output;
``replacement.OutputReplacement``) of every layer asked for; and, each by one exact patch, the
first layer's attention output (all its heads), the ten heads that carry most of the effect
together (``top10_heads``) and every head with every MLP at once (``all_heads_mlps``). Each condition is
run once, unpatched, recording all the activations the patches take (``record``); a patch is then
one forward (heads by attribution: one forward and one backward for all of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from attnlab import anatomy
from attnlab.interventions import intervened
from attnlab.interventions.mlp import ArmSettings
from attnlab.interventions.replacement import OutputReplacement
from attnlab.mechanism.mediation.runs import Direction
from attnlab.patching.heads import Patcher


def _sign(direction: Direction) -> float:
    return -1.0 if direction.name == "denoising" else 1.0


def _signed(direction: Direction, patched: np.ndarray, recipient: np.ndarray) -> np.ndarray:
    """Treated − baseline: denoising M(patched) − M(recipient), noising M(recipient) − M(patched)."""
    return (patched - recipient) if direction.name == "denoising" else (recipient - patched)


# How each head's effect is measured: "exact" patches it (a resumed pass per head: about half a
# forward each); "attribution" takes the first-order estimate, the gradient of each item's metric
# with respect to the head's gate times the patch (one forward and one backward for every head:
# a ranking and a map, not a measurement; the shares the results quote stay exact patches).
HEAD_METHODS = ("exact", "attribution")
TOP_HEADS = 10


@dataclass(frozen=True)
class Run:
    """One condition's sequences run once, unpatched: each item's metric, every layer's
    output-projection input (the heads) and the outputs of ``parts`` ([rows, width, hidden])."""

    metric: np.ndarray
    head_inputs: list[torch.Tensor]
    outputs: dict[tuple[str, int], torch.Tensor]


def record(model, batch, batch_size: int, parts: list[tuple[str, int]]) -> Run:
    """``batch``'s ``Run``: one forward per chunk records everything the patches take from it."""
    tap = OutputReplacement(parts)
    with intervened(model, replace=tap):
        metric, inputs = Patcher(model, batch, "given", batch_size, references=[]).per_prompt_with_head_inputs()
    return Run(metric, inputs, {part: torch.cat(values) for part, values in tap.recorded.items()})


def patched_one_at_a_time(model, layers: list[int] | None) -> list[tuple[str, int]]:
    """The MLP and residual-stream parts patched one at a time: at ``layers`` (None: every one;
    layer 0, the paper's claimed path, always)."""
    chosen = range(anatomy.of(model).n_layers) if layers is None else sorted({0, *layers})
    return [(kind, layer) for layer in chosen for kind in ("mlp", "residual")]


def recorded_parts(model, layers: list[int] | None) -> list[tuple[str, int]]:
    """What a run records: every MLP's output (all of them are patched together), and the parts
    patched one at a time (``patched_one_at_a_time``)."""
    every_mlp = [("mlp", layer) for layer in range(anatomy.of(model).n_layers)]
    return every_mlp + [part for part in patched_one_at_a_time(model, layers) if part not in every_mlp]


def head_effects(model, direction: Direction, runs: dict[str, Run], batch_size: int,
                 method: str = "exact") -> tuple[Patcher, np.ndarray]:
    """(the recipient's patcher, its heads' effects [items, layers, heads], by ``method``)."""
    if method not in HEAD_METHODS:
        raise ValueError(f"mediation heads: {method!r} is not one of {HEAD_METHODS}")
    source, recipient = runs["source"], runs["recipient"]
    references = [direction.transfer(s, r) for s, r in zip(source.head_inputs, recipient.head_inputs)]
    patcher = Patcher(model, direction.recipient, "given", batch_size, references=references)
    # M(recipient) − M(head from the source), measured, or to first order: M(g=1) − M(g=0) ≈ dM/dg
    drops = (patcher.exact_per_prompt() if method == "exact" else patcher.attribution_per_prompt()).numpy()
    return patcher, _sign(direction) * drops


def part_effects(model, direction: Direction, patcher: Patcher, runs: dict[str, Run],
                 parts: list[tuple[str, int]]) -> dict[tuple[str, int], np.ndarray]:
    """Each part's effect per item, the source's output moved in at every aligned token."""
    effects = {}
    for part in parts:
        replacement = OutputReplacement([part], {part: direction.gathered(runs["source"].outputs[part])},
                                        direction.aligned)
        with intervened(model, replace=replacement):
            patched = patcher.per_prompt(None)[1]
        effects[part] = _signed(direction, patched, runs["recipient"].metric)
    return effects


def top_heads(heads: np.ndarray, total_sign: float, k: int = TOP_HEADS) -> list[tuple[int, int]]:
    """The ``k`` (layer, head) pairs that carry most of the total effect: the largest mean effect
    over items (``heads``: [items, layers, heads]) in the total effect's direction (``total_sign``:
    the sign of the mean total effect; a negative effect is carried by the most negative heads),
    largest first."""
    means = heads.mean(0) * (1.0 if total_sign >= 0 else -1.0)
    order = np.argsort(-means, axis=None, kind="stable")[:k]
    return [tuple(int(i) for i in np.unravel_index(flat, means.shape)) for flat in order]


def grouped_effects(model, direction: Direction, patcher: Patcher, runs: dict[str, Run],
                    chosen: list[tuple[int, int]]) -> dict[str, np.ndarray]:
    """The first layer's attention output (every head of layer 0 at once), the ``chosen`` heads
    together, and every head with every MLP at once, per item: exact patches."""
    parts = anatomy.of(model)
    recipient = runs["recipient"].metric
    first = torch.ones(parts.n_layers, parts.n_heads)
    first[0] = 0
    top = torch.ones(parts.n_layers, parts.n_heads)
    for layer, head in chosen:
        top[layer, head] = 0
    everything = [("mlp", layer) for layer in range(parts.n_layers)]
    replacement = OutputReplacement(everything, {p: direction.gathered(runs["source"].outputs[p]) for p in everything},
                                    direction.aligned)
    with intervened(model, replace=replacement):
        all_patched = patcher.per_prompt(torch.zeros(parts.n_layers, parts.n_heads))[1]
    return {"L0.attention": _signed(direction, patcher.per_prompt(first)[1], recipient),
            f"top{TOP_HEADS}_heads": _signed(direction, patcher.per_prompt(top)[1], recipient),
            "all_heads_mlps": _signed(direction, all_patched, recipient)}


def arm_effects(model, baseline, plain: np.ndarray, batch_size: int, settings: ArmSettings,
                seeds: list[int]) -> dict[int, np.ndarray]:
    """ARM on the baseline prompt, per seed: M(baseline with ARM) − M(baseline) (``plain``), per item."""
    patcher = Patcher(model, baseline, "given", batch_size, references=[])
    effects = {}
    for seed in seeds:
        with intervened(model, arm=ArmSettings(**{**settings.__dict__, "seed": seed})):
            effects[seed] = patcher.per_prompt(None)[1] - plain
    return effects


def direction_table(model, direction: Direction, runs: dict[str, Run], ids: list[str], batch_size: int,
                    heads_method: str = "exact", layers: list[int] | None = None,
                    total_sign: float = 1.0) -> pd.DataFrame:
    """Every component's effect per item in one direction (``runs``: the source's and the
    recipient's ``Run``): columns id, direction, component, kind, layer, head, method (how it was
    measured), members (the heads of a group), effect. ``layers``: those whose MLP and residual
    stream are patched one at a time (None: every one; layer 0, the paper's claimed path, always);
    ``total_sign``: the mean total effect's sign (``top_heads``)."""
    parts = anatomy.of(model)
    patcher, heads = head_effects(model, direction, runs, batch_size, heads_method)
    rows = [{"id": ids[i], "component": f"L{layer}.H{head}", "kind": "head", "layer": layer, "head": head,
             "method": heads_method, "members": "", "effect": float(heads[i, layer, head])}
            for i in range(len(ids)) for layer in range(parts.n_layers) for head in range(parts.n_heads)]
    for (kind, layer), values in part_effects(model, direction, patcher, runs,
                                              patched_one_at_a_time(model, layers)).items():
        rows += [{"id": ids[i], "component": f"L{layer}.{kind}", "kind": kind, "layer": layer, "head": -1,
                  "method": "exact", "members": "", "effect": float(values[i])} for i in range(len(ids))]
    chosen = top_heads(heads, total_sign)
    members = {f"top{TOP_HEADS}_heads": ",".join(f"L{layer}.H{head}" for layer, head in chosen)}
    for name, values in grouped_effects(model, direction, patcher, runs, chosen).items():
        rows += [{"id": ids[i], "component": name, "kind": "group", "layer": -1, "head": -1, "method": "exact",
                  "members": members.get(name, ""), "effect": float(values[i])} for i in range(len(ids))]
    table = pd.DataFrame(rows)
    table.insert(1, "direction", direction.name)
    return table
