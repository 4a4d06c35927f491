"""Causal mediation of a prompt condition's effect (arXiv 2510.01032's claim that meaningless tokens
act through the first layers), component by component, between two conditions of the same items.

Per item: the treated condition's greedy answer is the continuation both prompts are scored on
(``alignment``); the metric is its log-probability; the total effect is M(treated) − M(baseline).
Each head (exactly, or to first order where that costs too much), MLP and layer's residual stream
is then patched from one run into the other at the
tokens the two share (``runs``, ``effects``: denoising and noising), and its share of the total
effect reported with an interval over items (``summary``). ARM on the baseline, over several
seeds, is measured on the same metric.

- ``alignment``: items, the token map read from the recorded spans, the continuation;
- ``runs``: the two conditions' batches and each direction's token map as columns;
- ``effects``: the patched runs;
- ``summary``: shares and their intervals;
- ``mediate`` (here): all of it for one model × dataset × condition.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from attnlab.interventions.mlp import ArmSettings
from attnlab.mechanism.mediation.alignment import AlignmentError, Item, answer_continuation
from attnlab.mechanism.mediation.effects import arm_effects, direction_table, record, recorded_parts
from attnlab.mechanism.mediation.runs import directions
from attnlab.mechanism.mediation.summary import SHARE_DEFINITION, mean_interval, shares, top_heads_share

__all__ = ["AlignmentError", "Item", "SHARE_DEFINITION", "answer_continuation", "items_from_tables", "mediate"]


def items_from_tables(baseline: pd.DataFrame, treated: pd.DataFrame, generations: pd.DataFrame,
                      grades: pd.DataFrame, decode, max_items: int | None = None) -> list[Item]:
    """The items both prompt tables hold (prompts files: input_ids, cut_start, cut_end), the
    treated generations' tokens cut after the graded answer (``answer_continuation``);
    ``max_items``: that many, evenly spaced over the file."""
    treated = treated.set_index("id")
    generations, grades = generations.set_index("id"), grades.set_index("id")
    items = []
    for row in baseline.itertuples():
        if row.id not in treated.index:
            continue
        t = treated.loc[row.id]
        continuation = answer_continuation(list(generations.at[row.id, "new_token_ids"]),
                                           generations.at[row.id, "response"], grades.at[row.id, "pred"], decode)
        items.append(Item.of(row.id, list(row.input_ids), list(t["input_ids"]),
                             (int(t["cut_start"]), int(t["cut_end"])), continuation))
    if not max_items or max_items >= len(items):
        return items
    # evenly spaced over the file, not its head: generated datasets are ordered by operands
    return [items[int(i)] for i in np.linspace(0, len(items) - 1, max_items).round()]


def mediate(model, items: list[Item], batch_size: int, arm: ArmSettings | None = None,
            arm_seeds: tuple[int, ...] = (), heads_method: str = "exact",
            layers: list[int] | None = None) -> dict[str, pd.DataFrame]:
    """Per item totals, every component's effect in both directions, their shares, the top heads'
    share and ARM's effect on the baseline per seed. ``heads_method`` and ``layers``:
    ``effects.direction_table``."""
    ids = [item.id for item in items]
    parts = recorded_parts(model, layers)
    den, noi = directions(items)
    runs = {"baseline": record(model, den.recipient, batch_size, parts),
            "treated": record(model, den.source, batch_size, parts)}
    totals = pd.DataFrame({"id": ids, "metric_baseline": runs["baseline"].metric,
                           "metric_treated": runs["treated"].metric,
                           "total_effect": runs["treated"].metric - runs["baseline"].metric,
                           "continuation_tokens": [len(item.continuation) for item in items]})
    sign = float(np.sign(totals["total_effect"].mean()))
    # denoising: the baseline run given the treated run's activations; noising: the reverse
    pairs = ((den, "treated", "baseline"), (noi, "baseline", "treated"))
    effects = pd.concat([direction_table(model, direction, {"source": runs[source], "recipient": runs[recipient]},
                                         ids, batch_size, heads_method, layers, sign)
                         for direction, source, recipient in pairs], ignore_index=True)
    total = totals.set_index("id")["total_effect"]
    arm_rows = []
    if arm is not None and arm_seeds:
        for seed, values in arm_effects(model, den.recipient, runs["baseline"].metric, batch_size, arm,
                                        list(arm_seeds)).items():
            arm_rows += [{"id": i, "seed": seed, "effect": float(v)} for i, v in zip(ids, values)]
    return {"totals": totals, "effects": effects, "shares": shares(effects, total),
            "top_heads": top_heads_share(effects, total), "total_interval": mean_interval(total.to_numpy(float)),
            "arm": pd.DataFrame(arm_rows)}
