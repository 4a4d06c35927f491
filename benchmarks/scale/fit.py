"""Fit the cost table (``attnlab.cost.model``) to ``benchmarks/scale/measure.py``'s measurements, and say
how well it predicts each of them.

    .venv/bin/python -m benchmarks.scale.fit [benchmarks/out/scale_cpu.json ...] [--repeats REPEATED.json ...]
                                             [--write] [--markdown PATH]

Given several results, a later file's measurement of the same model, depth, stage and workload
replaces an earlier one (a stage measured again on a quiet machine). ``--repeats``: the same
measurements taken again, each averaged with the first, and their differences printed: the
measurement's own spread (a peak of tens of MiB above the model moves by tens of percent from
one run to the next with what the allocator keeps).

Memory: per stage, the bytes per element of each term of ``cost.features`` that is not counted
exactly (``cost.EXACT``: one element each), and a constant, by non-negative least squares on the
relative error (each measurement's row divided by its peak, so a 100 MB stage counts as much as
a 10 GB one). Time: per stage and device kind, seconds per unit of each of ``cost.time_features``, by the
same non-negative least squares. Printed: every measurement beside
its prediction; the largest memory error and time factor per stage; the same for the deepest
models when the fit leaves them out (its reach in depth); OLMo-7B's edge circuits projected to
all 32 layers.
``--write``: the table into ``src/attnlab/cost/cost_coefficients.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from attnlab.cost import model as cost
from benchmarks.scale.measure import CONFIGS, MEDIATION_TOKENS, MODELS


def stage_rows(result: dict) -> list[dict]:
    """One row per measurement: cost stage, shape, workload, peak bytes, seconds, device kind."""
    rows = []
    device = "cuda" if str(result.get("device", "cpu")).startswith("cuda") else "cpu"
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[result.get("dtype", "float32").replace("torch.", "")]
    for row in result["rows"]:
        if "failed" in row or "model_mib" not in row:  # a run stopped before its model was built: nothing measured
            continue
        shape = cost.Shape.of(_config_of(row))
        for stage, workloads in row["stages"].items():
            for name, measured in workloads.items():
                kind, work = _cost_stage(stage, name, measured, row["stages"])
                rows.append({"model": row["model"], "layers": row["layers"], "stage": kind, "workload": name,
                             "shape": shape, "work": work, "peak": measured["peak_above_mib"] * 2**20,
                             "model_bytes": row["model_mib"] * 2**20,
                             "seconds": measured["seconds"], "device": device, "dtype_bytes": dtype_bytes,
                             "warm_up": bool(result.get("warm_up"))})
    return rows


def _cost_stage(stage: str, name: str, measured: dict, stages: dict) -> tuple[str, dict]:
    if stage == "edges" and name.startswith("score"):
        return "edge_scores", measured
    if stage == "edges":  # rows measured before measure.py recorded a batch's points: the scores' batch of 8
        scored = stages["edges"].get("score batch=8", {})
        return "edge_circuit", {"points_per_batch": scored.get("points_per_batch"), **measured}
    if stage == "mediation":  # rows measured before measure.py recorded the treated sequence's length
        return stage, {"prompts": measured["items"], "tokens": sum(measured[k] for k in MEDIATION_TOKENS),
                       "scored": measured["continuation"] + 1, **measured}
    if stage == "heads":  # rows measured before measure.py recorded its forwards: 2 and the sweep's 5
        return stage, {"forwards": 7, **measured}
    return stage, measured


def merged_rows(results: list[str], repeats: list[str]) -> tuple[list[dict], dict[str, tuple[float, float]]]:
    """The measurements of ``results`` (a later file's measurement of the same model, depth, stage
    and workload replaces an earlier one: measured again on a quiet machine), each averaged with
    its repeat in ``repeats`` where both were taken alike (with or without ``measure.py --warm-up``);
    and per stage the largest difference between a measurement and its repeat (peak: relative to
    the smaller; time: a factor)."""
    merged, spread = {}, {}
    for path in results:
        for row in stage_rows(json.loads(Path(path).read_text())):
            merged[(row["model"], row["layers"], row["stage"], row["workload"])] = row
    for path in repeats:
        for row in stage_rows(json.loads(Path(path).read_text())):
            key = (row["model"], row["layers"], row["stage"], row["workload"])
            first = merged.get(key)
            if first is None or first["warm_up"] != row["warm_up"]:  # a repeat of a measurement since replaced
                continue
            memory, time = spread.get(row["stage"], (0.0, 1.0))
            spread[row["stage"]] = (max(memory, abs(first["peak"] - row["peak"]) / min(first["peak"], row["peak"])),
                                    max(time, first["seconds"] / row["seconds"], row["seconds"] / first["seconds"]))
            merged[key] = {**first, "peak": (first["peak"] + row["peak"]) / 2,
                           "seconds": (first["seconds"] + row["seconds"]) / 2, "repeated": True}
    return list(merged.values()), spread


def fit(rows: list[dict]) -> dict:
    """{stage: coefficients and fit quality}."""
    table = {}
    for stage in sorted({row["stage"] for row in rows}):
        mine = [row for row in rows if row["stage"] == stage]
        names = list(cost.features(stage, mine[0]["shape"], mine[0]["work"]))
        fitted_names = [name for name in names if name not in cost.EXACT.get(stage, ())]
        values = [cost.features(stage, row["shape"], row["work"]) for row in mine]
        peaks = np.array([row["peak"] for row in mine])
        exact = np.array([sum(v[name] for name in cost.EXACT.get(stage, ())) * row["dtype_bytes"]
                          for v, row in zip(values, mine)])
        design = np.array([[1.0, *(v[name] for name in fitted_names)] for v in values])
        coefficients, _ = nnls(design / peaks[:, None], 1 - exact / peaks)  # relative error
        predicted = exact + design @ coefficients
        memory = {name: (mine[0]["dtype_bytes"] if name in cost.EXACT.get(stage, ())
                         else float(coefficients[1 + fitted_names.index(name)])) for name in names}
        seconds_per, times = {}, np.zeros(len(mine))
        for device in sorted({row["device"] for row in mine}):  # seconds = sum of coefficient x time feature
            at = [i for i, row in enumerate(mine) if row["device"] == device]
            seconds = np.array([mine[i]["seconds"] for i in at])
            timed = [cost.time_features(stage, mine[i]["shape"], mine[i]["work"]) for i in at]
            design = np.array([list(features.values()) for features in timed])
            per_feature, _ = nnls(design / seconds[:, None], np.ones(len(at)))
            seconds_per[device] = dict(zip(timed[0], map(float, per_feature)))
            times[at] = design @ per_feature
        table[stage] = {
            "dtype_bytes": mine[0]["dtype_bytes"],
            "memory": memory, "exact": list(cost.EXACT.get(stage, ())), "constant_bytes": float(coefficients[0]),
            "seconds": seconds_per,
            "fit": {"measurements": len(mine),
                    "largest_memory_error": float(np.max(np.abs(predicted / peaks - 1))),
                    # the same errors as a share of the whole peak, the model's own bytes included
                    "largest_whole_peak_error": float(np.max(np.abs(predicted - peaks) / (
                        peaks + np.array([row["model_bytes"] for row in mine])))),
                    "largest_time_factor": float(max(max(t / r["seconds"], r["seconds"] / t) for t, r in zip(times, mine)))},
            "rows": [{"model": r["model"], "layers": r["layers"], "workload": r["workload"],
                      "measured_mib": r["peak"] / 2**20, "predicted_mib": p / 2**20,
                      "seconds": r["seconds"], "predicted_seconds": t} for r, p, t in zip(mine, predicted, times)],
        }
    return table


def extrapolated(table: dict, rows: list[dict], layers: int | None = None) -> dict[str, tuple[float, float]]:
    """{stage: (largest memory error, largest time factor)} of ``table``'s predictions at the
    rows of ``layers`` layers (None: every row)."""
    out = {}
    for stage, fitted in table.items():
        mine = [row for row in rows if row["stage"] == stage and layers in (None, row["layers"])]
        coefficients = {"stages": {stage: fitted}}
        errors, factors = [], []
        for row in mine:
            found = cost.estimate(stage, _config_of(row), row["work"], row["dtype_bytes"], row["device"], coefficients)
            above = found.memory_bytes - found.weights_bytes
            errors.append(abs(above / row["peak"] - 1))
            factors.append(max(found.seconds / row["seconds"], row["seconds"] / found.seconds))
        if mine:
            out[stage] = (max(errors), max(factors))
    return out


def held_out_families(rows: list[dict]) -> dict[str, dict[str, tuple[float, float]]]:
    """{model: {stage: (largest memory error, largest time factor)}}: each model's measurements
    predicted by a fit to the other models' (how the fit carries to a family it has not seen)."""
    models = sorted({row["model"] for row in rows})
    return {model: extrapolated(fit([row for row in rows if row["model"] != model]),
                                [row for row in rows if row["model"] == model]) for model in models}


def with_held_out(table: dict, held_out: dict) -> dict:
    """``table`` with each stage's worst held-out-family errors and the model types fitted (a
    job's request widens an estimate by these for a family the fit has not seen)."""
    for stage, fitted in table.items():
        errors = [found[stage] for found in held_out.values() if stage in found]
        if errors:
            fitted["fit"]["held_out_family"] = {"largest_memory_error": max(e[0] for e in errors),
                                                "largest_time_factor": max(e[1] for e in errors)}
    return table


def _config_of(row: dict) -> dict:
    config = json.loads((CONFIGS / MODELS[row["model"]]).read_text())
    config["n_layer" if config.get("model_type") == "gpt2" else "num_hidden_layers"] = row["layers"]
    return config


def olmo_edges_at_full_depth(table: dict) -> list[str]:
    """The fit's projection of OLMo-7B's edge circuits at all 32 layers in float32 on 64 IOI
    prompts (the tokens and patched points per prompt of TASK_TOKENS), at batches of 4 and 8:
    scoring, a circuit with every recording kept, and one with 6 GB kept (``budget``: the rest
    recorded again one mini-batch at a time)."""
    from attnlab.cost.budget import TASK_TOKENS, within_cache

    config = json.loads((CONFIGS / MODELS["olmo-7b"]).read_text())
    tokens, points, _ = TASK_TOKENS["ioi"]
    coefficients, lines = {"stages": table}, []
    for batch in (4, 8):
        per_batch, everything = round(batch * points), round(64 * points)
        work = {"batch": batch, "tokens": tokens, "points_per_batch": per_batch, "prompts": 64}
        found = cost.estimate("edge_scores", config, work, 4, "cpu", coefficients)
        lines.append(f"OLMo-7B, 32 layers, batch {batch}, EAP-IG scoring: {found.describe()}")
        work.update(points=everything)
        found = cost.estimate("edge_circuit", config, work, 4, "cpu", coefficients)
        lines.append(f"OLMo-7B, 32 layers, batch {batch}, one circuit, every recording kept: {found.describe()}")
        kept = within_cache(found, 6, per_batch / everything)
        lines.append(f"OLMo-7B, 32 layers, batch {batch}, one circuit, cache_gb 6: {kept.describe()}")
    return lines


def markdown(rows: list[dict], table: dict, reach: dict) -> str:
    """Peak MiB above the model and seconds of every measurement, by stage and workload (columns:
    model and layers), then each stage's fit."""
    columns = sorted({(row["model"], row["layers"]) for row in rows}, key=lambda c: (list(MODELS).index(c[0]), c[1]))
    head = "| stage | workload | " + " | ".join(f"{model} {layers}L" for model, layers in columns) + " |"
    lines = [head, "|" + "---|" * (len(columns) + 2)]
    cells = {(row["stage"], row["workload"], row["model"], row["layers"]): row for row in rows}
    for stage, workload in dict.fromkeys((row["stage"], row["workload"]) for row in rows):
        values = [cells.get((stage, workload, model, layers)) for model, layers in columns]
        lines.append(f"| {stage} | {workload} | " + " | ".join(
            "" if v is None else f"{v['peak'] / 2**20:,.0f} MiB, {v['seconds']:.0f} s" for v in values) + " |")
    lines += ["", "| stage | memory: largest error (in-sample) | of the whole peak, model included | time: largest "
              "factor | fitted without the deepest, predicting it: memory, time | each family fitted without it: "
              "memory, time |", "|---|---|---|---|---|---|"]
    for stage, fitted in table.items():
        held, family = reach.get(stage), fitted["fit"].get("held_out_family")
        lines.append(f"| {stage} | {fitted['fit']['largest_memory_error']:.0%} | "
                     f"{fitted['fit']['largest_whole_peak_error']:.0%} | {fitted['fit']['largest_time_factor']:.2f} | "
                     + ("" if held is None else f"{held[0]:.0%}, {held[1]:.2f}") + " | "
                     + ("" if family is None else f"{family['largest_memory_error']:.0%}, "
                        f"{family['largest_time_factor']:.2f}") + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="*", default=[str(Path(__file__).resolve().parents[1] / "out" / "scale_cpu.json")])
    parser.add_argument("--check", nargs="*", default=[],
                        help="results to predict with the fit, not fitted (e.g. another width)")
    parser.add_argument("--repeats", nargs="*", default=[],
                        help="results measured again: each averaged with the same measurement of the results, and "
                             "their differences printed (the measurements' own spread)")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--markdown", help="write the measurements and the fit as a markdown table here")
    args = parser.parse_args()
    rows, spread = merged_rows(args.results, args.repeats)
    for stage, (memory, time) in spread.items():
        print(f"{stage} measured twice: peaks differ by up to {memory:.0%}, times by a factor {time:.2f}")
    checked = [row for path in args.check for row in stage_rows(json.loads(Path(path).read_text()))]
    table = fit(rows)
    deepest = max(row["layers"] for row in rows)
    shallow = [row for row in rows if row["layers"] < deepest]
    reach = extrapolated(fit(shallow), rows, deepest) if shallow else {}
    if reach:  # the fit's reach: coefficients from the shallower models, errors at the deepest
        print(f"fitted without the {deepest}-layer models, predicting them:")
        for stage, (memory, time) in reach.items():
            print(f"  {stage}: memory within {memory:.0%}, time within a factor {time:.2f}")
    if checked:  # measurements the fit did not see (another width)
        print(f"predicting {', '.join(sorted({row['model'] for row in checked}))} (not fitted):")
        for stage, (memory, time) in extrapolated(table, checked).items():
            print(f"  {stage}: memory within {memory:.0%}, time within a factor {time:.2f}")
    held_out = held_out_families(rows) if len({row["model"] for row in rows}) > 1 else {}
    for model, found in held_out.items():  # how the fit carries to a family it has not seen
        print(f"fitted without {model}, predicting it:")
        for stage, (memory, time) in found.items():
            print(f"  {stage}: memory within {memory:.0%}, time within a factor {time:.2f}")
    table = with_held_out(table, held_out)
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, table, reach))
    if "edge_scores" in table and "edge_circuit" in table:
        print("\n".join(olmo_edges_at_full_depth(table)))
    for stage, fitted in table.items():
        print(f"{stage}: memory within {fitted['fit']['largest_memory_error']:.0%}, time within a factor "
              f"{fitted['fit']['largest_time_factor']:.2f} over {fitted['fit']['measurements']} measurements")
        for row in fitted["rows"]:
            print(f"  {row['model']:>16} {row['layers']:>2} layers {row['workload']:<22} "
                  f"{row['measured_mib']:9.0f} MiB (fit {row['predicted_mib']:9.0f})  "
                  f"{row['seconds']:7.1f} s (fit {row['predicted_seconds']:7.1f})")
    if args.write:
        stages = {stage: {key: value for key, value in fitted.items() if key != "rows"}
                  for stage, fitted in table.items()}
        model_types = sorted({json.loads((CONFIGS / MODELS[row["model"]]).read_text())["model_type"] for row in rows})
        out = {"fitted_from": [Path(path).name for path in args.results], "model_types": model_types,
               "stages": stages}
        cost.COEFFICIENTS.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {cost.COEFFICIENTS}")


if __name__ == "__main__":
    main()
