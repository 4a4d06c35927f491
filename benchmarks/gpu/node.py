"""The GPU measurements, from a checkout, on any CUDA machine, into one JSON.

    .venv/bin/python -m benchmarks.gpu.node                       # every section but sparse, ~5 min on an H100
    .venv/bin/python -m benchmarks.gpu.node --sections checks extraction training
    .venv/bin/python -m benchmarks.gpu.node --sections sparse     # the sparse copy of config/sparse-gpu.yaml
    .venv/bin/python -m benchmarks.gpu.node --sections scale      # full-depth random 8B models, every stage
    .venv/bin/python -m benchmarks.gpu.node --smoke               # tiny sizes, any device: does it run?

SmolLM2-135M-Instruct is read from ``--model-dir`` (default: ``resources/models/smollm2-135m``,
which ``snakemake --until prepare_model`` writes on a login node; without it the model is
converted from its wheel into benchmarks/out/, which needs the project's install). Sections,
each timed and written as it ends (a failing section records its error and the rest go on):

- ``checks``: the fused kernels against the eager blocks on this card, float32 (checks.py);
- ``extraction``: received attention of 4 × 2,048 tokens, bf16, against a plain sdpa forward;
- ``training``: a post-training step of 16 × 1,024 tokens against plain fine-tuning;
  both then profile their kernel paths and plain anchors once (profiles.py), traces in traces/;
- ``generation``: every engine on 64 GSM8K chat prompts, 256 new tokens, batch 64;
- ``generation-gemma3``: Gemma-3-270M base (``--gemma-dir``, else ``resources/models/gemma3-270m``,
  else converted from its wheel), ``static`` and ``static_cache`` on the same items with 4
  few-shot examples and the default config's stop strings (prompts of 315–401 tokens: a row
  passes its sliding layers' 512-token window only if it decodes more than about 110 tokens;
  ``longest_row_tokens`` says how far the longest went);
- ``edges``: EAP-IG scoring and one circuit at the IOI crossing, 256 prompts;
- ``sparse`` (not in the default): post-trains the copy of ``config/sparse-gpu.yaml``
  (benchmarks/gpu/sparse_regime.py) and counts the heads of the dense model and the copy
  (benchmarks/sparse/heads.py) into ``--out``'s folder;
- ``scale`` (not in the default): random Llama-3.1-8B and OLMo-7B at their full depth through
  every stage (benchmarks/scale/measure.py, ``--warm-up``), each model under ``--scale-deadline-s``, into
  scale/ beside ``--out`` (a JSON and a log per model; ``benchmarks/scale/fit.py`` reads the JSONs).

The JSON (default benchmarks/out/gpu.json) names the card, the versions and every setting.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import yaml

# a machine's own Python, without the project installed, imports attnlab from this checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from benchmarks.tools.harness import OUT, REPO, embedded_model, versions  # noqa: E402

SPARSE_TASKS = ("ioi", "docstring", "greater_than", "ioi_long")  # the first two as on the CPU
SECTIONS = ("checks", "extraction", "training", "generation", "generation-gemma3", "edges", "sparse", "scale")
DEFAULT_SECTIONS = SECTIONS[:-2]
FULL = {"checks": ((300, 231, 180), 128), "extraction": (4, 2048), "training": (16, 1024),
        "generation": (64, 256, 64), "edges": (256, [20000]),
        "scale": {"models": ["llama3.1-8b", "olmo-7b"], "layers": 0, "stages": None}}  # 0: the full depth
SMOKE = {"checks": ((24, 19, 12), 16), "extraction": (1, 64), "training": (2, 64), "generation": (4, 8, 2),
         "edges": (4, [100]), "scale": {"models": ["gpt2"], "layers": 1, "stages": ["extraction"]}}


def _model_dir(given: str | None, name: str = "smollm2-135m") -> Path:
    if given:
        return Path(given)
    prepared = REPO / "resources" / "models" / name
    return prepared if (prepared / "config.json").is_file() else embedded_model(name)


def _recipe() -> dict:
    """The sparse copy's settings of config/sparse-gpu.yaml, validated (defaults filled)."""
    from attnlab.config.schema import validate_config

    config = yaml.safe_load((REPO / "config" / "sparse-gpu.yaml").read_text())
    validate_config(config, REPO / "config" / "schema.yaml")
    return config["models"]["smollm2-135m-sparse"]["source"]["sparsify"]


def _gsm8k_prompts(items: int, model: str = "smollm2-135m"):
    from benchmarks.tools.harness import gsm8k_workload

    return lambda tokenizer: gsm8k_workload(tokenizer, model, items)


def _section(name: str, model_dir: Path, device: torch.device, sizes: dict, args) -> dict:
    import benchmarks.gpu.checks as gpu_checks
    import benchmarks.gpu.speed as gpu_speed

    if name == "checks":
        return gpu_checks.kernel_checks(model_dir, device, *sizes["checks"])
    if name == "extraction":
        return gpu_speed.extraction_speed(model_dir, device, *sizes["extraction"], args.repeats, _traces(args))
    if name == "training":
        return gpu_speed.training_speed(model_dir, device, _recipe(), *sizes["training"], args.repeats, _traces(args))
    if name == "generation":
        items, new_tokens, batch = sizes["generation"]
        return gpu_speed.generation_speed(model_dir, device, _gsm8k_prompts(items), batch, new_tokens)
    if name == "generation-gemma3":
        from benchmarks.tools.harness import GENERATION_MODELS

        items, new_tokens, batch = sizes["generation"]
        gemma = _model_dir(args.gemma_dir, "gemma3-270m")
        measured = gpu_speed.generation_speed(gemma, device, _gsm8k_prompts(items, "gemma3-270m"), batch,
                                              new_tokens, GENERATION_MODELS["gemma3-270m"]["stops"],
                                              engines=("static", "static_cache"))
        return {**measured, "model_dir": str(gemma), "model_converted_by": converted_by(gemma)}
    if name == "edges":
        prompts, keep = sizes["edges"]
        return gpu_speed.edge_speed(model_dir, device, prompts, keep, steps=5)
    if name == "scale":
        return _scale(sizes["scale"], device, model_dir, Path(args.out).parent / "scale", args.scale_deadline_s)
    return _sparse_regime(model_dir, Path(args.sparse_dir) if args.sparse_dir else Path(args.out).parent / "sparse_gpu")


def _traces(args) -> Path:
    """Where the profiled runs' traces go: traces/ beside the JSON."""
    return Path(args.out).parent / "traces"


def _sparse_regime(model_dir: Path, folder: Path) -> dict:
    """Post-train the copy, then count heads of the dense model and of the copy (subprocesses: the
    scripts a user runs by hand, each writing its log to ``folder``/<step>.log as it goes, so a
    run stopped by a deadline keeps what it logged)."""
    model_dir, folder = model_dir.resolve(), folder.resolve()  # the scripts run in the checkout's root
    train = [sys.executable, "-m", "benchmarks.gpu.sparse_regime", "--config", str(REPO / "config" / "sparse-gpu.yaml"),
             "--model", "smollm2-135m-sparse", "--base-dir", str(model_dir), "--out", str(folder / "run")]
    heads = [sys.executable, "-m", "benchmarks.sparse.heads", "measure", "--n", "192", "--ablations", "corrupted",
             "--rankings", "exact", "--batch-size", "1024", "--out", str(folder / "heads")]
    models = {"dense": str(model_dir), "sparse": str(folder / "run" / "model")}
    # task by task, the dense model's count then the copy's: a run stopped by its deadline keeps
    # paired counts of the tasks it finished (benchmarks/sparse/heads.py appends each task as it ends)
    counts = [(f"heads_{label}_{task}", heads + ["--tasks", task, "--label", label, "--model", models[label]])
              for task in SPARSE_TASKS for label in ("dense", "sparse")]
    done = {}
    folder.mkdir(parents=True, exist_ok=True)
    for label, command in [("post_training", train), *counts]:
        started = time.perf_counter()
        log = folder / f"{label}.log"
        with log.open("w") as stream:
            finished = subprocess.run(command, cwd=REPO, stdout=stream, stderr=subprocess.STDOUT, text=True)
        done[label] = {"seconds": time.perf_counter() - started, "returncode": finished.returncode,
                       "log": str(log), "log_tail": log.read_text()[-2000:]}
        if finished.returncode and label == "post_training":
            break  # no copy to count; a failing count leaves the other tasks to run
    summary = folder / "run" / "summary.json"
    done["summary"] = json.loads(summary.read_text()) if summary.is_file() else None
    return done


def _scale(sizes: dict, device: torch.device, model_dir: Path, folder: Path, deadline_s: float) -> dict:
    """benchmarks/scale/measure.py on random models of the papers' shapes (SmolLM2's tokenizer from ``model_dir``), each
    model with its own deadline (a model stopped by it keeps the stages it finished) and its own
    log and JSON in ``folder``."""
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    done = {}
    for model in sizes["models"]:
        out, log = folder / f"scale_{model}.json", folder / f"scale_{model}.log"
        command = [sys.executable, "-m", "benchmarks.scale.measure", "--models", model, "--layers", str(sizes["layers"]),
                   "--device", device.type, "--warm-up", "--deadline-s", str(deadline_s), "--out", str(out),
                   "--tokenizer-dir", str(Path(model_dir).resolve()), *(["--stages", *sizes["stages"]] if sizes["stages"] else [])]
        started = time.perf_counter()
        with log.open("w") as stream:
            finished = subprocess.run(command, cwd=REPO, stdout=stream, stderr=subprocess.STDOUT, text=True)
        rows = json.loads(out.read_text())["rows"] if out.is_file() else []
        done[model] = {"seconds": time.perf_counter() - started, "returncode": finished.returncode,
                       "log": str(log), "json": str(out), "rows": rows}
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(DEFAULT_SECTIONS))
    parser.add_argument("--model-dir", help="a prepared SmolLM2-135M-Instruct (default: see above)")
    parser.add_argument("--gemma-dir", help="a prepared Gemma-3-270M (default: see above)")
    parser.add_argument("--out", default=str(OUT / "gpu.json"),
                        help="the JSON (on a borrowed machine, a folder that comes back, e.g. $OUT/gpu.json)")
    parser.add_argument("--sparse-dir", help="where --sections sparse writes the copy, head counts and logs "
                                             "(default: sparse_gpu/ beside --out)")
    parser.add_argument("--scale-deadline-s", type=float, default=240,
                        help="--sections scale: each model's deadline (default 240 s)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: check that every section runs")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        sys.exit("benchmarks/gpu/node.py measures a CUDA device and this machine has none (--smoke runs it anyway)")
    sizes = SMOKE if args.smoke else FULL
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "smoke": args.smoke,
              "versions": {**versions(), "triton": _triton()}, "sizes": sizes, "sections": args.sections}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))  # before any model work: a short window keeps this
    _run_sections(result, out, args, device, sizes)


def _run_sections(result: dict, out: Path, args, device: torch.device, sizes: dict) -> None:
    """Each section in turn, the JSON rewritten as each ends; a failing one (the model's conversion
    included) records its error and the rest go on."""
    model_dir = None
    for name in args.sections:
        started = time.perf_counter()
        try:
            if model_dir is None:  # converting the model (minutes without a prepared one) can fail too
                model_dir = _model_dir(args.model_dir)
                result["model_dir"] = str(model_dir)
                result["model_converted_by"] = converted_by(model_dir)
            result[name] = _section(name, model_dir, device, sizes, args)
        except Exception as error:  # noqa: BLE001 -- one section failing must not lose the others
            result[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
        result[name]["section_seconds"] = time.perf_counter() - started
        out.write_text(json.dumps(result, indent=2, default=str))  # every section as it ends
        print(json.dumps({name: result[name]}, indent=2, default=str), flush=True)


def converted_by(model_dir: Path) -> dict | None:
    """The torch and transformers that wrote a prepared model (its attnlab_source.json): a model
    converted under another transformers can answer differently (Gemma-3 under 5.17 did)."""
    provenance = Path(model_dir) / "attnlab_source.json"
    if not provenance.is_file():
        return None
    recorded = json.loads(provenance.read_text())
    return {key: recorded.get(key) for key in ("torch", "transformers", "source")}


def _triton() -> str | None:
    from attnlab.attention.fused import triton_version

    return triton_version()


if __name__ == "__main__":
    main()
