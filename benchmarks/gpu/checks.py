"""benchmarks/gpu/node.py's checks: on the GPU itself, the fused kernels against the eager blocks.

The tests check the kernels in Triton's CPU interpreter; the compiled kernels of a real GPU are
another program (other tile sizes, TF32/IEEE dot products, fast exponentials). So before any
timing, each path the workflow runs is compared on the card in float32, on SmolLM2 with left
padding and an inserted span: the extraction (received attention and λ) of the dense model and
of a sparse copy, the copy's logits and open edges per head, and a full training step (loss,
densities, every weight's gradient) with the eager path drawing the kernels' own noise.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch

from attnlab.attention import fused, sparse
from attnlab.extraction.extract import extract
from attnlab.interventions import intervened
from attnlab.models import load_model
from benchmarks.tools.harness import extraction_prompts


@contextlib.contextmanager
def fused_mode(mode: str):
    """ATTNLAB_FUSED_ATTENTION inside the block (attnlab.attention.fused reads it on every call)."""
    previous = os.environ.get(fused.MODE_VARIABLE)
    os.environ[fused.MODE_VARIABLE] = mode
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(fused.MODE_VARIABLE)
        else:
            os.environ[fused.MODE_VARIABLE] = previous


def both(run):
    """(eager blocks' result, kernels' result) of run()."""
    with fused_mode("off"):
        eager = run()
    with fused_mode("on"):  # on CUDA; on a CPU only in Triton's interpreter (--smoke with TRITON_INTERPRET=1)
        return eager, run()


def _padded_prompts(lengths=(300, 231, 180), seed=0):
    rng = np.random.default_rng(seed)
    table = extraction_prompts([rng.integers(10, 40000, max(lengths)).tolist()] * len(lengths), inserted=(10, 65))
    table["input_ids"] = [row[:n] for row, n in zip(table["input_ids"], lengths)]
    table["n_prompt_tokens"] = list(lengths)
    table["question_end"] = list(lengths)
    return table


def extraction_differences(model, prompts) -> dict:
    eager, kernels = both(lambda: extract(model, prompts, len(prompts), []))
    worst = {}
    for name in ("received", "lam"):
        pairs = list(zip(getattr(eager, name), getattr(kernels, name)))
        same_nan = all(np.array_equal(np.isnan(a), np.isnan(b)) for a, b in pairs)
        worst[name] = {"max_abs_diff": float(max(np.nanmax(np.abs(a - b)) for a, b in pairs)),
                       "same_nan_positions": same_nan}
    return worst


NEAR_THRESHOLD = 1e-4  # gate-logit distance from 0 within which float32 rounding can flip an edge
# (logits of up to ~30 carry rounding of about 30 x 1.2e-7 per operation, a few e-6 after a dot product)


def sparse_inference_differences(model, prompts) -> dict:
    rows = [torch.tensor(r) for r in prompts["input_ids"]]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    ids, mask = ids.to(model.device), mask.to(model.device)

    def run():
        tracker = sparse.GateTracker(near_threshold=NEAR_THRESHOLD)  # counted by the eager path only
        with intervened(model, gates=tracker), torch.no_grad():
            logits = model(ids, attention_mask=mask).logits
        return logits, tracker

    (eager, eager_tracker), (kernels, kernel_tracker) = both(run)
    # the eager path keeps its counts on the host, the kernels on the device: compare on the host
    same_density = all(torch.equal(d.cpu(), kernel_tracker.density_per_head()[layer].cpu())
                       for layer, d in eager_tracker.density_per_head().items())
    # float32 rounding grows through 30 layers: read the difference against the logits' size
    # (on the CPU interpreter, SmolLM2 at b = 0: 4.8e-3 of logits up to ~20, the same open edges)
    return {"logits_max_abs_diff": float((eager - kernels)[mask.bool()].abs().max()),
            "logits_max_abs": float(eager[mask.bool()].abs().max()),
            "same_open_edges_per_head": same_density, "density": eager_tracker.inference_density(),
            "open_edges": open_edge_differences(eager_tracker, kernel_tracker)}


def open_edge_differences(eager_tracker, kernel_tracker) -> dict:
    """Where the two paths' open edges first differ: the layer, the open edges by which its heads
    differ (a lower bound on flipped edges), and whether rounding can explain each head's
    difference. Only the first differing layer can be judged: later layers see other inputs.

    Rounding can close an eager-open edge only if 0 < s + b < ``NEAR_THRESHOLD`` in the eager
    path, and open a closed one only if -``NEAR_THRESHOLD`` < s + b <= 0. A head whose kernels
    open n more edges than the eager path needs n near-closed edges (n fewer: n near-open ones);
    a head beyond that opens other edges. Within it is necessary for rounding, not proof of it
    (per-head counts cannot match edges one by one)."""
    eager_open, allowed = eager_tracker.density_counts()
    kernel_open, _ = kernel_tracker.density_counts()
    differing = {layer: int((eager_open[layer] - kernel_open[layer]).abs().sum()) for layer in sorted(eager_open)}
    first = next((layer for layer, n in differing.items() if n), None)
    result = {"first_layer_differing": first, "differing_in_first_layer": differing.get(first, 0),
              "near_threshold": NEAR_THRESHOLD, "differing_all_layers": sum(differing.values()),
              "allowed_all_layers": int(sum(float(v.sum()) for v in allowed.values()))}
    if first is not None:
        heads = heads_beyond_rounding(kernel_open[first] - eager_open[first], eager_tracker.near_open_per_head[first],
                                      eager_tracker.near_closed_per_head[first])
        result.update(heads_differing_in_first_layer=heads["differing"], heads_beyond_rounding=heads["beyond"],
                      within_rounding=not heads["beyond"])
    return result


def heads_beyond_rounding(more_open: torch.Tensor, near_open: torch.Tensor, near_closed: torch.Tensor) -> dict:
    """Per head of one layer, the kernels' open edges minus the eager path's (``more_open``), against
    the eager path's edges within rounding of the threshold on the side each difference needs."""
    differing, beyond = [], []
    for head, (more, can_close, can_open) in enumerate(zip(more_open.tolist(), near_open.tolist(), near_closed.tolist())):
        if more:
            row = {"head": head, "kernels_open_more": int(more), "near_open": int(can_close), "near_closed": int(can_open)}
            differing.append(row)
            if (more > 0 and more > can_open) or (more < 0 and -more > can_close):
                beyond.append(row)
    return {"differing": differing, "beyond": beyond}


def training_differences(model_dir, device, length: int = 128) -> dict:
    """One gated training step (loss + density penalty) of a float32 copy, both paths drawing the
    kernels' noise (attnlab.attention.kernels.reference)."""
    from transformers import AutoModelForCausalLM

    from attnlab.attention.kernels.reference import training_gate_with_kernel_noise

    ids = torch.randint(10, 40000, (2, length), generator=torch.Generator().manual_seed(0)).to(device)

    def step():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).train()
        sparse.make_sparse(model, 3.0)
        tracker = sparse.GateTracker(training=True, generator=torch.Generator(device=device).manual_seed(0))
        with intervened(model, gates=tracker):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss + tracker.expected_density()
            loss.backward()
        return loss.item(), tracker.training_density(), {n: p.grad for n, p in model.named_parameters()}

    original, sparse.training_gate = sparse.training_gate, training_gate_with_kernel_noise
    try:
        (eager_loss, eager_density, eager_grads), (loss, density, grads) = both(step)
    finally:
        sparse.training_gate = original
    worst = max(float((grads[n] - g).abs().max()) for n, g in eager_grads.items())
    scale = max(float(g.abs().max()) for g in eager_grads.values())
    return {"loss_abs_diff": abs(loss - eager_loss), "training_density": [eager_density, density],
            "gradient_max_abs_diff": worst, "gradient_max_abs": scale}


def kernel_checks(model_dir, device, lengths=(300, 231, 180), train_length: int = 128) -> dict:
    """Every comparison above, float32, on ``device``."""
    model = load_model(model_dir, device, torch.float32)
    prompts = _padded_prompts(lengths)
    result = {"dense_extraction": extraction_differences(model, prompts)}
    sparse.make_sparse(model, 0.0)  # about half the edges closed
    result["sparse_extraction"] = extraction_differences(model, prompts)
    result["sparse_inference"] = sparse_inference_differences(model, prompts)
    del model
    result["training_step"] = training_differences(model_dir, device, train_length)
    return result
