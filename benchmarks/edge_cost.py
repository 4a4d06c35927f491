"""Cost of edge circuits in forward-pass equivalents, and the memory they hold, measured in one run.

    .venv/bin/python benchmarks/edge_cost.py [--model smollm2-135m] [--task ioi] [--n 24]
                                            [--steps 5] [--keep 100 1000 10000 60000]

On the embedded model (converted into benchmarks/out/ once), over ``--n`` prompts of the task in
one batch: the units are one forward over the prompts (the edge machinery installed, nothing
patched: the same readout as every pass here) and one forward-and-backward (the gradient of the
metric with respect to the input embeddings). EAP-IG scoring (a recording forward and
``--steps`` forward-and-backward passes) is divided by the second, the exact evaluation of a
circuit keeping the top n edges (the corrupted run recorded beforehand, once for every n) by
the first: each the median of several ratios (``--scoring-repeats`` for scoring,
``--evaluation-repeats`` for an evaluation) to its unit timed just before it, so that a drifting
clock (a shared machine) moves both sides of a ratio. A patched pass runs the layers'
projections and MLPs only at the ``patched_points`` (from each prompt's first clean/corrupted
difference on) of the batch's ``points_in_the_batch``, so a small circuit can cost less than a
forward. Memory: the peak
resident size above the loaded model's, after each stage (ru_maxrss, which only grows), beside
the bytes of the per-sender activations a batch holds. ``mixing_gflop``: the sums that mix each
receiver's input from its senders (``EdgePatch``), beside a forward's.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch

from attnlab.edge_circuits import EdgeCircuits, ranked_edges
from attnlab.edges import Graph, Plan
from attnlab.models import load_model, load_tokenizer
from attnlab.pruning import build_batch
from attnlab.tasks import generate_task
from common import OUT, embedded_model


def median_seconds(run, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def ratio_to_forward(run, forward, repeats: int = 5) -> float:
    """The median over ``repeats`` of run's time over ``forward``'s (the unit) timed just
    before it."""
    ratios = []
    for _ in range(repeats):
        ratios.append(median_seconds(run, 1) / median_seconds(forward, 1))
    return statistics.median(ratios)


def mixing_flop(graph: Graph, kept: torch.Tensor, points: int, hidden: int) -> float:
    """The multiply-adds (×2) that sum each receiver's senders into its input: every row of the
    plan (each summing receiver's base and the senders it sums, from whichever base sums fewer)
    at every patched point (``EdgePatch``: an embedding bag per point and receiver)."""
    return Plan.of(graph, kept).terms * points * hidden * 2


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def forward_backward(circuits: EdgeCircuits) -> None:
    """One forward and backward of the metric with respect to the input embeddings."""
    batch, device = circuits.batch, circuits.device  # every input on the model's device (CUDA too)
    embeds = circuits.model.get_input_embeddings()(batch.clean.to(device)).detach().requires_grad_(True)
    logits = circuits.model(inputs_embeds=embeds, attention_mask=batch.mask.to(device),
                            position_ids=circuits.positions.to(device), use_cache=False,
                            logits_to_keep=2).logits
    (batch.metric(logits, slice(0, batch.n_prompts)).sum() / batch.n_prompts).backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", default="ioi")
    parser.add_argument("--n", type=int, default=24)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--keep", type=int, nargs="+", default=[100, 1000, 10000, 60000])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scoring-repeats", type=int, default=3)
    parser.add_argument("--evaluation-repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    path = embedded_model(args.model)
    tokenizer = load_tokenizer(path)
    model = load_model(path, torch.device("cpu"), torch.float32)
    batch = build_batch(generate_task(args.task, tokenizer, args.n, 0), tokenizer)
    circuits = EdgeCircuits(model, batch, batch_size=len(batch.clean))
    circuits.metric()  # warm up
    loaded_mib = peak_mib()
    forward = median_seconds(circuits.metric)
    model.requires_grad_(False)
    forward_backward_s = median_seconds(lambda: forward_backward(circuits))
    started = time.perf_counter()
    scores = circuits.scores(args.steps)
    scoring_s = time.perf_counter() - started
    scoring_mib = peak_mib() - loaded_mib
    scoring_ratios = [scoring_s / forward_backward_s] + [
        ratio_to_forward(lambda: circuits.scores(args.steps), lambda: forward_backward(circuits), 1)
        for _ in range(args.scoring_repeats - 1)]
    order = ranked_edges(circuits.graph, scores).sort_values("rank").index.to_numpy()
    circuits.corrupted  # recorded once, before the timed evaluations
    masks = {n: circuits.kept(order, n) for n in args.keep}
    evaluations = {n: ratio_to_forward(lambda n=n: circuits.metric(masks[n]), circuits.metric, args.evaluation_repeats)
                   for n in args.keep}
    graph, shape = circuits.graph, batch.clean.shape
    points = len(batch.differing_points(slice(0, len(batch.clean))))
    senders_mib = graph.n_senders * shape[0] * shape[1] * model.config.hidden_size * 4 / 2**20
    result = {
        "model": args.model, "task": args.task, "prompts": args.n, "tokens_per_prompt": shape[1],
        "edges": graph.n_edges, "steps": args.steps, "threads": args.threads,
        "forward_s": forward, "forward_backward_s": forward_backward_s,
        "forward_backward_in_forwards": forward_backward_s / forward,
        "scoring_s": scoring_s, "scoring_in_forward_backwards": statistics.median(scoring_ratios),
        "scoring_in_forward_backwards_each_run": scoring_ratios,
        "scoring_target_forward_backwards": args.steps + 2,
        "evaluation_in_forwards": {str(n): ratio for n, ratio in evaluations.items()},
        "evaluation_repeats": args.evaluation_repeats,
        "evaluation_target_forwards": 1.5,
        "patched_points": points, "points_in_the_batch": shape[0] * shape[1],
        "mixing_gflop": {str(n): mixing_flop(graph, masks[n], points, model.config.hidden_size) / 1e9
                         for n in args.keep},
        "forward_gflop": 2 * sum(p.numel() for name, p in model.named_parameters() if "embed" not in name)
        * shape[0] * shape[1] / 1e9,
        "peak_above_model_mib": {"scoring": scoring_mib, "scoring_and_evaluation": peak_mib() - loaded_mib},
        "one_recording_of_every_sender_mib": senders_mib,
    }
    OUT.mkdir(exist_ok=True)
    target = OUT / f"edge_cost_{args.model}_{args.task}.json"
    target.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
