"""attnlab's edge scores beside auto-circuit's on the same model, prompts and metric.

    .venv/bin/python -m benchmarks.peers.edges --peer-python .venv-autocircuit/bin/python
                                              [--n 24] [--reference-eap] [--curve]

(``make bench-edge-peers`` builds .venv-autocircuit from benchmarks/peers/autocircuit-requirements.txt
and runs this.) On SmolLM2-135M-Instruct (converted into benchmarks/out/ once) and the first
``--n`` IOI pairs of the most common token length (auto-circuit takes no padding): attnlab's
plain EAP (``EdgeCircuits.scores(steps=1)``) and EAP-IG (5 steps) here, auto-circuit's EAP in its
own virtualenv (``benchmarks/peers/edges_worker.py``, which maps its node names onto attnlab's
and sums its per-query-head key/value receivers onto attnlab's key/value heads). Written to
benchmarks/out/edge_peers/: both tools' scores and ``comparison.json`` (Spearman of |score| and
of the signed scores, Pearson, the largest difference, the overlap of the top 1% of edges by
|score|, sign agreement, each tool's seconds and its own plain forward's), and, for the top n
edges of attnlab's EAP ranking (``--circuits``), the metric of that circuit (every other edge
carrying the corrupted activation) evaluated by each tool: the exact evaluation checked against
an independent implementation.

Both tools run on the CPU in float32, whatever GPU the machine has: the worker builds auto-circuit's
model and batches on the CPU, and the times compare the two tools on one device.

auto-circuit's integrated gradients interpolate the edge masks, not the input embeddings (the
worker's docstring), so only plain EAP is the same quantity in both tools; ``--ig`` also runs
auto-circuit's mask-IG and reports its rank agreement with attnlab's EAP-IG as what it is, a
comparison of two definitions.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import torch
from scipy.stats import pearsonr, spearmanr

from attnlab.patching.edges import EdgeCircuits, ranked_edges
from attnlab.patching.heads import build_batch
from attnlab.patching.tasks import generate_task, subset
from benchmarks.tools.harness import OUT, REPO, embedded_model, load_embedded, timed, write_result

# auto-circuit's worker runs on the CPU in float32 (edges_worker.py), and so does attnlab here
DEVICE, DTYPE = torch.device("cpu"), torch.float32


def equal_length_batch(tokenizer, n: int):
    """The first n IOI pairs (of 4n generated) of the most common token length: no padding."""
    prompts = generate_task("ioi", tokenizer, 4 * n, 0)
    lengths = [len(tokenizer(p).input_ids) for p in prompts.clean]
    common = collections.Counter(lengths).most_common(1)[0][0]
    chosen = [i for i, length in enumerate(lengths) if length == common][:n]
    if len(chosen) < n:
        raise SystemExit(f"only {len(chosen)} IOI pairs of {common} tokens among {4 * n}: lower --n")
    chosen_prompts = subset(prompts, chosen)
    return chosen_prompts, build_batch(chosen_prompts, tokenizer)


def agreement(ours: pd.DataFrame, theirs: pd.DataFrame) -> dict:
    """Rank and value agreement of two tools' scores over the edges both have."""
    both = ours.merge(theirs, on=["sender_name", "receiver_name"], suffixes=("_attnlab", "_peer"))
    a, b = both["score_attnlab"].to_numpy(float), both["score_peer"].to_numpy(float)
    top = max(1, round(0.01 * len(both)))
    top_ours, top_theirs = set(np.argsort(-np.abs(a))[:top]), set(np.argsort(-np.abs(b))[:top])
    return {"edges_attnlab": len(ours), "edges_peer": len(theirs), "edges_in_common": len(both),
            "spearman_abs": float(spearmanr(np.abs(a), np.abs(b)).statistic),
            "spearman_signed": float(spearmanr(a, b).statistic), "pearson": float(pearsonr(a, b).statistic),
            "max_abs_difference": float(np.abs(a - b).max()), "max_abs_score": float(np.abs(a).max()),
            "top_1_percent": top, "top_1_percent_overlap": len(top_ours & top_theirs),
            "sign_agreement": float(np.mean(np.sign(a) == np.sign(b)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peer-python", required=True)
    parser.add_argument("--n", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reference-eap", action="store_true",
                        help="also auto-circuit's reference EAP (a Python loop over its 123,211 edges: ~20 min)")
    parser.add_argument("--ig", action="store_true", help="also auto-circuit's mask-IG (5 samples)")
    parser.add_argument("--curve", action="store_true", help="also auto-circuit's faithfulness curve")
    parser.add_argument("--circuits", type=int, nargs="*", default=[100, 1000, 10000],
                        help="evaluate the top n edges of attnlab's EAP ranking exactly in both tools")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = OUT / "edge_peers"
    out.mkdir(parents=True, exist_ok=True)
    path = embedded_model("smollm2-135m")
    model, tokenizer = load_embedded("smollm2-135m", DEVICE, DTYPE)
    prompts, batch = equal_length_batch(tokenizer, args.n)
    (out / "inputs.json").write_text(json.dumps({
        "clean": batch.clean.tolist(), "corrupted": batch.corrupted.tolist(), "answers": list(prompts.answers),
        "distractors": [list(d) for d in prompts.distractors]}))
    circuits = EdgeCircuits(model, batch, len(batch.clean))
    ours, seconds = {}, {}
    for steps in (1, 5):
        ours[steps], seconds[f"attnlab_steps{steps}_s"] = timed(
            lambda steps=steps: ranked_edges(circuits.graph, circuits.scores(steps)))
        ours[steps].to_parquet(out / f"attnlab_steps{steps}.parquet")
    seconds["attnlab_forward_s"] = timed(circuits.metric)[1]
    circuits_path, ours_circuits = out / "eap_circuits.json", {}  # circuits.json: benchmarks.peers.circuits
    order = ours[1].sort_values("rank")
    for n in args.circuits:
        top = order.head(n)
        ours_circuits[f"top{n}"] = {"edges": n, "metric": circuits.metric(circuits.kept(top.index.to_numpy(), n))}
    circuits_path.write_text(json.dumps({f"top{n}": order.head(n)[["sender_name", "receiver_name"]].values.tolist()
                                         for n in args.circuits}))
    worker = [args.peer_python, "-m", "benchmarks.peers.edges_worker", "--model", str(path),
              "--inputs", str(out / "inputs.json"), "--out", str(out), "--threads", str(args.threads)]
    worker += [] if args.reference_eap else ["--skip-slow-eap"]
    worker += [] if args.curve else ["--no-curve"]
    worker += [] if args.ig else ["--ig-samples", "0"]
    worker += ["--circuits", str(circuits_path)] if args.circuits else []
    subprocess.run(worker, check=True, cwd=REPO)  # the module is found from the checkout's root
    peer_timing = json.loads((out / "autocircuit_timing.json").read_text())
    result = {"model": "smollm2-135m", "task": "ioi", "prompts": args.n, "tokens": batch.clean.shape[1],
              **seconds, "autocircuit": peer_timing,
              "eap": agreement(ours[1], pd.read_csv(out / "autocircuit_eap.csv"))}
    if args.circuits:
        theirs = peer_timing["circuits"]
        result["circuits"] = {name: {"attnlab_metric": value["metric"], "autocircuit_metric": theirs[name]["metric"],
                                     "edges": value["edges"], "autocircuit_edges": theirs[name]["autocircuit_edges"],
                                     "abs_difference": abs(value["metric"] - theirs[name]["metric"])}
                              for name, value in ours_circuits.items()}
    if args.ig:
        result["ig_different_definitions"] = agreement(ours[5], pd.read_csv(out / "autocircuit_ig5.csv"))
    write_result(result, "edge_peers/comparison.json", DEVICE, DTYPE)


if __name__ == "__main__":
    sys.exit(main())
