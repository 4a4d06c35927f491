"""Areas over every swept curve (MIB's CPR and CMD) and, for each compared pair, what differs
between the two models: the areas' differences, the N× at the threshold and the kept gap, each
with its bootstrap interval (paired where both were counted on the same prompts); and seed 004's
figure, one panel per task (``circuits.areas``, ``plots.areas``)."""

from __future__ import annotations

import pandas as pd

from attnlab import io
from attnlab.steps.circuits import _bootstrap, _read_sweep

# what a row of the differences table says of the pair (first, second): second − first
DIFFERENCE_NOTE = ("differences are second − first; N× = first's count / second's; kept gap = second's "
                   "clean − corrupted gap / first's")


def _key(key: str) -> tuple[str, str, str, str]:
    unit, model, task, ablation = key.split("/")
    return unit, model, task, ablation


def read_sweeps(inputs: dict[str, dict[str, str]]) -> dict[tuple, object]:
    """``inputs``: "unit/model/task/ablation" -> the sweep's files (sweep, summary, per_prompt),
    read with components named heads (``steps.circuits._read_sweep``); each summary's
    ``components`` is the number of the unit's components (an edge sweep's summary.json names
    its model's heads too)."""
    read = {}
    for key, paths in inputs.items():
        unit = _key(key)[0]
        swept = _read_sweep(paths, unit=unit)
        swept.summary["components"] = io.read_json(paths["summary"])[unit]
        read[_key(key)] = swept
    return read


def area_rows(read: dict, bootstrap: dict) -> pd.DataFrame:
    """One row per curve: its count with the interval, and its areas (``areas.curve_areas``)."""
    from attnlab.circuits.areas import curve_areas

    boot = _bootstrap(bootstrap)
    rows = []
    for (unit, model, task, ablation), swept in read.items():
        prompts = swept.per_prompt["prompt"].nunique()
        summary = swept.summary
        rows.append({"unit": unit, "model": model, "task": task, "ablation": ablation,
                     "counted_prompts": prompts, "count": summary.get("heads_to_reach_threshold"),
                     "count_low": summary.get("heads_interval", [None, None])[0],
                     "count_high": summary.get("heads_interval", [None, None])[1],
                     **curve_areas(swept.per_prompt, summary["components"], boot.draws(prompts), boot.confidence)})
    return pd.DataFrame(rows)


def difference_rows(read: dict, pairs: list[tuple[str, str]], threshold: float, bootstrap: dict) -> pd.DataFrame:
    """One row per compared pair and curve both have (unit, task, ablation): second − first's
    areas, the N× and the kept gap, with intervals (``DIFFERENCE_NOTE``)."""
    from attnlab.circuits.areas import area_difference
    from attnlab.circuits.counting import ratio_between
    from attnlab.circuits.task_gap import kept_gap

    boot = _bootstrap(bootstrap)
    rows = []
    curves = sorted({(unit, task, ablation) for unit, _, task, ablation in read})
    for first, second in pairs:
        for unit, task, ablation in curves:
            a, b = read.get((unit, first, task, ablation)), read.get((unit, second, task, ablation))
            if a is None or b is None:
                continue
            paired = a.summary.get("counted_prompts_digest") == b.summary.get("counted_prompts_digest")
            draws_a = boot.draws(a.per_prompt["prompt"].nunique())
            draws_b = draws_a if paired else boot.draws(b.per_prompt["prompt"].nunique(), stream=1)
            sizes = (a.summary["components"], b.summary["components"])
            row = {"unit": unit, "task": task, "ablation": ablation, "first": first, "second": second,
                   "paired": paired, "count_first": a.summary.get("heads_to_reach_threshold"),
                   "count_second": b.summary.get("heads_to_reach_threshold")}
            ratio = ratio_between(a.per_prompt, b.per_prompt, paired, threshold, boot)
            counts = (row["count_first"], row["count_second"])
            row.update({"n_x": counts[0] / counts[1] if all(counts) else None,
                        "n_x_low": ratio["low"], "n_x_high": ratio["high"]})
            for where in ("mib", "grid"):
                try:
                    difference = area_difference(a.per_prompt, b.per_prompt, sizes, draws_a, draws_b,
                                                 boot.confidence, where)
                except ValueError as error:  # MIB's sizes not measured: said, never interpolated
                    difference = {"mib_missing": str(error),
                                  **{f"{name}_difference{end}": None for name in ("cpr", "cmd")
                                     for end in ("", "_low", "_high")}}
                row.update({f"{key.replace('difference', where + '_difference')}": value
                            for key, value in difference.items()})
            gap = kept_gap(a.summary, b.summary, boot) if unit == "heads" else {}
            row.update({key: gap.get(key) for key in ("kept_gap", "kept_gap_low", "kept_gap_high")})
            rows.append(row)
    return pd.DataFrame(rows)


def circuit_areas(inputs: dict[str, dict[str, str]], pairs: list, threshold: float, bootstrap: dict,
                  outputs: dict[str, str], dpi: int) -> None:
    """results/tables/areas.csv (every curve), area_differences.csv (every compared pair) and,
    per ablation, seed 004's figure of the head curves (``outputs["figures"]``: ablation -> path)."""
    from attnlab.plots.areas import plot_task_panels

    read = read_sweeps(inputs)
    areas = area_rows(read, bootstrap)
    differences = difference_rows(read, [tuple(pair) for pair in pairs], threshold, bootstrap)
    io.write_csv(areas, outputs["areas"])
    io.write_csv(differences, outputs["differences"])
    for ablation, path in outputs["figures"].items():
        curves = {(model, task): swept for (unit, model, task, abl), swept in read.items()
                  if unit == "heads" and abl == ablation}
        plot_task_panels(curves, areas[(areas["unit"] == "heads") & (areas["ablation"] == ablation)],
                         differences[(differences["unit"] == "heads") & (differences["ablation"] == ablation)]
                         if len(differences) else differences,
                         threshold, ablation, path, dpi)
