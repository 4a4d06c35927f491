"""Fit the cost table (``attnlab.config.cost``) to ``benchmarks/scale.py``'s measurements, and say
how well it predicts each of them.

    .venv/bin/python benchmarks/scale_fit.py [benchmarks/out/scale_cpu.json ...] [--write]

Memory: per stage, the bytes per element of each term of ``cost.features`` that is not counted
exactly (``cost.EXACT``: one element each), and a constant, by non-negative least squares on the
relative error (each measurement's row divided by its peak, so a 100 MB stage counts as much as
a 10 GB one). Time: per stage and device kind, one factor in
seconds per unit of ``cost.work_units``, the geometric mean of the measured ratios. Printed: every
measurement beside its prediction; the largest memory error and time factor per stage.
``--write``: the table into ``src/attnlab/config/cost_coefficients.json``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from attnlab.config import cost
from scale import CONFIGS, MODELS


def stage_rows(result: dict) -> list[dict]:
    """One row per measurement: cost stage, shape, workload, peak bytes, seconds, device kind."""
    rows = []
    device = "cuda" if str(result.get("device", "cpu")).startswith("cuda") else "cpu"
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[result.get("dtype", "float32").replace("torch.", "")]
    for row in result["rows"]:
        if "failed" in row:
            continue
        shape = cost.Shape.of(_config_of(row))
        for stage, workloads in row["stages"].items():
            for name, measured in workloads.items():
                kind, work = _cost_stage(stage, name, measured, row["stages"])
                rows.append({"model": row["model"], "layers": row["layers"], "stage": kind, "workload": name,
                             "shape": shape, "work": work, "peak": measured["peak_above_mib"] * 2**20,
                             "seconds": measured["seconds"], "device": device, "dtype_bytes": dtype_bytes})
    return rows


def _cost_stage(stage: str, name: str, measured: dict, stages: dict) -> tuple[str, dict]:
    if stage == "edges" and name.startswith("score"):
        return "edge_scores", measured
    if stage == "edges":  # rows measured before scale.py recorded a batch's points: the scores' batch of 8
        scored = stages["edges"].get("score batch=8", {})
        return "edge_circuit", {"points_per_batch": scored.get("points_per_batch"), **measured}
    return stage, measured


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
        per_unit = {}
        for device in sorted({row["device"] for row in mine}):
            ratios = [row["seconds"] / cost.work_units(stage, row["shape"], row["work"])
                      for row in mine if row["device"] == device]
            per_unit[device] = math.exp(np.mean(np.log(ratios)))
        times = [per_unit[row["device"]] * cost.work_units(stage, row["shape"], row["work"]) for row in mine]
        table[stage] = {
            "dtype_bytes": mine[0]["dtype_bytes"],
            "memory": memory, "exact": list(cost.EXACT.get(stage, ())), "constant_bytes": float(coefficients[0]),
            "seconds_per_unit": per_unit,
            "fit": {"measurements": len(mine),
                    "largest_memory_error": float(np.max(np.abs(predicted / peaks - 1))),
                    "largest_time_factor": float(max(max(t / r["seconds"], r["seconds"] / t) for t, r in zip(times, mine)))},
            "rows": [{"model": r["model"], "layers": r["layers"], "workload": r["workload"],
                      "measured_mib": r["peak"] / 2**20, "predicted_mib": p / 2**20,
                      "seconds": r["seconds"], "predicted_seconds": t} for r, p, t in zip(mine, predicted, times)],
        }
    return table


def extrapolated(table: dict, rows: list[dict], layers: int) -> dict[str, tuple[float, float]]:
    """{stage: (largest memory error, largest time factor)} of ``table``'s predictions at the
    rows of ``layers`` layers."""
    out = {}
    for stage, fitted in table.items():
        mine = [row for row in rows if row["stage"] == stage and row["layers"] == layers]
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


def _config_of(row: dict) -> dict:
    config = json.loads((CONFIGS / MODELS[row["model"]]).read_text())
    config["n_layer" if config.get("model_type") == "gpt2" else "num_hidden_layers"] = row["layers"]
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="*", default=[str(Path(__file__).parent / "out" / "scale_cpu.json")])
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    rows = [row for path in args.results for row in stage_rows(json.loads(Path(path).read_text()))]
    table = fit(rows)
    deepest = max(row["layers"] for row in rows)
    shallow = [row for row in rows if row["layers"] < deepest]
    if shallow:  # the fit's reach: coefficients from the shallower models, errors at the deepest
        print(f"fitted without the {deepest}-layer models, predicting them:")
        for stage, fitted in extrapolated(fit(shallow), rows, deepest).items():
            print(f"  {stage}: memory within {fitted[0]:.0%}, time within a factor {fitted[1]:.2f}")
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
        out = {"fitted_from": [Path(path).name for path in args.results], "stages": stages}
        cost.COEFFICIENTS.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {cost.COEFFICIENTS}")


if __name__ == "__main__":
    main()
