"""Whether a sparse copy still does each task: its clean − corrupted gap against its base's.

A head count says how many heads explain the share of a model's task effect that the threshold
asks for. A copy whose clean − corrupted gap has shrunk needs few heads to explain what is left
of a task it no longer does, which is no circuit of that task. So beside each N× the copy's gap
on the counted prompts is divided by its base's on the same prompts (the unpatched models on the
clean and on the corrupted prompts: no ablation enters), with a paired bootstrap interval (the
copy shares its base's tokenizer, so both were counted on the same prompts, prompt by prompt),
and a copy that keeps less than ``KEPT_GAP_FLOOR`` of a task's gap is flagged.

No torch here: each sweep.json records its counted prompts' metrics (``steps.sweep_heads``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from attnlab.circuits.counting import Bootstrap
from attnlab.circuits.curves import order_interval

# A copy that keeps less than 80% of its base's clean − corrupted gap is taken to have lost the
# task. The floor mirrors the head counts' own scale: their threshold asks heads to explain
# about 90% of the gap (pruning.threshold), so a copy that has lost more than a fifth of the
# gap itself has lost about twice what the count lets a circuit leave out, and its count
# describes what remains rather than the task.
KEPT_GAP_FLOOR = 0.8
KEPT_GAP_LABEL = f"keeps < {KEPT_GAP_FLOOR:.0%} of the task's clean−corrupted gap"
KEPT_GAP_COLUMNS = ("gap_dense", "gap_copy", "kept_gap", "kept_gap_low", "kept_gap_high", "kept_gap_paired",
                    "task_lost", "kept_gap_undefined_resamples")


def per_prompt_gaps(summary: dict) -> np.ndarray | None:
    """Each counted prompt's clean − corrupted metric, from a sweep.json (None: it records none,
    written before the sweeps kept them)."""
    clean, corrupted = summary.get("clean_metric_per_prompt"), summary.get("corrupted_metric_per_prompt")
    if clean is None or corrupted is None:
        return None
    return np.asarray(clean, float) - np.asarray(corrupted, float)


def kept_gap(dense: dict, copy: dict, bootstrap: Bootstrap) -> dict:
    """The copy's clean − corrupted gap over its base's (``dense`` and ``copy``: their sweep.json
    on one task), with the bootstrap interval of that ratio: the same resamples of the prompts for
    both when they were counted on the same prompts (``counted_prompts_digest``), independent ones
    otherwise, as the N×'s interval. The gaps are signed: a copy whose gap changed sign keeps less
    than nothing. A share of the base's gap needs a base that does the task: NaN throughout where
    either sweep records no per-prompt metrics or the base's mean gap is not positive (a ratio to
    a negative gap would call a copy that fails the task worse than its base one that keeps it);
    resamples whose base gap is not positive are left out of the interval and counted
    (``kept_gap_undefined_resamples``)."""
    dense_gaps, copy_gaps = per_prompt_gaps(dense), per_prompt_gaps(copy)
    if dense_gaps is None or copy_gaps is None:
        return _no_kept_gap()
    paired = dense.get("counted_prompts_digest") == copy.get("counted_prompts_digest")
    if paired and len(dense_gaps) != len(copy_gaps):
        raise ValueError(f"paired sweeps need the same prompts; they have {len(dense_gaps)} and {len(copy_gaps)}")
    draws_dense = bootstrap.draws(len(dense_gaps))
    draws_copy = draws_dense if paired else bootstrap.draws(len(copy_gaps), stream=1)
    gap_dense, gap_copy = float(dense_gaps.mean()), float(copy_gaps.mean())
    if not gap_dense > 0:
        return {**_no_kept_gap(gap_dense), "gap_copy": gap_copy, "kept_gap_paired": paired}
    resampled_dense = dense_gaps[draws_dense].mean(-1)
    undefined = resampled_dense <= 0
    resampled = copy_gaps[draws_copy].mean(-1) / np.where(undefined, np.nan, resampled_dense)
    low, high = order_interval(resampled, bootstrap.confidence)
    kept = gap_copy / gap_dense
    return {"gap_dense": gap_dense, "gap_copy": gap_copy, "kept_gap": kept, "kept_gap_low": low,
            "kept_gap_high": high, "kept_gap_paired": paired, "task_lost": bool(kept < KEPT_GAP_FLOOR),
            "kept_gap_undefined_resamples": int(undefined.sum())}


def _no_kept_gap(gap_dense: float = float("nan")) -> dict:
    return {**{key: float("nan") for key in KEPT_GAP_COLUMNS}, "gap_dense": gap_dense, "kept_gap_paired": None,
            "task_lost": None}


def with_kept_gaps(table: pd.DataFrame, sweeps: dict[tuple[str, str, str], dict], bootstrap: Bootstrap) -> pd.DataFrame:
    """A heads-vs-density table (rows: label = model, base = its dense model, task, ablation) with
    each copy's kept gap against its base (``kept_gap``; ``sweeps`` keyed (model, task,
    ablation)); a dense model's own row has its gap as gap_dense and nothing else."""
    rows = []
    for row in table.itertuples():
        dense = sweeps[(row.base, row.task, row.ablation)]
        if row.label == row.base:
            gaps = per_prompt_gaps(dense)
            rows.append(_no_kept_gap(float(gaps.mean()) if gaps is not None else float("nan")))
        else:
            rows.append(kept_gap(dense, sweeps[(row.label, row.task, row.ablation)], bootstrap))
    return table.assign(**{key: [row[key] for row in rows] for key in KEPT_GAP_COLUMNS})


def kept_gap_text(copy: str, dense: str, gap: dict) -> str:
    """"B keeps 52% [40%, 61%] of A's clean−corrupted gap", and the flag where it is below the
    floor; why there is none where the base has no positive gap; '' where nothing was measured."""
    if gap is not None and np.isfinite(gap["gap_dense"]) and gap["gap_dense"] <= 0:
        return f"{dense}'s clean−corrupted gap is {gap['gap_dense']:.3g}, not positive: no share of it to keep"
    if gap is None or not np.isfinite(gap["kept_gap"]):
        return ""
    spread = ""
    if np.isfinite(gap["kept_gap_low"]) and np.isfinite(gap["kept_gap_high"]):
        spread = f" [{gap['kept_gap_low']:.0%}, {gap['kept_gap_high']:.0%}]"
    lost = f" (< {KEPT_GAP_FLOOR:.0%}: the task is lost)" if gap["task_lost"] else ""
    return f"{copy} keeps {gap['kept_gap']:.0%}{spread} of {dense}'s clean−corrupted gap{lost}"
