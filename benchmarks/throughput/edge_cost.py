"""Cost of edge circuits in forward-pass equivalents, and the memory they hold, measured in one run.

    .venv/bin/python -m benchmarks.throughput.edge_cost [--model smollm2-135m] [--task ioi] [--n 24]
                                            [--steps 5] [--keep 100 1000 10000 60000]
                                            [--device auto] [--dtype auto]

On the embedded model (converted into benchmarks/out/ once), over ``--n`` prompts of the task in
one batch: the units are one forward over the prompts (the edge machinery installed, nothing
patched: the same readout as every pass here) and one forward-and-backward (the gradient of the
metric with respect to the input embeddings). EAP-IG scoring (a recording forward and
``--steps`` forward-and-backward passes) is divided by the second, the exact evaluation of a
circuit keeping the top n edges (the corrupted run recorded beforehand, once for every n) by
the first: each the median of several ratios (``--scoring-repeats`` for scoring,
``--evaluation-repeats`` for an evaluation) to its unit timed right after it, so that a drifting
clock (a shared machine) moves both sides of a ratio. A patched pass runs the layers'
projections and MLPs only at the ``patched_points`` (from each prompt's first clean/corrupted
difference on) of the batch's ``points_in_the_batch``, so a small circuit can cost less than a
forward. Memory: the peak
above the loaded model's, after each stage (CPU: the resident set's high-water mark; CUDA:
torch's peak allocation; both only grow), beside the bytes of the per-sender activations a
batch holds. ``mixing_gflop``: the sums that mix each
receiver's input from its senders (``EdgePatch``), beside a forward's.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from attnlab.interventions.edges import Graph, Plan
from attnlab.patching.edges import EdgeCircuits, ranked_edges
from attnlab.patching.heads import build_batch
from attnlab.patching.tasks import generate_task
from benchmarks.tools.harness import (add_device_arguments, device_and_dtype, forward_backward, load_embedded, median_seconds, peak_mib, ratio_to_unit,
                    timed, write_result)


def mixing_flop(graph: Graph, kept: torch.Tensor, points: int, hidden: int) -> float:
    """The multiply-adds (×2) that sum each receiver's senders into its input: every row of the
    plan (each summing receiver's base and the senders it sums, from whichever base sums fewer)
    at every patched point (``EdgePatch``: an embedding bag per point and receiver)."""
    return Plan.of(graph, kept).terms * points * hidden * 2


def scoring_cost(circuits: EdgeCircuits, steps: int, repeats: int) -> tuple[torch.Tensor, dict]:
    """EAP-IG's scores, and its time in forward-and-backward equivalents: the first run (the one
    whose memory is measured) against the unit's median, then ``repeats`` - 1 ratios to a unit
    timed right after each run."""
    forward_backward_s = median_seconds(lambda: forward_backward(circuits))
    scores, scoring_s = timed(lambda: circuits.scores(steps))
    ratios = [scoring_s / forward_backward_s] + [
        ratio_to_unit(lambda: circuits.scores(steps), lambda: forward_backward(circuits), 1)
        for _ in range(repeats - 1)]
    return scores, {"forward_backward_s": forward_backward_s, "scoring_s": scoring_s,
                    "scoring_in_forward_backwards": statistics.median(ratios),
                    "scoring_in_forward_backwards_each_run": ratios}


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
    add_device_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device, dtype = device_and_dtype(args)
    model, tokenizer = load_embedded(args.model, device, dtype)
    batch = build_batch(generate_task(args.task, tokenizer, args.n, 0), tokenizer)
    circuits = EdgeCircuits(model, batch, batch_size=len(batch.clean))
    circuits.metric()  # warm up
    loaded_mib = peak_mib(device)
    forward = median_seconds(circuits.metric)
    model.requires_grad_(False)
    scores, scoring = scoring_cost(circuits, args.steps, args.scoring_repeats)
    scoring_mib = peak_mib(device) - loaded_mib
    order = ranked_edges(circuits.graph, scores).sort_values("rank").index.to_numpy()
    circuits.corrupted  # recorded once, before the timed evaluations
    masks = {n: circuits.kept(order, n) for n in args.keep}
    evaluations = {n: ratio_to_unit(lambda n=n: circuits.metric(masks[n]), circuits.metric, args.evaluation_repeats)
                   for n in args.keep}
    graph, shape, hidden = circuits.graph, batch.clean.shape, model.config.hidden_size
    points = len(batch.differing_points(slice(0, len(batch.clean))))
    result = {
        "model": args.model, "task": args.task, "prompts": args.n, "tokens_per_prompt": shape[1],
        "edges": graph.n_edges, "steps": args.steps, "threads": args.threads,
        "forward_s": forward, **scoring, "forward_backward_in_forwards": scoring["forward_backward_s"] / forward,
        "scoring_target_forward_backwards": args.steps + 2,
        "evaluation_in_forwards": {str(n): ratio for n, ratio in evaluations.items()},
        "evaluation_repeats": args.evaluation_repeats,
        "evaluation_target_forwards": 1.5,
        "patched_points": points, "points_in_the_batch": shape[0] * shape[1],
        "mixing_gflop": {str(n): mixing_flop(graph, masks[n], points, hidden) / 1e9 for n in args.keep},
        "forward_gflop": 2 * sum(p.numel() for name, p in model.named_parameters() if "embed" not in name)
        * shape[0] * shape[1] / 1e9,
        "peak_above_model_mib": {"scoring": scoring_mib, "scoring_and_evaluation": peak_mib(device) - loaded_mib},
        # the recordings hold the model's dtype
        "one_recording_of_every_sender_mib": graph.n_senders * shape[0] * shape[1] * hidden * dtype.itemsize / 2**20,
    }
    write_result(result, f"edge_cost_{args.model}_{args.task}.json", device, dtype)


if __name__ == "__main__":
    main()
