"""Cost of head scoring and sweeps in forward-pass equivalents, and the rank
agreement of attribution with exact patching, measured in one run.

    .venv/bin/python benchmarks/pruning_cost.py [--n 16] [--tasks ioi greater_than ...]

For each embedded model (converted into benchmarks/out/ once) and task: the
time of one patched forward over the task's prompts is the unit (the median
of 3); attribution (clean forward, corrupted forward, backward), exact
patching (one forward per head) and the sweep's cost per k are divided by
it. Spearman: attribution scores vs exact patching scores over all heads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial

import torch
from scipy.stats import spearmanr

from attnlab.models import load_model, load_tokenizer
from attnlab.curves import k_grid
from attnlab.pruning import Patcher, build_batch
from attnlab.tasks import GENERATORS, generate_task
from common import EMBEDDED_MODELS, OUT, embedded_model



def timed(run):
    started = time.perf_counter()
    result = run()
    return result, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--tasks", nargs="+", default=list(GENERATORS))
    parser.add_argument("--models", nargs="+", default=list(EMBEDDED_MODELS))
    args = parser.parse_args()
    report = []
    for name in args.models:
        model_dir = embedded_model(name)
        tokenizer = load_tokenizer(model_dir)
        model = load_model(model_dir, torch.device("cpu"), torch.float32)
        for task in args.tasks:
            prompts = generate_task(task, tokenizer, args.n, seed=0)
            patcher = Patcher(model, build_batch(prompts, tokenizer), "corrupted", batch_size=512)
            layers, heads = patcher.gates.n_layers, patcher.gates.n_heads
            ones = torch.ones(layers, heads)
            unit = statistics.median(timed(partial(patcher.metric, ones))[1] for _ in range(3))
            attribution, attribution_s = timed(patcher.attribution)
            exact, exact_s = timed(patcher.exact)
            ks = k_grid(layers * heads)[:: max(1, layers * heads // 20)]
            order = [(l, h) for l in range(layers) for h in range(heads)]
            kept = [_kept(order, k, layers, heads) for k in ks]
            _, sweep_s = timed(partial(list, map(patcher.metric, kept)))
            row = {"model": name, "task": task, "prompts": args.n, "heads": layers * heads,
                   "formulation": prompts.info.get("formulation", ""),
                   "clean_metric": round(patcher.metric(), 3),
                   "corrupted_metric": round(patcher.corrupted_metric(), 3),
                   "forward_s": round(unit, 3),
                   "attribution_forward_equivalents": round(attribution_s / unit, 2),
                   "exact_forward_equivalents": round(exact_s / unit, 1),
                   "sweep_forward_equivalents_per_k": round(sweep_s / len(ks) / unit, 2),
                   "spearman_attribution_vs_exact": round(float(spearmanr(attribution.flatten(),
                                                                          exact.flatten()).statistic), 3)}
            print(json.dumps(row), flush=True)
            report.append(row)
    (OUT / "pruning_cost.json").write_text(json.dumps(report, indent=2))


def _kept(order, k, layers, heads):
    gates = torch.zeros(layers, heads)
    for layer, head in order[:k]:
        gates[layer, head] = 1
    return gates


if __name__ == "__main__":
    main()
