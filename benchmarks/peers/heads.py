"""attnlab side by side with TransformerLens and nnsight, measured in one run.

    make bench-peers            (installs .venv-peers, prepares the models, runs this)
    .venv/bin/python -m benchmarks.peers.heads [--models smollm2-135m gemma3-270m] [--threads 1] [--device auto]

Every tool runs in its own process (benchmarks/peers/heads_worker.py): attnlab and
plain transformers with the project's .venv, TransformerLens and nnsight with
.venv-peers (benchmarks/peers/requirements.txt; the project's torch and
transformers), all on the prepared models in resources/models/, offline, in float32 on
--device (auto: CUDA when present; every process the same).

1. Received attention (mean over i > j of A[i, j], every layer and head) of
   --batch x --length tokens of MATH-500 text: attnlab's extraction,
   TransformerLens run_with_cache on the hook_pattern hooks, nnsight saving each
   layer's attention weights, the same two reducing each layer as it comes
   (a hook, the trace), transformers output_attentions=True (eager: the
   reference) and a plain sdpa decoder forward (the limit: no attention
   returned, and every process's unit). Median of --repeats after a warm-up;
   peak memory above the loaded model; max abs difference from the float32
   eager reference (and, for scale, from the reference computed in float64).
2. Scoring every head on --pairs IOI pairs (attnlab.patching.tasks, corrupted = ABC
   names, metric logit[IO] - logit[S]): attnlab's attribution and exact
   patching (a head of the clean run ablated with its corrupted output);
   TransformerLens's per-head activation patching in its own direction
   (get_act_patch_attn_head_out_all_pos: the corrupted run patched from the
   clean cache) and in attnlab's (every --same-direction-every-th head, a
   check that the numbers are attnlab's), and its attribution_patch (node
   scores of attn_head_out summed over positions). Seconds, forward-pass
   equivalents (the unit forward is timed in the same process, around the
   run) and rank agreement (Spearman / Kendall) with the exact scores of
   both directions.

The first model gets the full measurement; later ones (Gemma-3) a smaller one
(--check-batch, --check-length, --check-pairs, --check-repeats) that shows
whether each tool loads and agrees. A tool that fails is recorded with its
error. Writes benchmarks/out/peers.{md,json}, per-process files and logs under
benchmarks/out/peers/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from scipy.stats import kendalltau, spearmanr

from attnlab.patching.tasks import generate_task
from attnlab.tokenization import load_tokenizer
from benchmarks.tools.harness import OUT, math500_prompts

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "resources" / "models"
WORKER = "benchmarks.peers.heads_worker"  # run as a module from the checkout's root, in either virtualenv
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"

ATTENTION = [  # (tool, label, virtualenv)
    ("attention:sdpa", "plain forward, sdpa (the limit: no attention returned)", "project"),
    ("attention:output_attentions", "transformers `output_attentions=True` (eager: the reference)", "project"),
    ("attention:attnlab", "**attnlab** extraction (reducing attention)", "project"),
    ("attention:transformerlens", "TransformerLens `run_with_cache`, `hook_pattern` of every layer", "peers"),
    ("attention:nnsight", "nnsight, `self_attn.output[1].save()` of every layer", "peers"),
    ("attention:transformerlens_hook", "TransformerLens `run_with_hooks`, each `hook_pattern` reduced in its hook",
     "peers"),
    ("attention:nnsight_reduced", "nnsight, each layer's weights reduced inside the trace, only that saved",
     "peers"),
]
REFERENCE64 = ("attention:eager64", "eager float64 (context, untimed)", "project")
SCORING = [
    ("scoring:attnlab_attribution", "**attnlab** attribution (gates, 1 corrupted + 1 clean forward + 1 backward)",
     "project"),
    ("scoring:attnlab_exact", "**attnlab** exact patching (one forward per head)", "project"),
    ("scoring:transformerlens_exact_denoising", "TransformerLens `get_act_patch_attn_head_out_all_pos` "
     "(its direction: the corrupted run patched from the clean cache)", "peers"),
    ("scoring:transformerlens_exact", "TransformerLens `generic_activation_patch`, attnlab's direction "
     "(the clean run patched from the corrupted cache)", "peers"),
    ("scoring:transformerlens_attribution", "TransformerLens `attribution_patch` (node scores of each head "
     "summed over positions; gradient at the corrupted run)", "peers"),
]
EXACT = "scoring:attnlab_exact"  # ablating one head of the clean run (noising)
DENOISING = "scoring:transformerlens_exact_denoising"  # restoring one head in the corrupted run


def inputs_for(model_dir: Path, args) -> dict:
    """The token ids every tool gets: MATH-500 text and the IOI pairs, under this model's tokenizer."""
    tokenizer = load_tokenizer(model_dir)
    attention = math500_prompts(tokenizer, args.batch, args.length)["input_ids"].tolist()
    prompts = generate_task("ioi", tokenizer, args.pairs, seed=0)
    return {"attention_ids": attention,
            "ioi": {"n": args.pairs, "seed": 0, "pad_id": tokenizer.pad_token_id,
                    "clean": [tokenizer(p).input_ids for p in prompts.clean],
                    "corrupted": [tokenizer(p).input_ids for p in prompts.corrupted],
                    "answers": list(prompts.answers), "distractors": [d[0] for d in prompts.distractors]}}


def run_tool(tool: str, venv: str, model_dir: Path, inputs: Path, out: Path, repeats: int, args) -> dict:
    python = sys.executable if venv == "project" else str(args.peer_python)
    prefix = out / tool.replace(":", "_")
    for suffix in (".json", ".npy"):
        prefix.with_suffix(suffix).unlink(missing_ok=True)
    command = [python, "-m", WORKER, tool, "--model", str(model_dir), "--inputs", str(inputs),
               "--out", str(prefix), "--repeats", str(repeats), "--threads", str(args.threads),
               "--device", args.device]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "TQDM_MININTERVAL": "30"}
    env.pop("PYTHONPATH", None)  # each virtualenv sees only its own packages
    started = time.perf_counter()
    print(f"  {tool} ...", end="", flush=True)
    with open(prefix.with_suffix(".log"), "w") as log:
        try:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                  timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    wall = time.perf_counter() - started
    if prefix.with_suffix(".json").exists():
        report = json.loads(prefix.with_suffix(".json").read_text())
    else:  # crashed before writing (killed, out of memory, import error) or timed out
        tail = prefix.with_suffix(".log").read_text()[-1500:].strip().splitlines()
        report = {"tool": tool, "ok": False,
                  "error": f"process ended ({code}) without a result: {tail[-1] if tail else ''}"}
    report["process_wall_s"] = round(wall, 1)
    print(f" {'ok' if report.get('ok') else 'FAILED: ' + report.get('error', '')} ({wall:.0f} s)", flush=True)
    return report


def finite_max_diff(a: np.ndarray, b: np.ndarray) -> dict:
    if a.shape != b.shape:
        return {"error": f"shape {a.shape} vs {b.shape}"}
    same_nan = bool((np.isnan(a) == np.isnan(b)).all())
    both = ~np.isnan(a) & ~np.isnan(b)
    return {"max_abs_diff": float(np.abs(a[both].astype(np.float64) - b[both]).max()), "same_nan": same_nan}


def rank_agreement(a: np.ndarray, b: np.ndarray) -> dict:
    """Over the heads both scored (a check run scores a subset; the rest is NaN)."""
    both = np.isfinite(a) & np.isfinite(b)
    return {"spearman": float(spearmanr(a[both], b[both]).statistic),
            "kendall": float(kendalltau(a[both], b[both]).statistic), "heads": int(both.sum())}


def load_result(out: Path, tool: str):
    path = (out / tool.replace(":", "_")).with_suffix(".npy")
    return np.load(path) if path.exists() else None


def measure_model(name: str, args, full: bool) -> dict:
    model_dir = MODELS / name
    if not (model_dir / "config.json").exists():
        raise SystemExit(f"{model_dir} is missing: prepare it with `.venv/bin/snakemake --cores 1 "
                         f"resources/models/{name}` (make bench-peers does)")
    out = OUT / "peers" / name
    out.mkdir(parents=True, exist_ok=True)
    size = argparse.Namespace(batch=args.batch, length=args.length, pairs=args.pairs) if full else \
        argparse.Namespace(batch=args.check_batch, length=args.check_length, pairs=args.check_pairs)
    inputs = inputs_for(model_dir, size)
    inputs["ioi"]["same_direction_every"] = args.same_direction_every
    (out / "inputs.json").write_text(json.dumps(inputs))
    repeats = args.repeats if full else args.check_repeats
    print(f"{name}: {size.batch} x {size.length} tokens, {size.pairs} IOI pairs, {repeats} timed run(s) each",
          flush=True)
    reports = {}
    for tool, _, venv in [*ATTENTION, REFERENCE64, *SCORING]:
        reports[tool] = run_tool(tool, venv, model_dir, out / "inputs.json", out, repeats, args)

    reference, reference64 = load_result(out, "attention:output_attentions"), load_result(out, REFERENCE64[0])
    for tool, _, _ in ATTENTION:
        result = load_result(out, tool)
        if result is not None and reference is not None:
            reports[tool]["vs_eager"] = finite_max_diff(result, reference)
        if result is not None and reference64 is not None:
            reports[tool]["vs_eager64"] = finite_max_diff(result, reference64)

    exact = load_result(out, EXACT)
    pairs = reports[EXACT].get("pairs")
    if pairs is not None and (pairs["clean"] != inputs["ioi"]["clean"]
                              or pairs["corrupted"] != inputs["ioi"]["corrupted"]):
        reports[EXACT]["warning"] = "attnlab's IOI pairs differ from the ones the peers got"
    denoising = load_result(out, DENOISING)
    for tool, _, _ in SCORING:
        reports[tool].pop("pairs", None)
        result = load_result(out, tool)
        if result is not None and exact is not None:
            reports[tool]["vs_attnlab_exact"] = rank_agreement(result, exact)
        if result is not None and denoising is not None:
            reports[tool]["vs_denoising_exact"] = rank_agreement(result, denoising)
    tl_exact = load_result(out, "scoring:transformerlens_exact")
    if tl_exact is not None and exact is not None:
        reports["scoring:transformerlens_exact"]["max_abs_diff_vs_attnlab_exact"] = \
            float(np.nanmax(np.abs(tl_exact - exact)))
    attribution, tl_attribution = (load_result(out, "scoring:attnlab_attribution"),
                                   load_result(out, "scoring:transformerlens_attribution"))
    if attribution is not None and tl_attribution is not None:
        reports["scoring:transformerlens_attribution"]["vs_attnlab_attribution"] = \
            rank_agreement(tl_attribution, attribution)
    heads = exact.size if exact is not None else None
    return {"model": name, "repeats": repeats, "batch": size.batch, "length": size.length,
            "pairs": size.pairs, "heads": heads, "tools": reports}


# ---------------------------------------------------------------- report

def _num(value, digits=2, suffix=""):
    return "—" if value is None else f"{value:.{digits}f}{suffix}"


def _diff(report, key):
    found = report.get(key)
    if not found:
        return "—"
    if "error" in found:
        return found["error"]
    text = "0" if found["max_abs_diff"] == 0 else f"{found['max_abs_diff']:.1e}"
    return text if found["same_nan"] else text + " (NaN positions differ)"


def _error(report):
    return f"**error**: `{report.get('error', '?')}`"


def attention_table(result: dict) -> list[str]:
    tools = result["tools"]
    lines = ["| tool | s (median) | × plain sdpa forward | peak above model, MiB | max abs diff vs eager float32 "
             "| vs eager float64 |", "| --- | --- | --- | --- | --- | --- |"]
    for tool, label, _ in ATTENTION:
        r = tools[tool]
        if not r.get("ok"):
            lines.append(f"| {label} | {_error(r)} | | | | |")
            continue
        ratio = 1.0 if tool == "attention:sdpa" else r.get("unit_ratio")
        diff = "reference" if tool == "attention:output_attentions" else _diff(r, "vs_eager")
        if tool == "attention:sdpa":
            diff = "(no attention)"
        lines.append(f"| {label} | {_num(r.get('median_s'))} | {_num(ratio, 2, '×')} | "
                     f"{_num(r.get('peak_above_model_mib'), 0)} | {diff} | "
                     f"{'—' if tool == 'attention:sdpa' else _diff(r, 'vs_eager64')} |")
    return lines


def _agreement(report, key, reference):
    if reference:
        return "reference"
    found = report.get(key)
    return "—" if not found else f"{found['spearman']:.3f} / {found['kendall']:.3f}"


def scoring_table(result: dict) -> list[str]:
    tools = result["tools"]
    lines = ["| method | s | forward-pass equivalents | peak above model, MiB | rank agreement with attnlab "
             "exact (ablating a head), Spearman / Kendall | with TransformerLens exact, its direction "
             "(restoring a head) |", "| --- | --- | --- | --- | --- | --- |"]
    for tool, label, _ in SCORING:
        r = tools[tool]
        if not r.get("ok"):
            lines.append(f"| {label} | {_error(r)} | | | | |")
            continue
        heads = r.get("heads_patched")
        if heads is not None and result.get("heads") and heads < result["heads"]:
            label += f", {heads} of {result['heads']} heads"
        lines.append(f"| {label} | {_num(r.get('median_s'), 1)} | {_num(r.get('forward_equivalents'), 1)} | "
                     f"{_num(r.get('peak_above_model_mib'), 0)} | "
                     f"{_agreement(r, 'vs_attnlab_exact', tool == EXACT)} | "
                     f"{_agreement(r, 'vs_denoising_exact', tool == DENOISING)} |")
    return lines


def markdown(results: list[dict], args, started: str, wall: float) -> str:
    first = results[0]
    tools = first["tools"]
    versions = {}
    for r in tools.values():
        versions.update({k: v for k, v in r.get("versions", {}).items()
                         if k in ("torch", "transformers", "transformer_lens", "nnsight", "threads", "device",
                                  "device_name")})
    lines = [f"# attnlab side by side with TransformerLens and nnsight ({started}, {wall / 60:.1f} min)", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), "",
             f"## Received attention, {first['model']}, {first['batch']} × {first['length']} tokens, "
             f"all layers and heads (median of {first['repeats']} after a warm-up)", "",
             *attention_table(first), "",
             f"## Scoring all heads on {first['pairs']} IOI pairs, {first['model']}", "",
             *scoring_table(first), ""]
    unit = tools[EXACT].get("unit_s")
    tl_exact = tools["scoring:transformerlens_exact"]
    notes = []
    if unit:
        notes.append(f"unit forward (sdpa, {first['pairs']} clean prompts, all logits): {unit:.3f} s")
    if "max_abs_diff_vs_attnlab_exact" in tl_exact:
        notes.append(f"TransformerLens patching in attnlab's direction vs attnlab exact: max abs diff "
                     f"{tl_exact['max_abs_diff_vs_attnlab_exact']:.1e} over {tl_exact.get('heads_patched')} heads")
    tl_attr = tools["scoring:transformerlens_attribution"].get("vs_attnlab_attribution")
    if tl_attr:
        notes.append(f"TransformerLens attribution vs attnlab attribution: Spearman {tl_attr['spearman']:.3f}")
    metric = tools[EXACT]
    if "clean_metric" in metric:
        notes.append(f"IOI metric clean {metric['clean_metric']:.2f}, corrupted {metric['corrupted_metric']:.2f}")
    notes += [f"**warning** ({r['model']}): {r['tools'][EXACT]['warning']}"
              for r in results if "warning" in r["tools"][EXACT]]
    lines += ["; ".join(notes) + ".", ""] if notes else []
    for other in results[1:]:
        lines += [f"## {other['model']}: does each tool load and agree? ({other['batch']} × {other['length']} "
                  f"tokens, {other['pairs']} IOI pairs, {other['repeats']} timed run each)", "",
                  *attention_table(other), "", *scoring_table(other), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check-repeats", type=int, default=1, help="timed runs for the later models")
    parser.add_argument("--check-batch", type=int, default=1, help="attention batch for the later models")
    parser.add_argument("--check-length", type=int, default=128, help="attention length for the later models")
    parser.add_argument("--check-pairs", type=int, default=4, help="IOI pairs for the later models")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per process (0: torch's default). One by default: on a shared "
                             "machine more threads than free cores slow small forwards several-fold")
    parser.add_argument("--same-direction-every", type=int, default=10,
                        help="TransformerLens patching in attnlab's direction on every n-th head only "
                             "(a check that the numbers agree)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds before a tool's process is stopped")
    parser.add_argument("--peer-python", type=Path, default=PEERS_PYTHON)
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    args = parser.parse_args()
    if not args.peer_python.exists():
        raise SystemExit(f"{args.peer_python} is missing: `make bench-peers` creates it")
    started, clock = time.strftime("%Y-%m-%d %H:%M"), time.perf_counter()
    results = [measure_model(name, args, full=i == 0) for i, name in enumerate(args.models)]
    wall = time.perf_counter() - clock
    (OUT / "peers.json").write_text(json.dumps({"started": started, "wall_s": round(wall, 1),
                                                "cpu_count": os.cpu_count(), "args": {
                                                    k: str(v) for k, v in vars(args).items()},
                                                "results": results}, indent=2, default=float))
    text = markdown(results, args, started, wall)
    (OUT / "peers.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
