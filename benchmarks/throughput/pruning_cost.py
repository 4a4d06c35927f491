"""Cost of head scoring and sweeps in forward-pass equivalents, exact patching's two paths side by
side, and the rank agreement of attribution with exact patching, measured in one run.

    .venv/bin/python -m benchmarks.throughput.pruning_cost [--n 16] [--tasks ioi greater_than ...]
                                               [--hand-layers 0 15 29] [--device auto] [--dtype auto]

For each embedded model (converted into benchmarks/out/ once) and task: the time of one patched
forward over the task's prompts is the unit (the median of 3, before and after the exact paths);
the same forward with the LM head's input made contiguous is a second unit (transformers slices
the last positions, and torch then multiplies row by row: a large part of a forward on Gemma-3's
262,144-token vocabulary), the fairer one for the resumed path, which does the same. Attribution
(clean forward, corrupted forward, backward), exact patching by one forward per head (the path
before) and by resumed passes (``Patcher.exact``), and the sweep's cost per k are divided by it.
Both exact paths must agree (max_abs_diff), and the resumed one must agree with an independent
computation written here: every head of the ``--hand-layers`` patched by a hand-written o_proj
pre-hook, one prompt at a time with no padding (hand_max_abs_diff).
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial

import torch
from scipy.stats import spearmanr

from attnlab.circuits.curves import k_grid
from attnlab.interventions.readout import contiguous_input
from attnlab.patching.heads import Patcher, build_batch
from attnlab.patching.tasks import GENERATORS, generate_task
from benchmarks.tools.harness import (EMBEDDED_MODELS, OUT, TINY_FAMILIES, add_device_arguments, device_and_dtype, load_embedded, median_seconds,
                    run_fields, timed, versions)


def unit_forward(patcher: Patcher, contiguous_head: bool = False) -> float:
    """Median seconds of 3 patched forwards over every prompt (all gates at 1)."""
    ones = torch.ones(patcher.gates.n_layers, patcher.gates.n_heads)
    head = patcher.model.get_output_embeddings()
    handle = head.register_forward_pre_hook(contiguous_input) if contiguous_head else None
    seconds = median_seconds(partial(patcher.metric, ones))
    if handle is not None:
        handle.remove()
    return seconds


def by_hand(model, prompts, tokenizer, layers: list[int]) -> torch.Tensor:
    """Corrupted patching of every head of ``layers``, one prompt at a time (no padding), by a
    pre-hook on o_proj written here; the metric as IOI/Docstring define it (logit[answer] − max
    logit[distractors]). NaN for the heads of other layers."""
    config = model.config.get_text_config()
    heads, head_dim = config.num_attention_heads, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    scores = torch.full((config.num_hidden_layers, heads), float("nan"), dtype=torch.float64)
    scores[layers] = 0
    for index, (clean, corrupted) in enumerate(zip(prompts.clean, prompts.corrupted)):
        clean_ids = torch.tensor([tokenizer(clean).input_ids], device=model.device)
        corrupted_ids = torch.tensor([tokenizer(corrupted).input_ids], device=model.device)

        def metric(logits):
            last = logits[0, -1].double()
            return float(last[prompts.answers[index]] - last[prompts.distractors[index]].max())
        with torch.no_grad():
            full = metric(model(clean_ids).logits)
            for layer in layers:
                o_proj = _out_projection(model, layer)
                seen = {}
                handle = o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("z", a[0].clone()))
                model(corrupted_ids)
                handle.remove()
                for head in range(heads):
                    part = slice(head * head_dim, (head + 1) * head_dim)

                    def patch(module, args):
                        z = args[0].clone()
                        z[..., part] = seen["z"][..., part]
                        return (z,)
                    handle = o_proj.register_forward_pre_hook(patch)
                    scores[layer, head] += full - metric(model(clean_ids).logits)
                    handle.remove()
    return scores / len(prompts.clean)


def _out_projection(model, layer: int):
    """The attention's output projection of a block, found here by hand (GPT-2: c_proj)."""
    if model.config.model_type == "gpt2":
        return model.transformer.h[layer].attn.c_proj
    return model.get_decoder().layers[layer].self_attn.o_proj


def measure(name: str, model, tokenizer, task: str, n: int, hand_layers: list[int]) -> dict:
    prompts = generate_task(task, tokenizer, n, seed=0)
    patcher = Patcher(model, build_batch(prompts, tokenizer), "corrupted", batch_size=512)
    layers, heads = patcher.gates.n_layers, patcher.gates.n_heads
    before = unit_forward(patcher)
    contiguous = unit_forward(patcher, contiguous_head=True)
    attribution, attribution_s = timed(patcher.attribution)
    one_per_head, one_per_head_s = timed(patcher.exact_one_forward_per_head)
    resumed, resumed_s = timed(patcher.exact)
    unit = statistics.mean([before, unit_forward(patcher)])
    ks = k_grid(layers * heads)[:: max(1, layers * heads // 20)]
    order = [(l, h) for l in range(layers) for h in range(heads)]
    _, sweep_s = timed(partial(list, map(patcher.metric, [patcher.kept(order, k) for k in ks])))
    row = {"model": name, "task": task, "prompts": n, "heads": layers * heads,
           "formulation": prompts.info.get("formulation", ""),
           "clean_metric": round(patcher.metric(), 3), "corrupted_metric": round(patcher.corrupted_metric(), 3),
           "forward_s": round(unit, 3), "forward_contiguous_head_s": round(contiguous, 3),
           "attribution_forward_equivalents": round(attribution_s / unit, 2),
           "exact_one_forward_per_head_fe_per_head": round(one_per_head_s / unit / (layers * heads), 3),
           "exact_resumed_fe_per_head": round(resumed_s / unit / (layers * heads), 3),
           "exact_resumed_fe_per_head_vs_contiguous": round(resumed_s / contiguous / (layers * heads), 3),
           "exact_speedup": round(one_per_head_s / resumed_s, 2),
           "max_abs_diff": float((resumed - one_per_head).abs().max()),
           "max_abs_score": float(one_per_head.abs().max()),
           "sweep_forward_equivalents_per_k": round(sweep_s / len(ks) / unit, 2),
           "spearman_attribution_vs_exact": round(float(spearmanr(attribution.flatten(), resumed.flatten()).statistic), 3)}
    if hand_layers and task != "greater_than":
        hand = by_hand(model, prompts, tokenizer, hand_layers)
        row.update(hand_layers=hand_layers,
                   hand_max_abs_diff=float((resumed[hand_layers].double() - hand[hand_layers]).abs().max()),
                   hand_max_abs_diff_one_forward_per_head=float(
                       (one_per_head[hand_layers].double() - hand[hand_layers]).abs().max()))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--tasks", nargs="+", default=list(GENERATORS))
    parser.add_argument("--models", nargs="+", default=list(EMBEDDED_MODELS),
                        help=f"embedded models, or random ones of the paper's families: {list(TINY_FAMILIES)}")
    parser.add_argument("--hand-layers", nargs="*", type=int, default=[0],
                        help="layers whose heads are also patched by hand, one prompt at a time")
    add_device_arguments(parser)
    args = parser.parse_args()
    device, dtype = device_and_dtype(args)
    report = []
    for name in args.models:
        model, tokenizer = load_embedded(name, device, dtype)
        layers = model.config.get_text_config().num_hidden_layers
        hand_layers = [layer for layer in args.hand_layers if layer < layers]
        for task in args.tasks:
            # one row a line (a JSON list in the file): each says where it ran
            row = {**measure(name, model, tokenizer, task, args.n, hand_layers), **run_fields(device, dtype),
                   "versions": versions()}
            print(json.dumps(row), flush=True)
            report.append(row)
    OUT.mkdir(exist_ok=True)
    (OUT / "pruning_cost.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
