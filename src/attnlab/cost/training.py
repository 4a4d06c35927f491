"""What a sparse copy's post-training job (``sparsify_model``) costs, composed from the cost fit's
one measured training step (``lora_step``: the student's forward and backward under its gates,
``benchmarks/scale/measure.py``) and what the settings say the job holds and runs (pure standard
library, as ``attnlab.cost.model``).

Memory: every model copy the job loads and every trained weight's state, counted, not fitted;
and one step's activations from the fit:

- the frozen base (the KL reference, and the base under LoRA): bfloat16 on a GPU, float32 on the
  CPU (``sparsify.train.Trainer``);
- the student, and under ``constraint: ce_control`` the dense control beside it: each the base's
  parameters (frozen dtype under LoRA, float32 where weights train);
- per trained parameter (LoRA's adapters, or the weights ``train`` selects) in float32: its
  gradient and AdamW's two moments, and under LoRA the adapter itself; for the control again;
- the step's activations: the ``lora_step`` fit at the job's batch and sequence length (measured
  on the CPU's eager path), in bfloat16 under autocast on a GPU; there the fused kernels hold no
  T x T, and gradient checkpointing keeps one layer's share and every layer's input
  (``_step_terms``): derived, not measured on a GPU (benchmarks/scale/README.md compares the one GPU
  peak measured);
- the base's logits on a batch under ``constraint: kl``; the held-out logits of each source whose
  set fits 2 GB (``sparsify.heldout.logits_fit``: a larger set is computed again at every
  evaluation); after training the calibration's reference logits where they fit, in place of a
  step's activations where larger.

Time: ``steps`` training steps, each the fitted step (the control's too under ``ce_control``; the
base's forward under ``kl``, a third of a step, as ``cost.time_features`` counts a step as three
forwards), and every other forward of one batch at a third of a step: the held-out evaluations'
and the calibration's, counted by ``forward_counts`` (the calibration's at most). A GPU has no
time fit.
"""

from __future__ import annotations

import importlib.util
import math

from attnlab.anatomy.families import text_config
from attnlab.cost import model as cost
from attnlab.config.checks import FUSED_LARGEST_HEAD, fused_mode
from attnlab.config.corpus import corpus_sources, shares

HELDOUT_LOGITS_BUDGET = 2 ** 31  # bytes of the base's held-out logits a source keeps (heldout.logits_fit)
FLOAT32 = 4


def adapted_parameters(shape: cost.Shape, lora: dict) -> int:
    """LoRA's adapter parameters: rank x (inputs + outputs) of each adapted projection per layer
    (q, k, v, o: the family's own modules; a fused q/k/v once); a module named otherwise
    (peft's own name, say an MLP projection) counted as the largest a layer has, hidden in and
    intermediate out."""
    s, rank = shape, lora["rank"]
    sizes = {"q": (s.hidden, s.heads * s.head_dim), "k": (s.hidden, s.kv_heads * s.head_dim),
             "v": (s.hidden, s.kv_heads * s.head_dim), "o": (s.heads * s.head_dim, s.hidden)}
    if s.fused_qkv:  # GPT-2's c_attn: one adapter for q, k and v
        fused = (s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim)
        sizes = {"q": fused, "k": fused, "v": fused, "o": sizes["o"]}
    adapted = {}
    for name in lora["modules"]:
        target = "qkv" if s.fused_qkv and name in ("q", "k", "v") else name
        adapted[target] = sizes.get(name, (s.hidden, s.intermediate))
    return s.depth * rank * sum(inputs + outputs for inputs, outputs in adapted.values())


def trained_parameters(shape: cost.Shape, settings: dict) -> int:
    """The parameters the optimiser trains (``sparsify.train.trainable_parameters``: all of them,
    the attention's q/k/v/o, or q and k; or LoRA's adapters), matrices only (norms and biases
    are under 1% at 7B)."""
    s, train = shape, settings["train"]
    if train == "lora":
        return adapted_parameters(s, settings["lora"])
    if train == "all":
        return s.parameters()
    query_key = s.hidden * s.head_dim * (s.heads + s.kv_heads)
    return s.depth * (s.attention_parameters() if train == "attention" else query_key)


def sparsify_estimate(model_json: dict, settings: dict, device: str) -> cost.Estimate | None:
    """``sparsify_model``'s peak memory and seconds on ``device`` (module docstring), or None where
    the fit has no family or no ``lora_step`` for the model."""
    shape = cost.Shape.of(model_json)
    on_card = device == "cuda"
    activations = 2 if on_card and settings["dtype"] in ("auto", "bfloat16") else FLOAT32
    rows, tokens = settings["batch_size"], settings["seq_len"]
    step = cost.estimate("lora_step", model_json, {"batch": rows, "tokens": tokens}, activations, device)
    if shape is None or step is None:
        return None
    lora, control = settings["train"] == "lora", settings["constraint"]["type"] == "ce_control"
    frozen = 2 if on_card else FLOAT32  # the frozen base's dtype, and so its logits'
    trainable_copies = 2 if control else 1
    # under autocast a residual stream beside float32 weights stays float32
    inputs = activations if lora else FLOAT32
    step_terms = _step_terms(step.terms, shape, model_json, rows * tokens, activations, inputs, on_card,
                             settings["gradient_checkpointing"])
    if settings["constraint"]["type"] == "kl":
        step_terms["base_logits"] = rows * tokens * shape.vocab * frozen
    calibration = settings["calibrate_gate_bias"]
    calibrated = calibration["sequences"] if calibration["enabled"] else 0
    calibration_logits = (calibrated * tokens * shape.vocab * frozen
                          if logits_kept(calibrated, tokens, shape.vocab) else 0)
    if calibration_logits > sum(step_terms.values()):  # after training: its logits, never beside a step's
        step_terms = {"calibration_logits": calibration_logits}
    kept = sum(share for share in heldout_shares(settings) if logits_kept(share, tokens, shape.vocab))
    terms = {"base": shape.parameters() * frozen,
             "trained_copies": trainable_copies * shape.parameters() * (frozen if lora else FLOAT32),
             "optimizer": trainable_copies * trained_parameters(shape, settings) * FLOAT32 * (3 + lora),
             "heldout_logits": kept * tokens * shape.vocab * frozen, **step_terms}
    weights = terms["base"] + terms["trained_copies"]
    passes = forward_counts(settings, shape.vocab, shape.depth)
    # a step is the fitted step (its forward and backward: three forwards' worth); the base's
    # forward under kl, and every other forward of one batch, a third of it
    in_steps = passes["steps"] * (trainable_copies + (passes["per_step"] - trainable_copies) / 3) + passes["other"] / 3
    seconds = None if step.seconds is None else step.seconds * in_steps
    return cost.Estimate(sum(terms.values()), weights, seconds, terms)


def logits_kept(sequences: int, tokens: int, vocab: int) -> bool:
    """Whether a set of sequences' reference logits are computed once and kept
    (``sparsify.heldout.logits_fit``: at most 2 GB of float32), else computed at every use."""
    return sequences * tokens * vocab * FLOAT32 <= HELDOUT_LOGITS_BUDGET


def heldout_shares(settings: dict) -> list[int]:
    """Each corpus source's held-out sequences (``config.corpus.shares`` of its mixture weights,
    normalised as ``corpus_sources`` gives them to the trainer: shares of raw weights 1 and 1
    counted 4 + 4 of 4 held-out sequences)."""
    return shares(settings["heldout_sequences"], [source.weight for source in corpus_sources(settings["corpus"])])


def forward_counts(settings: dict, vocab: int, depth: int) -> dict[str, int]:
    """The job's whole-model forwards of one batch each: ``per_step`` in each of its ``steps``
    (the student's; the control's under ce_control; the base's under kl), and ``other``: the
    held-out evaluations (at step 0, every ``eval_every`` steps and the last, a snapshot off
    that grid, and again at a calibrated gate bias; each the student's, the control's, and the
    base's where a source's logits are not kept) and the calibration's. The calibration's is at
    most: its scan stops at the first gate bias over max_kl, its per-layer rounds where nothing
    more can be lowered."""
    batch, tokens, steps = settings["batch_size"], settings["seq_len"], settings["steps"]
    kind = settings["constraint"]["type"]
    control = kind == "ce_control"
    calibration = settings["calibrate_gate_bias"]
    off_grid = [s for s in set(settings["snapshot_steps"]) if 0 < s < steps and s % settings["eval_every"]]
    evaluations = 1 + math.ceil(steps / settings["eval_every"]) + len(off_grid) + calibration["enabled"]
    other = 0
    for share in heldout_shares(settings):
        kept = logits_kept(share, tokens, vocab)
        other += math.ceil(share / batch) * (kept + evaluations * (1 + control + (not kept)))
    if calibration["enabled"]:
        other += _calibration_forwards(calibration, settings["gate_bias"], batch, tokens, vocab, depth)
    return {"steps": steps, "per_step": 1 + control + (kind == "kl"), "other": other}


def _calibration_forwards(calibration: dict, gate_bias: float, batch: int, tokens: int, vocab: int,
                          depth: int) -> int:
    """At most the calibration's forwards (``sparsify.calibrate``): its reference's logits once
    where kept; per measurement the student's on each batch, and the reference's where not kept;
    the scan measures every b' down to ``lowest``; each per-layer round probes before and with each
    layer lowered alone on the sensitivity sequences, then bisects the ranked layers on all."""
    sequences = calibration["sequences"]
    kept = logits_kept(sequences, tokens, vocab)
    per_batch = 1 + (not kept)
    batches = math.ceil(sequences / batch)
    scan = int((gate_bias - calibration["lowest"]) / calibration["step"] + 1e-9) + 1
    forwards = batches * kept + scan * batches * per_batch
    per_layer = calibration["per_layer"]
    if per_layer["enabled"]:
        probe = math.ceil(min(per_layer["sensitivity_sequences"], sequences) / batch)
        bisection = math.ceil(math.log2(depth + 1))
        forwards += per_layer["rounds"] * ((depth + 1) * probe + bisection * batches) * per_batch
    return forwards


def _step_terms(fitted: dict, shape: cost.Shape, model_json: dict, row_tokens: int, element_bytes: int,
                input_bytes: int, on_card: bool, checkpointed: bool) -> dict:
    """The fitted step's terms (measured on the CPU's eager path, no checkpointing) for the job:

    - on a GPU in 16 bits, with Triton installed, the fused gated-attention kernels hold no
      layer's T x T scores, gates or noise (``attention.fused``; a layer with logit soft-capping
      or a head over the kernels' largest, or ATTNLAB_FUSED_ATTENTION=off, stays eager);
    - with gradient checkpointing the backward keeps each layer's input (``input_bytes`` each)
      and recomputes one layer at a time: one layer's share of what the fit saves, plus every
      layer's input."""
    terms = dict(fitted)
    fused = (on_card and element_bytes == 2 and fused_mode() != "off" and shape.head_dim <= FUSED_LARGEST_HEAD
             and not text_config(model_json).get("attn_logit_softcapping")
             and importlib.util.find_spec("triton") is not None)
    if fused:
        terms["scores"] = 0.0
    if checkpointed:
        terms["saved"] = terms["saved"] / shape.depth + shape.depth * row_tokens * shape.hidden * input_bytes
        terms["scores"] = terms["scores"] / shape.depth
    return terms
