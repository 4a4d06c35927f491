"""The indirect effect of each component of a model on a condition's effect, in both directions.

For one direction (``runs.Direction``) the recipient run is given the source run's activation of
one component at every token that has a counterpart, and the metric (the continuation's
log-probability) is measured again. Effects are signed as treated − baseline: denoising (the
baseline run given the treated run's component) reports M(patched) − M(baseline); noising (the
treated run given the baseline's) M(treated) − M(patched). A component carrying the whole effect
gives the total effect in both.

Components: every head (its slice of the attention's output-projection input, by exact patching
in resumed passes, ``pruning.Patcher.exact_per_prompt``), every MLP's output and every layer's
residual stream (block output; ``replacement.OutputReplacement``), the first layer's attention
output (all its heads) and, together, every head and every MLP at once (``all_heads_mlps``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from attnlab import anatomy
from attnlab.interventions import intervened
from attnlab.mediation.runs import Direction
from attnlab.mlp import ArmSettings
from attnlab.pruning import Patcher
from attnlab.replacement import OutputReplacement


def _sign(direction: Direction) -> float:
    return -1.0 if direction.name == "denoising" else 1.0


def _signed(direction: Direction, patched: np.ndarray, recipient: np.ndarray) -> np.ndarray:
    """Treated − baseline: denoising M(patched) − M(recipient), noising M(recipient) − M(patched)."""
    return (patched - recipient) if direction.name == "denoising" else (recipient - patched)


def head_effects(model, direction: Direction, batch_size: int) -> tuple[Patcher, np.ndarray]:
    """(the recipient's patcher, its heads' effects [items, layers, heads])."""
    source = Patcher(model, direction.source, "given", batch_size, references=[])
    recipient = Patcher(model, direction.recipient, "given", batch_size, references=[])
    references = [direction.transfer(s, r) for s, r in zip(source.head_inputs(direction.source.clean),
                                                           recipient.head_inputs(direction.recipient.clean))]
    patcher = Patcher(model, direction.recipient, "given", batch_size, references=references)
    drops = patcher.exact_per_prompt().numpy()  # M(recipient) − M(head from the source)
    return patcher, _sign(direction) * drops


def part_outputs(model, batch, batch_size: int, parts: list[tuple[str, int]]) -> dict:
    """Every part's output [rows, width, hidden] of ``batch``'s sequences, unpatched."""
    tap = OutputReplacement(parts)
    with intervened(model, replace=tap):
        Patcher(model, batch, "given", batch_size, references=[]).per_prompt(None)
    return {part: torch.cat(values) for part, values in tap.recorded.items()}


def part_effects(model, direction: Direction, patcher: Patcher, batch_size: int,
                 parts: list[tuple[str, int]]) -> dict[tuple[str, int], np.ndarray]:
    """Each part's effect per item, the source's output moved in at every aligned token."""
    outputs = part_outputs(model, direction.source, batch_size, parts)
    recipient = patcher.per_prompt(None)[1]
    effects = {}
    for part in parts:
        replacement = OutputReplacement([part], {part: direction.gathered(outputs[part])}, direction.aligned)
        with intervened(model, replace=replacement):
            patched = patcher.per_prompt(None)[1]
        effects[part] = _signed(direction, patched, recipient)
    return effects


def grouped_effects(model, direction: Direction, patcher: Patcher, batch_size: int) -> dict[str, np.ndarray]:
    """The first layer's attention output (every head of layer 0 at once) and every head with
    every MLP at once, per item."""
    parts = anatomy.of(model)
    recipient = patcher.per_prompt(None)[1]
    first = torch.ones(parts.n_layers, parts.n_heads)
    first[0] = 0
    everything = [("mlp", layer) for layer in range(parts.n_layers)]
    outputs = part_outputs(model, direction.source, batch_size, everything)
    replacement = OutputReplacement(everything, {p: direction.gathered(v) for p, v in outputs.items()},
                                    direction.aligned)
    with intervened(model, replace=replacement):
        all_patched = patcher.per_prompt(torch.zeros(parts.n_layers, parts.n_heads))[1]
    return {"L0.attention": _signed(direction, patcher.per_prompt(first)[1], recipient),
            "all_heads_mlps": _signed(direction, all_patched, recipient)}


def arm_effects(model, baseline, batch_size: int, settings: ArmSettings, seeds: list[int]) -> dict[int, np.ndarray]:
    """ARM on the baseline prompt, per seed: M(baseline with ARM) − M(baseline), per item."""
    patcher = Patcher(model, baseline, "given", batch_size, references=[])
    plain = patcher.per_prompt(None)[1]
    effects = {}
    for seed in seeds:
        with intervened(model, arm=ArmSettings(**{**settings.__dict__, "seed": seed})):
            effects[seed] = patcher.per_prompt(None)[1] - plain
    return effects


def direction_table(model, direction: Direction, ids: list[str], batch_size: int) -> pd.DataFrame:
    """Every component's effect per item in one direction: columns id, direction, component,
    kind, layer, head, effect."""
    parts = anatomy.of(model)
    patcher, heads = head_effects(model, direction, batch_size)
    rows = [{"id": ids[i], "component": f"L{layer}.H{head}", "kind": "head", "layer": layer, "head": head,
             "effect": float(heads[i, layer, head])}
            for i in range(len(ids)) for layer in range(parts.n_layers) for head in range(parts.n_heads)]
    layered = [(kind, layer) for layer in range(parts.n_layers) for kind in ("mlp", "residual")]
    for (kind, layer), values in part_effects(model, direction, patcher, batch_size, layered).items():
        rows += [{"id": ids[i], "component": f"L{layer}.{kind}", "kind": kind, "layer": layer, "head": -1,
                  "effect": float(values[i])} for i in range(len(ids))]
    for name, values in grouped_effects(model, direction, patcher, batch_size).items():
        rows += [{"id": ids[i], "component": name, "kind": "group", "layer": -1, "head": -1,
                  "effect": float(values[i])} for i in range(len(ids))]
    table = pd.DataFrame(rows)
    table.insert(1, "direction", direction.name)
    return table
