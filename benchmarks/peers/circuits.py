"""attnlab's ACDC and Edge Pruning beside auto-circuit's ACDC and Subnetwork Probing: the circuits
each finds on the same model and prompts, their overlap and their faithfulness.

    .venv/bin/python -m benchmarks.peers.circuits --peer-python .venv-autocircuit/bin/python
                     [--n 16] [--threshold 1e-5] [--sparsity 0.8] [--steps 200] [--warmup 100]
                     [--lambda-lr 0.001] [--sp-lambda 0.01] [--sp-mean] [--acdc-attnlab-order]

(``make bench-edge-peers`` runs it after ``benchmarks.peers.edges``.) ACDC is one forward per
edge, so the model is small: SmolLM2-135M-Instruct's first ``--layers`` (2) layers with their
trained weights (the converted folder cut to its first layers, saved once in
benchmarks/out/smollm2-135m-2layers/ and loaded by both tools): 231 edges in attnlab's graph, 375 in
auto-circuit's. The prompts are the first ``--n`` IOI pairs of the most common token length
(``edges.equal_length_batch``: no padding, one distractor), the same token ids in both tools.

- **ACDC vs ACDC.** attnlab's ``patching.acdc`` with faithfulness ``kl`` and auto-circuit's
  ``acdc_prune_scores(faithfulness_target="kl_div")`` at the one threshold ``--threshold``
  (τ = base × 10^exp in auto-circuit's terms). Both keep an edge when removing it raises
  KL(clean full model ‖ circuit) at the last position by at least τ, and patch a removed edge with
  its sender's activation in the corrupted prompt. auto-circuit visits its edges sorted by the
  receiver's layer, within a layer in its edge set's iteration order, which changes from process to
  process (PYTHONHASHSEED does not fix it: the worker's ``acdc_circuit``); attnlab receiver by
  receiver, senders from the latest. So the circuits differ, and auto-circuit's from run to run.
  ``--acdc-attnlab-order`` also runs auto-circuit's ACDC with its edges handed over in attnlab's
  order (``acdc_in_attnlab_order``): the two implementations with the order taken out.
- **Edge Pruning vs Subnetwork Probing.** attnlab's ``patching.edge_pruning`` (KL loss, target
  sparsity ``--sparsity``, ``--steps`` steps) and auto-circuit's
  ``subnetwork_probing_prune_scores`` (hard-concrete masks, ``faithfulness_target="kl_div"``,
  ``tree_optimisation=True``: the clean input with removed edges patched, as attnlab; as many
  epochs as attnlab's steps, one batch so one step an epoch) with ``circuit_size`` = attnlab's
  circuit counted in auto-circuit's edges (``autocircuit_size``). The cut model's KL is small (the
  empty circuit's is about 1e-3), so both sparsity terms are weighted down: at their defaults
  (attnlab's ``lambda_lr`` 0.1, SP's ``regularize_lambda`` 10) the sparsity term swamps the KL's
  gradient and both end at a circuit no better than the empty one (measured while setting this
  up: benchmarks/peers/README.md). ``--lambda-lr`` bounds attnlab's learned multipliers (Adam
  moves them about ``lambda_lr`` a step); ``--sp-lambda`` is SP's fixed weight, scaled by the
  empty circuit's KL (10 × 1e-3). auto-circuit 1.0.1's SP patches a removed edge with the
  token-wise mean of the corrupted prompts (hard-coded); the worker runs it with the per-prompt
  corrupted activation that attnlab and ACDC patch with (``sp_resample``, its
  ``batch_src_ablations`` replaced for the call), and as shipped with ``--sp-mean``.
- **Names.** auto-circuit has a key and a value receiver per query head (``A{l}.{h}.K``), attnlab
  one per key/value head (``L{l}.KV{h // 3}.k``, the worker's mapping). An attnlab edge is in
  auto-circuit's circuit if any of its copies is; an SP edge's score is the largest of its copies',
  and SP's circuit is its top k attnlab edges, k the size of attnlab's Edge Pruning circuit (the
  circuit of auto-circuit's own reading, its top ``circuit_size`` edges, is reported beside it).
  attnlab's circuits go to auto-circuit with every copy of their key/value edges.
- **Faithfulness.** Every circuit, both tools' in attnlab's names, evaluated by attnlab's exact
  edge patching: KL from the full model and the explained effect (m_circuit − m_corrupted) /
  (m_clean − m_corrupted) of the IOI metric logit[IO] − logit[S]. And by auto-circuit's
  ``run_circuits`` (tree patching, resample ablation): its own circuits as it found them (copies as
  kept) and attnlab's expanded. The cut model does not do IOI (its clean and corrupted metrics
  differ by a few hundredths of a logit), so the explained effect is a ratio of small numbers:
  the KL is the quantity both methods optimise.
- **Seconds**: attnlab's methods' own clocks (the clean and corrupted references are made before);
  auto-circuit's around each call, which makes its own references (a few forwards) inside.

In ``circuits.json`` each pair has ``attnlab`` and ``autocircuit`` (each circuit's size, attnlab's
evaluation and seconds; ``own_evaluation``: auto-circuit's ``run_circuits`` on its circuit, ACDC's
as found and SP's top k with every copy; ``own_reading_evaluation``: SP's top ``circuit_size``
edges), ``jaccard``, ``in_both`` and the edges only one tool keeps; ``attnlab_circuits_in_autocircuit``
is auto-circuit's evaluation of attnlab's circuits, a check of the two evaluations.

Written to benchmarks/out/edge_peers/: ``circuits.json`` (the result), ``circuits_inputs.json``,
``circuits_request.json`` (attnlab's circuits for the worker) and the worker's
``autocircuit_circuits.json``. Both tools run on the CPU in float32 (attnlab's KL in float64).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from attnlab.models import load_model
from attnlab.patching.acdc import acdc
from attnlab.patching.edge_pruning import PruningSchedule, prune_edges
from attnlab.patching.edges import EdgeCircuits
from attnlab.patching.faithfulness import Faithfulness
from attnlab.tokenization import load_tokenizer
from benchmarks.peers.edges import equal_length_batch
from benchmarks.tools.harness import OUT, REPO, embedded_model, write_result

DEVICE, DTYPE = torch.device("cpu"), torch.float32
Edge = tuple[str, str]


# ---------------------------------------------------------------- pure helpers (tests/test_peer_circuits.py)

def jaccard(a: set, b: set) -> float:
    """|a ∩ b| / |a ∪ b|; 1 for two empty sets."""
    union = a | b
    return len(a & b) / len(union) if union else 1.0


def copies(receiver: str, kv_group: int) -> int:
    """auto-circuit's copies of an edge into attnlab's ``receiver``: one per query head of a
    key/value head's group (``L{l}.KV{kv}.k`` / ``.v``), else one."""
    return kv_group if ".KV" in receiver else 1


def autocircuit_size(edges: set[Edge], kv_group: int) -> int:
    """The edges of attnlab's circuit ``edges`` counted in auto-circuit's graph (every copy)."""
    return sum(copies(receiver, kv_group) for _, receiver in edges)


def tau_parts(threshold: float) -> tuple[int, int]:
    """(base, exp) with base × 10**exp == threshold, base an integer 1..9: auto-circuit's ACDC
    takes its τ as ``tao_bases`` × 10 ** ``tao_exps``."""
    for exp in range(-12, 3):
        base = round(threshold / 10.0 ** exp)
        if 1 <= base <= 9 and base * 10.0 ** exp == threshold:
            return base, exp
    raise SystemExit(f"--threshold {threshold}: auto-circuit takes τ = base × 10^exp, base 1..9 (e.g. 1e-5, 3e-6)")


def names_of(graph, kept: torch.Tensor) -> set[Edge]:
    senders, receivers = graph.sender_names(), graph.receiver_names()
    return {(senders[s], receivers[r]) for s, r in kept.nonzero().tolist()}


def mask_of(graph, edges: set[Edge]) -> torch.Tensor:
    senders = {name: i for i, name in enumerate(graph.sender_names())}
    receivers = {name: i for i, name in enumerate(graph.receiver_names())}
    mask = torch.zeros(graph.n_senders, graph.n_receivers, dtype=torch.bool)
    for sender, receiver in edges:
        mask[senders[sender], receivers[receiver]] = True
    if (mask & ~graph.valid()).any():
        raise ValueError("a circuit names a pair that is no edge of attnlab's graph")
    return mask


# ---------------------------------------------------------------- the model and attnlab's side

def truncated_model(layers: int) -> Path:
    """SmolLM2-135M-Instruct cut to its first ``layers`` layers (their trained weights, the
    embeddings, final norm and tied head), saved once under benchmarks/out/."""
    folder = OUT / f"smollm2-135m-{layers}layers"
    if not (folder / "config.json").exists():
        from transformers import AutoModelForCausalLM

        source = embedded_model("smollm2-135m")
        model = AutoModelForCausalLM.from_pretrained(source, num_hidden_layers=layers, dtype=torch.float32)
        model.save_pretrained(folder)
        load_tokenizer(source).save_pretrained(folder)
    return folder


def evaluate(faithfulness: Faithfulness, edges: set[Edge]) -> dict:
    """A circuit (attnlab's names) by attnlab's exact edge patching: KL, metric, explained effect."""
    kept = mask_of(faithfulness.circuits.graph, edges)
    metric = faithfulness.circuits.metric(kept)
    return {"edges": len(edges), "kl": faithfulness.distance(kept), "metric": metric,
            "explained_effect": (metric - faithfulness.corrupted) / faithfulness.span}


def attnlab_circuits(faithfulness: Faithfulness, args) -> dict:
    """attnlab's ACDC and Edge Pruning circuits (names) and each method's seconds."""
    found = acdc(faithfulness, args.threshold, progress=False)
    schedule = PruningSchedule(sparsity=args.sparsity, steps=args.steps, warmup=args.warmup,
                               lambda_lr=args.lambda_lr, seed=args.seed)
    pruned = prune_edges(faithfulness, schedule, progress=False)
    graph = faithfulness.circuits.graph
    return {"acdc": {"edges": names_of(graph, found.kept), "seconds": found.seconds, "forwards": found.forwards,
                     "tried": found.tried, "skipped": found.skipped, "distance": found.distance},
            "edge_pruning": {"edges": names_of(graph, pruned.kept), "seconds": pruned.seconds,
                             "target_edges": round((1 - args.sparsity) * graph.n_edges),
                             "final_expected_sparsity": pruned.history[-1]["expected_sparsity"]}}


# ---------------------------------------------------------------- the comparison

def pair(faithfulness: Faithfulness, ours: dict, theirs: dict, theirs_own_eval: dict) -> dict:
    """One method pair: sizes, overlap, each circuit's faithfulness in attnlab (and auto-circuit's
    own evaluation of its circuit), each tool's seconds."""
    a, b = ours["edges"], {tuple(edge) for edge in theirs["edges"]}
    return {"attnlab": {**evaluate(faithfulness, a), "seconds": ours["seconds"],
                        **{k: v for k, v in ours.items() if k not in ("edges", "seconds")}},
            "autocircuit": {**evaluate(faithfulness, b), "seconds": theirs["seconds"],
                            "autocircuit_edges": theirs["autocircuit_edges"], "own_evaluation": theirs_own_eval,
                            **{k: v for k, v in theirs.items() if k not in ("edges", "seconds", "autocircuit_edges")}},
            "jaccard": jaccard(a, b), "in_both": len(a & b), "attnlab_only": sorted(a - b),
            "autocircuit_only": sorted(b - a)}


def run_worker(args, model: Path, out: Path, batch, prompts, ours: dict, kv_group: int) -> dict:
    """auto-circuit's side in its own virtualenv; its result."""
    inputs, request = out / "circuits_inputs.json", out / "circuits_request.json"
    inputs.write_text(json.dumps({"clean": batch.clean.tolist(), "corrupted": batch.corrupted.tolist(),
                                  "answers": list(prompts.answers),
                                  "distractors": [list(d) for d in prompts.distractors]}))
    pruned = ours["edge_pruning"]["edges"]
    request.write_text(json.dumps({"circuits": {name: sorted(value["edges"]) for name, value in ours.items()},
                                   "sp_circuit_size": autocircuit_size(pruned, kv_group),
                                   "sp_top_k": len(pruned)}))
    base, exp = tau_parts(args.threshold)
    worker = [args.peer_python, "-m", "benchmarks.peers.circuits_worker", "--model", str(model),
              "--inputs", str(inputs), "--request", str(request), "--out", str(out),
              "--tau-base", str(base), "--tau-exp", str(exp), "--sp-epochs", str(args.steps),
              "--sp-lambda", str(args.sp_lambda), "--sp-variants", *variants(args), "--seed", str(args.seed),
              "--threads", str(args.threads)]
    worker += ["--acdc-orders", "shipped", "attnlab"] if args.acdc_attnlab_order else []
    subprocess.run(worker, check=True, cwd=REPO)  # the module is found from the checkout's root
    return json.loads((out / "autocircuit_circuits.json").read_text())


def variants(args) -> list[str]:
    """SP's runs: with the resample ablation, and as shipped (token-wise mean) with --sp-mean."""
    return ["resample", "mean"] if args.sp_mean else ["resample"]


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peer-python", required=True)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threshold", type=float, default=1e-5, help="ACDC's τ, the same in both tools")
    parser.add_argument("--sparsity", type=float, default=0.8, help="Edge Pruning's target share of edges closed")
    parser.add_argument("--steps", type=int, default=200, help="Edge Pruning's steps = SP's epochs")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--lambda-lr", type=float, default=0.001,
                        help="Edge Pruning's multipliers' step (its default 0.1)")
    parser.add_argument("--sp-lambda", type=float, default=0.01, help="SP's regularize_lambda (its default 10)")
    parser.add_argument("--sp-mean", action="store_true", help="also SP as shipped (token-wise mean ablation)")
    parser.add_argument("--acdc-attnlab-order", action="store_true",
                        help="also auto-circuit's ACDC visiting the edges in attnlab's order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args()


def main() -> None:
    args = arguments()
    torch.set_num_threads(args.threads)
    out = OUT / "edge_peers"
    out.mkdir(parents=True, exist_ok=True)
    folder = truncated_model(args.layers)
    model, tokenizer = load_model(folder, DEVICE, DTYPE), load_tokenizer(folder)
    prompts, batch = equal_length_batch(tokenizer, args.n)
    circuits = EdgeCircuits(model, batch, len(batch.clean))
    faithfulness = Faithfulness(circuits, "kl")
    graph = circuits.graph
    kv_group = graph.n_heads // graph.n_kv_heads
    ours = attnlab_circuits(faithfulness, args)
    theirs = run_worker(args, folder, out, batch, prompts, ours, kv_group)
    evaluations = theirs["evaluations"]
    result = {"model": f"smollm2-135m, first {args.layers} layers", "task": "ioi", "prompts": args.n,
              "tokens": batch.clean.shape[1], "threshold": args.threshold,
              "schedule": {"sparsity": args.sparsity, "steps": args.steps, "warmup": args.warmup,
                           "lambda_lr": args.lambda_lr, "seed": args.seed}, "sp_regularize_lambda": args.sp_lambda,
              "attnlab_edges": graph.n_edges, "autocircuit_graph_edges": theirs["autocircuit_graph_edges"],
              "clean_metric": faithfulness.clean, "corrupted_metric": faithfulness.corrupted,
              "empty_circuit_kl": faithfulness.distance(torch.zeros_like(graph.valid())),
              "autocircuit_checks": theirs["checks"],
              "attnlab_circuits_in_autocircuit": {name: evaluations[name] for name in ours},
              "acdc": pair(faithfulness, ours["acdc"], theirs["acdc"], evaluations["autocircuit_acdc"])}
    if args.acdc_attnlab_order:
        result["acdc_in_attnlab_order"] = pair(faithfulness, ours["acdc"], theirs["acdc_attnlab_order"],
                                               evaluations["autocircuit_acdc_attnlab_order"])
    for variant in variants(args):
        result[f"edge_pruning_vs_sp_{variant}"] = pair(faithfulness, ours["edge_pruning"], theirs[f"sp_{variant}"],
                                                       evaluations[f"autocircuit_sp_{variant}"])
        result[f"edge_pruning_vs_sp_{variant}"]["autocircuit"]["own_reading_evaluation"] = \
            evaluations[f"autocircuit_sp_{variant}_own_reading"]
    write_result(result, "edge_peers/circuits.json", DEVICE, DTYPE)


if __name__ == "__main__":
    sys.exit(main())
