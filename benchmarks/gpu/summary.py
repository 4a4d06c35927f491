"""The figures of a benchmarks/gpu/node.py run in a few lines (on a remote GPU node the end of a
command's output is often what comes back first): each JSON's sections with their ratios, errors
and timings, and the sparse copy's density and head counts.

    python -m benchmarks.gpu.summary FOLDER     # the folder holding gpu*.json (and sparse_gpu/)
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path


def _rounded(value):
    if isinstance(value, float):  # three significant figures: a difference of 1e-6 must not read 0
        return float(f"{value:.3g}")
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    return value


PROFILE_KEYS = ("wall_ms", "device_busy_ms", "launches", "host_waits")


def section_lines(name: str, section: dict) -> list[str]:
    """One line per figure a reader checks against the issue's targets."""
    if "error" in section:
        return [f"  {name}: ERROR {section['error'][:200]}"]
    seconds = round(section.get("section_seconds", -1))
    keys = {"extraction": ["throughput_vs_plain"], "training": ["throughput_vs_plain", "errors"],
            "edges": ["scoring_in_forward_backwards", "evaluation_in_forwards"],
            "checks": ["dense_extraction", "sparse_inference", "training_step"]}.get(name)
    if keys is not None:
        return [f"  {name} ({seconds} s): {key} {json.dumps(_rounded(section.get(key)))}" for key in keys] + [
            f"    profile {path}: {json.dumps(_rounded({k: v for k, v in profiled.items() if k in PROFILE_KEYS}))}"
            for path, profiled in (section.get("profile") or {}).items()]
    if name.startswith("generation"):
        rates = {run: round(value["useful_tokens_per_s"]) if "useful_tokens_per_s" in value else value.get("error")
                 for run, value in section.items() if isinstance(value, dict) and ("seconds" in value or "error" in value)}
        same = {key: value for key, value in section.items() if key.startswith("same_tokens")}
        return [f"  {name} ({seconds} s): useful tokens/s {json.dumps(rates)}", f"    {json.dumps(same)}"]
    if name == "scale":
        return [line for model, run in section.items() if isinstance(run, dict) for line in _scale_lines(model, run)]
    return [f"  {name} ({seconds} s): {json.dumps(_rounded(section))[:400]}"]


def _scale_lines(model: str, run: dict) -> list[str]:
    """Per model: its depth, whether its deadline stopped it, and each stage's seconds and peak MiB
    above the model at each workload."""
    lines = [f"  scale {model} ({round(run['seconds'])} s, rc {run['returncode']})"]
    for row in run.get("rows", []):
        stopped = " STOPPED AT ITS DEADLINE" if row.get("timed_out") else " FAILED" if row.get("failed") else ""
        lines.append(f"    {row['layers']} layers, model {row.get('model_mib', 0) / 1024:.1f} GiB{stopped}")
        for stage, workloads in row.get("stages", {}).items():
            figures = {workload: [round(measured["seconds"], 2), round(measured["peak_above_mib"])]
                       for workload, measured in workloads.items()}
            lines.append(f"      {stage} [s, MiB]: {json.dumps(figures)}")
    return lines


def summary(folder: Path) -> list[str]:
    lines = []
    for path in sorted(folder.glob("gpu*.json")):
        result = json.loads(path.read_text())
        lines.append(f"{path.name}: {result.get('device')} {json.dumps(result.get('versions'))}")
        for name in result.get("sections", []):
            if isinstance(result.get(name), dict):
                lines += section_lines(name, result[name])
    run_summary = folder / "sparse_gpu" / "run" / "summary.json"
    if run_summary.is_file():
        lines.append(f"sparse copy: {json.dumps(_rounded(json.loads(run_summary.read_text())))[:600]}")
    for table in sorted((folder / "sparse_gpu" / "heads").glob("heads_*.csv")):
        for row in csv.DictReader(table.open()):
            lines.append(f"heads {row.get('label')} {row.get('task')}: {row.get('heads_to_reach_threshold')} "
                         f"(density {row.get('heldout_density')}, KL {row.get('heldout_kl')})")
    return lines


if __name__ == "__main__":
    print("\n".join(summary(Path(sys.argv[1]))))
