"""One tool, one measurement, one process: the worker behind benchmarks/peers/heads.py.

    PYTHON -m benchmarks.peers.heads_worker TOOL --model DIR --inputs JSON --out PREFIX [--repeats 3] [--threads N]
                                      [--device auto]

TOOL is one of TOOLS below. attnlab and the plain transformers runs use the
project's virtualenv (.venv); TransformerLens and nnsight use .venv-peers, so
this file imports nothing but torch, numpy and transformers at the top and
each tool's library inside its own function. It writes PREFIX.json (times,
memory, versions, or the error that stopped the tool) and PREFIX.npy (the
tool's result: received attention [layers, batch, heads, positions] or head
scores [layers, heads]).

Attention runs: one warm-up, then --repeats timed runs of the whole job
(forward pass and the reduction of the maps to received attention), all
under torch.no_grad(); the full-vocabulary LM head is skipped wherever the
tool allows it (decoder only, or logits_to_keep=1). The unit is a plain sdpa
decoder forward of the same batch, timed in the same process before the first
run and after the last. Peak memory: the growth of the resident set (VmHWM, reset
before each run) above what the process held after the warm-up, with freed
memory returned to the system (model, inputs, buffers), on CPU; torch's peak
allocation on CUDA.

Scoring runs (IOI pairs, metric logit[IO] - logit[S] at the last token): the
unit is one plain forward (sdpa, all logits) of the clean batch, timed in the
same process around the tool's run; the tool's time divided by it is its
forward-pass equivalents.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from benchmarks.peers import measuring  # noqa: E402
from benchmarks.peers.measuring import measure, versions  # noqa: E402
from benchmarks.peers.transformerlens_scoring import scoring_transformerlens  # noqa: E402


# ---------------------------------------------------------------- received attention

def received_of(weights: torch.Tensor) -> torch.Tensor:
    """Received attention [batch, heads, positions] from one layer's maps [batch, heads, q, k].

    received[j] = mean over i > j of A[i, j] (the diagonal left out, NaN at the
    last position): attnlab's definition (attnlab.attention.reduction.METRIC_DEFINITION).
    The prompts are unpadded, so every row is a real query.
    """
    length = weights.shape[-1]
    later = torch.arange(length - 1, -1, -1, device=weights.device, dtype=weights.dtype)
    received = (weights.sum(-2) - weights.diagonal(dim1=-2, dim2=-1)) / later
    received[..., -1] = float("nan")
    return received


def received_from_maps(maps) -> np.ndarray:
    """[layers, batch, heads, positions] from every layer's maps."""
    return torch.stack([received_of(weights).cpu() for weights in maps]).numpy()


def _load_hf(model_dir: str, implementation: str, dtype=torch.float32):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=implementation)
    return model.to(measuring.DEVICE).eval()


def attention_sdpa(model_dir, ids, _):
    """The limit: a plain decoder forward (sdpa), which is also every other run's unit."""
    model = _load_hf(model_dir, "sdpa")

    def run():
        with torch.no_grad():
            model.model(input_ids=ids, use_cache=False)
        return None
    return run


def attention_output_attentions(model_dir, ids, _, dtype=torch.float32):
    model = _load_hf(model_dir, "eager", dtype)

    def run():
        with torch.no_grad():
            out = model.model(input_ids=ids, use_cache=False, output_attentions=True)
            return received_from_maps(out.attentions)
    return run


def attention_eager64(model_dir, ids, _):
    """The eager reference in float64 (untimed: the scale of float32 rounding)."""
    return attention_output_attentions(model_dir, ids, _, torch.float64)


def attention_attnlab(model_dir, ids, _):
    import pandas as pd

    from attnlab.extraction.extract import extract
    from attnlab.models import load_model

    model = load_model(model_dir, measuring.DEVICE, torch.float32)
    batch, length = ids.shape
    # extract() takes prompts as a table; the inserted span only feeds λ, not received attention.
    prompts = pd.DataFrame({"id": [f"p{i}" for i in range(batch)], "input_ids": ids.cpu().tolist(),
                            "n_prompt_tokens": length, "inserted_start": 0, "inserted_end": 0})

    def run():
        result = extract(model, prompts, batch, [])
        # per layer [heads, batch, positions] -> [layers, batch, heads, positions]
        return np.stack(result.received).transpose(0, 2, 1, 3)
    return run


def attention_transformerlens(model_dir, ids, _):
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(model_dir, device=measuring.DEVICE, dtype=torch.float32)
    names = [f"blocks.{layer}.attn.hook_pattern" for layer in range(bridge.cfg.n_layers)]

    def run():
        with torch.no_grad():
            _, cache = bridge.run_with_cache(ids, names_filter=names, logits_to_keep=1)
            return received_from_maps([cache[name] for name in names])
    return run


def attention_transformerlens_hook(model_dir, ids, _):
    """The memory-lean way: reduce each layer's pattern in a hook, keep no maps."""
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(model_dir, device=measuring.DEVICE, dtype=torch.float32)
    layers = bridge.cfg.n_layers

    def run():
        received = [None] * layers

        def keep(layer):
            def hook(pattern, hook):
                received[layer] = received_of(pattern.float()).cpu()
            return hook
        with torch.no_grad():
            bridge.run_with_hooks(ids, fwd_hooks=[(f"blocks.{layer}.attn.hook_pattern", keep(layer))
                                                  for layer in range(layers)], logits_to_keep=1)
        return torch.stack(received).numpy()
    return run


def _nnsight_model(model_dir):
    from nnsight import TransformersModel

    model = TransformersModel(model_dir, task="text-generation", dispatch=True, dtype=torch.float32,
                              attn_implementation="eager")
    model.to(measuring.DEVICE)
    return model, model.config.get_text_config().num_hidden_layers


def attention_nnsight_reduced(model_dir, ids, _):
    """The memory-lean way: reduce each layer's weights inside the trace, save only that."""
    model, layers = _nnsight_model(model_dir)

    def run():
        saved = []
        with torch.no_grad(), model.trace(ids, logits_to_keep=1):
            for layer in range(layers):
                saved.append(received_of(model.model.layers[layer].self_attn.output[1].float()).save())
        return torch.stack([r.cpu() for r in saved]).numpy()
    return run


def attention_nnsight(model_dir, ids, _):
    model, layers = _nnsight_model(model_dir)

    def run():
        saved = []
        with torch.no_grad(), model.trace(ids, logits_to_keep=1):
            for layer in range(layers):
                saved.append(model.model.layers[layer].self_attn.output[1].save())
        return received_from_maps(saved)
    return run


# ---------------------------------------------------------------- IOI head scores

def _left_padded(rows, pad_id):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def scoring_unit(model_dir, ioi):
    """One plain forward (sdpa, all logits) of the clean batch, left padded as attnlab pads."""
    model = _load_hf(model_dir, "sdpa")
    ids, mask, positions = (t.to(measuring.DEVICE) for t in _left_padded(ioi["clean"], ioi["pad_id"]))

    def run():
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    return run


def scoring_attnlab(model_dir, ioi, method):
    from attnlab.models import load_model
    from attnlab.patching.heads import Patcher, build_batch
    from attnlab.patching.tasks import generate_task
    from attnlab.tokenization import load_tokenizer

    model = load_model(model_dir, measuring.DEVICE, torch.float32)
    tokenizer = load_tokenizer(model_dir)
    batch = build_batch(generate_task("ioi", tokenizer, ioi["n"], seed=ioi["seed"]), tokenizer)
    # The peers get these very pairs (benchmarks/peers/heads.py); the driver checks they match.
    check = {"clean": [row[m.bool()].tolist() for row, m in zip(batch.clean, batch.mask)],
             "corrupted": [row[m.bool()].tolist() for row, m in zip(batch.corrupted, batch.mask)]}

    def run():
        # The corrupted forward that captures the references is part of the cost.
        patcher = Patcher(model, batch, "corrupted", batch_size=512)
        scores = patcher.attribution() if method == "attribution" else patcher.exact()
        return scores.numpy()

    def warm():  # one forward: weights resident, kernels built, before memory is counted
        with torch.no_grad():
            model(input_ids=batch.clean.to(measuring.DEVICE), attention_mask=batch.mask.to(measuring.DEVICE), use_cache=False)

    def metrics():  # untimed
        patcher = Patcher(model, batch, "corrupted", batch_size=512)
        return {"clean_metric": patcher.metric(), "corrupted_metric": patcher.corrupted_metric()}
    return run, {"pairs": check, "metrics": metrics, "warm": warm}


TOOLS = {
    "attention:sdpa": attention_sdpa,
    "attention:output_attentions": attention_output_attentions,
    "attention:eager64": attention_eager64,
    "attention:attnlab": attention_attnlab,
    "attention:transformerlens": attention_transformerlens,
    "attention:nnsight": attention_nnsight,
    "attention:transformerlens_hook": attention_transformerlens_hook,
    "attention:nnsight_reduced": attention_nnsight_reduced,
    "scoring:attnlab_attribution": lambda d, ioi: scoring_attnlab(d, ioi, "attribution"),
    "scoring:attnlab_exact": lambda d, ioi: scoring_attnlab(d, ioi, "exact"),
    "scoring:transformerlens_exact": lambda d, ioi: scoring_transformerlens(d, ioi, "exact"),
    "scoring:transformerlens_exact_denoising":
        lambda d, ioi: scoring_transformerlens(d, ioi, "exact_denoising"),
    "scoring:transformerlens_attribution": lambda d, ioi: scoring_transformerlens(d, ioi, "attribution"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tool", choices=sorted(TOOLS))
    parser.add_argument("--model", required=True)
    parser.add_argument("--inputs", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    args = parser.parse_args()
    if args.device != "auto":  # every tool reads measuring.DEVICE when it runs
        measuring.DEVICE = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    inputs = json.loads(Path(args.inputs).read_text())
    report = {"tool": args.tool, "model": args.model, "versions": versions(), "ok": False}
    out = Path(args.out)
    kind = args.tool.split(":")[0]
    stage = "load"
    try:
        started = time.perf_counter()
        if kind == "attention":
            ids = torch.tensor(inputs["attention_ids"], device=measuring.DEVICE)
            run = TOOLS[args.tool](args.model, ids, inputs)
            unit = None if args.tool == "attention:sdpa" else attention_sdpa(args.model, ids, inputs)
        else:
            run, extra = TOOLS[args.tool](args.model, inputs["ioi"])
            if "pairs" in extra:
                report["pairs"] = extra["pairs"]
            unit = scoring_unit(args.model, inputs["ioi"])
        report["load_s"] = round(time.perf_counter() - started, 2)
        stage = "run"
        if args.tool == "attention:eager64":  # context for the float32 differences: untimed
            result = run()
        elif kind == "attention" or args.tool.endswith("attribution"):
            result, stats = measure(run, unit, args.repeats)
            report.update(stats)
        else:  # exact patching: hundreds of forwards in one run, after one plain forward
            extra["warm"]()
            result, stats = measure(run, unit, 1, warm_up=False, unit_each=3)
            report.update(stats)
            report["heads_patched"] = int(np.isfinite(result).sum())
        if result is not None:
            np.save(out.with_suffix(".npy"), result)
        if kind == "scoring":
            report["forward_equivalents"] = report["unit_ratio"]
            stage = "metrics"
            report.update(extra["metrics"]())
        report["ok"] = True
    except Exception as error:  # noqa: BLE001 - a tool that fails is a result
        first = str(error).strip().splitlines()[0][:400] if str(error).strip() else ""
        report["error"] = f"{stage}: {type(error).__name__}" + (f": {first}" if first else "")
        report["traceback"] = traceback.format_exc()[-4000:]
        traceback.print_exc()
    out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=float))


if __name__ == "__main__":
    main()
