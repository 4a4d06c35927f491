"""What a sparse copy's post-training job (``sparsify_model``) costs, composed from the cost fit's
one measured training step (``lora_step``: the student's forward and backward under its gates,
``benchmarks/scale.py``) and what the settings say the job holds and runs (pure standard
library, as ``attnlab.config.cost``).

Memory: every model copy the job loads and every trained weight's state, counted, not fitted;
and one step's activations from the fit:

- the frozen base (the KL reference, and the base under LoRA): bfloat16 on a GPU, float32 on the
  CPU (``sparsify.train.Trainer``);
- the student, and under ``constraint: ce_control`` the dense control beside it: each the base's
  parameters (frozen dtype under LoRA, float32 where weights train);
- per trained parameter (LoRA's adapters, or the weights ``train`` selects) in float32: its
  gradient and AdamW's two moments, and under LoRA the adapter itself; for the control again;
- the step's activations: the ``lora_step`` fit at the job's batch and sequence length, in
  bfloat16 under autocast on a GPU. With ``gradient_checkpointing`` the backward keeps less than
  the fit measured (the fit's "saved" term): the estimate is then an upper bound;
- the base's logits on a batch under ``constraint: kl``, and the base's held-out logits the
  evaluations reuse (at most 2 GB per source: ``sparsify.heldout.logits_fit``).

Time: ``steps`` training steps, each the fitted step (the control's step too under
``ce_control``; the base's forward under ``kl``, a third of a step, as ``cost.time_features``
counts a step as three forwards), and the forwards of the held-out evaluations (every
``eval_every`` steps and at the end) and of the gate-bias calibration (its scan, and at most
every layer in every per-layer round), each a third of a step per batch. A GPU has no time fit.
"""

from __future__ import annotations

import math

from attnlab.anatomy.families import text_config
from attnlab.config import cost
from attnlab.config.checks import FUSED_LARGEST_HEAD, fused_mode

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
    frozen = 2 if on_card else FLOAT32
    trainable_copies = 2 if control else 1
    terms = {"base": shape.parameters() * frozen,
             "trained_copies": trainable_copies * shape.parameters() * (frozen if lora else FLOAT32),
             "optimizer": trainable_copies * trained_parameters(shape, settings) * FLOAT32 * (3 + lora),
             **_step_terms(step.terms, shape, model_json, rows * tokens, activations, on_card,
                           settings["gradient_checkpointing"])}
    if settings["constraint"]["type"] == "kl":
        terms["base_logits"] = rows * tokens * shape.vocab * FLOAT32
    sources = len(settings["corpus"].get("mixture", {})) or 1
    terms["heldout_logits"] = min(sources * HELDOUT_LOGITS_BUDGET,
                                  settings["heldout_sequences"] * tokens * shape.vocab * FLOAT32)
    weights = terms["base"] + terms["trained_copies"]
    seconds = None if step.seconds is None else step.seconds * _steps_worth(settings, shape.depth, trainable_copies)
    return cost.Estimate(sum(terms.values()), weights, seconds, terms)


def _step_terms(fitted: dict, shape: cost.Shape, model_json: dict, row_tokens: int, element_bytes: int,
                on_card: bool, checkpointed: bool) -> dict:
    """The fitted step's terms (measured on the CPU's eager path, no checkpointing) for the job:

    - on a GPU in 16 bits the fused gated-attention kernels hold no layer's T x T scores, gates or
      noise (``attention.fused``; a layer with logit soft-capping or a head over the kernels'
      largest, or ATTNLAB_FUSED_ATTENTION=off, stays eager and keeps them);
    - with gradient checkpointing the backward keeps each layer's input and recomputes one layer
      at a time: one layer's share of what the fit saves, plus every layer's input."""
    terms = dict(fitted)
    text = text_config(model_json)
    fused = (on_card and element_bytes == 2 and fused_mode() != "off" and shape.head_dim <= FUSED_LARGEST_HEAD
             and not text.get("attn_logit_softcapping"))
    if fused:
        terms["scores"] = 0.0
    if checkpointed:
        terms["saved"] = terms["saved"] / shape.depth + shape.depth * row_tokens * shape.hidden * element_bytes
        terms["scores"] = terms["scores"] / shape.depth
    return terms


def _steps_worth(settings: dict, depth: int, trainable_copies: int) -> float:
    """The job's time in fitted steps: each training step (the control's too; the base's forward
    under kl), then every evaluation's and the calibration's forwards at a third of a step each."""
    batch = settings["batch_size"]
    per_step = trainable_copies + (1 / 3 if settings["constraint"]["type"] == "kl" else 0)
    heldout_batches = math.ceil(settings["heldout_sequences"] / batch)
    evaluations = settings["steps"] // settings["eval_every"] + 1
    # each evaluation runs the student (and the control); the base's logits once, reused
    forwards = heldout_batches * (1 + evaluations * trainable_copies)
    calibration = settings["calibrate_gate_bias"]
    if calibration["enabled"]:
        scan = int((settings["gate_bias"] - calibration["lowest"]) / calibration["step"] + 1e-9) + 1
        calibration_batches = math.ceil(calibration["sequences"] / batch)
        forwards += calibration_batches * (1 + scan)  # the reference's logits, then each b' of the scan
        per_layer = calibration["per_layer"]
        if per_layer["enabled"]:  # each round: every layer probed alone, then the accepted step on all
            probe = math.ceil(per_layer["sensitivity_sequences"] / batch)
            forwards += per_layer["rounds"] * (depth * probe + calibration_batches)
    return settings["steps"] * per_step + forwards / 3
