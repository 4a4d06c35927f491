"""What a model-running job costs, from the model's config.json and the stage's settings (pure
standard library: Snakemake reads it while it parses the workflow).

Memory: the weights (counted from the config: embeddings, each layer's q/k/v/o and MLP, the
head where it is not tied) plus, per stage, a sum of terms each a product of the model's shape
and the workload (``features``: the elements a stage holds at its peak). Terms the code
allocates as counted (``EXACT``: edge attribution's gradients and senders, the corrupted
recordings, the KV cache, mediation's two recorded runs) take one element's bytes each; the
others a coefficient in bytes per element fitted by non-negative least squares to the peaks
``benchmarks/scale/measure.py`` measured at the papers' models' width (``benchmarks/scale/fit.py``
writes ``cost_coefficients.json`` beside this module). Time: seconds per unit of each of the
stage's ``time_features`` (its multiply-adds, the weights its passes read, ...), fitted the same
way for each device kind measured. A family or stage the table has no coefficients for has no
estimate (None), and the caller says so in its log; a
device without a time fit has a memory estimate and no time (``Estimate.seconds`` None).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from attnlab.anatomy.families import BY_MODEL_TYPE, CONFIG_FIELDS, text_config

COEFFICIENTS = Path(__file__).with_name("cost_coefficients.json")
MEASURED_DEPTH = 4  # benchmarks/scale/measure.py measured models of 1, 2 and 4 layers
# Terms counted exactly as the code allocates them: one element of the stage's dtype each, not
# fitted (fitting them beside terms that grow in step with them in every measurement would
# split one sum between them at random)
EXACT = {"edge_scores": ("gradients", "senders"), "edge_circuit": ("recordings", "table"),
         "generation": ("kv_cache",), "mediation": ("recorded",), "heads": ("references",),
         "head_attribution": ("references",)}
# model types whose transformers config ties the output head to the embeddings when config.json
# does not say (a resolved Gemma-3 text config leaves the key out)
TIED_BY_DEFAULT = frozenset({"gpt2", "gemma", "gemma2", "gemma3", "gemma3_text"})


@dataclass(frozen=True)
class Shape:
    """The sizes a stage's memory and time depend on."""

    depth: int  # decoder layers
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated_mlp: bool
    tied: bool
    post_norms: bool = False  # a norm after each sublayer (Gemma-3's sandwich, OLMo-2)
    fused_qkv: bool = False  # one projection for q, k and v (GPT-2's c_attn, Phi-3, GPT-NeoX)

    @classmethod
    def of(cls, config: dict) -> "Shape | None":
        """The shape of a config.json (a wrapper's text_config), or None for a family attnlab
        does not know or a config that lacks a size."""
        config = text_config(config)
        family = BY_MODEL_TYPE.get(config.get("model_type", ""))
        if family is None:
            return None
        fields = {**CONFIG_FIELDS, **family.config_fields}
        try:
            hidden, heads = int(config[fields["hidden"]]), int(config[fields["heads"]])
            kv_heads = int(config.get(fields["kv_heads"]) or heads)
            intermediate = int(config.get("intermediate_size") or config.get("n_inner") or 4 * hidden)
            return cls(depth=int(config[fields["layers"]]), hidden=hidden, heads=heads, kv_heads=kv_heads,
                       head_dim=int(config.get("head_dim") or hidden // heads), intermediate=intermediate,
                       vocab=int(config["vocab_size"]), gated_mlp=family.gated_mlp,
                       tied=bool(config.get("tie_word_embeddings", config.get("model_type") in TIED_BY_DEFAULT)),
                       post_norms=family.norm_places != "pre", fused_qkv=family.fused_qkv)
        except (KeyError, TypeError, ValueError):
            return None

    def attention_parameters(self) -> int:
        """One layer's q, k, v and o projections."""
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    def mlp_parameters(self) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden * self.intermediate

    def layer_parameters(self) -> int:
        return self.attention_parameters() + self.mlp_parameters()

    def parameters(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.depth * self.layer_parameters()

    # the edge graph (attnlab.interventions.edges.Graph)
    def senders(self) -> int:
        return 1 + self.depth * (self.heads + 1)

    def receivers(self) -> int:
        return 1 + self.depth * (self.heads + 2 * self.kv_heads + 1)

    def edges(self) -> int:
        """Every sender feeding every later receiver (``Graph.n_edges``; a block's MLP reads its
        heads)."""
        before = [1 + layer * (self.heads + 1) for layer in range(self.depth)]
        return (sum((self.heads + 2 * self.kv_heads) * first + first + self.heads for first in before)
                + self.senders())

    def recorded_per_point(self) -> int:
        """Elements a ``Recording`` holds per point: every sender's contribution, each layer's
        input and its MLP's input, the final norm's input; where no norm follows the attention,
        also its heads' outputs and the attention's output (what a patched pass adds back)."""
        recorded = self.hidden * (self.senders() + 2 * self.depth + 1)
        if not self.post_norms:
            recorded += self.depth * (self.heads * self.head_dim + self.hidden)
        return recorded

    def outputs_per_token(self) -> int:
        """A layer's q, k, v, o and MLP outputs per token (a recording keeps them before the points)."""
        return self.head_dim * (self.heads + 2 * self.kv_heads) + 2 * self.hidden


def features(stage: str, shape: Shape, work: dict) -> dict[str, float]:
    """The elements ``stage`` holds at its peak, by kind, for ``work`` (its workload's sizes: tokens,
    batch, prompts, points)."""
    s, w = shape, work
    per_token = s.hidden + s.intermediate
    if stage == "extraction":  # one layer at a time; each head's T × T scores, reduced as computed
        rows, tokens = w.get("batch", 1), w["tokens"]
        return {"activations": rows * tokens * per_token, "scores": rows * s.heads * tokens * tokens}
    if stage == "heads":  # every layer's input recorded, then heads patched in groups, a batch at a time
        rows, tokens = 2 * min(w["prompts"], w.get("batch", w["prompts"])), w["tokens"]
        return {"recorded": s.depth * rows * tokens * s.hidden, "activations": rows * tokens * per_token,
                "scores": rows * s.heads * tokens * tokens, "references": _references(s, w)}
    if stage == "head_attribution":  # a backward to the heads' gates: every layer's saved activations
        rows, tokens = min(w["prompts"], w.get("batch", w["prompts"])), w["tokens"]
        return {"autograd": s.depth * rows * tokens * per_token, "activations": rows * tokens * per_token,
                "logits": rows * 2 * s.vocab, "references": _references(s, w)}  # logits: the last 2 positions'
    if stage == "edge_scores":  # the receivers' gradients, the clean and corrupted recordings at the points
        rows, tokens, points = w["batch"], w["tokens"], w["points_per_batch"]
        return {"gradients": points * s.hidden * s.receivers(), "senders": 2 * points * s.recorded_per_point(),
                "autograd": s.depth * rows * tokens * per_token,
                # the receivers' gradient hook (interventions/edges/stand_ins._input_gradient): its
                # copy of the largest projection's weight with the pre-norm's folded in (the query's;
                # a fused q, k, v's whole), and each query head's input gradient at the points as it
                # builds them (product, gather, scaling); found with torch's profiler on Llama, Gemma
                "projections": (s.heads + 2 * s.kv_heads if s.fused_qkv else s.heads) * s.head_dim * s.hidden,
                "hook": s.heads * points * s.hidden}
    if stage == "edge_circuit":  # every batch's corrupted recording, and one batch's senders' table
        elsewhere = (w["prompts"] * w["tokens"] - w["points"]) * s.depth * s.outputs_per_token()
        return {"recordings": w["points"] * s.recorded_per_point() + elsewhere,
                "table": w["points_per_batch"] * s.hidden * (s.senders() + 2),
                # one layer's query/key/value receivers' own inputs (layer 0's read the embeddings as they are)
                "mixes": w["points_per_batch"] * s.hidden * (s.heads + 2 * s.kv_heads) * (s.depth > 1),
                "per_layer": s.depth * w["points_per_batch"] * s.hidden,  # each layer's inputs at the points
                "activations": w["batch"] * w["tokens"] * per_token}
    if stage == "mediation":  # both conditions' recordings of every item; a batch's resumed layer inputs, one pass
        rows, tokens = min(w["prompts"], w.get("batch", w["prompts"])), w["tokens"]
        patched = w.get("patched", s.depth)  # layers whose MLP and residual stream are patched one at a time
        return {"recorded": 2 * w["prompts"] * tokens * (s.depth * (s.heads * s.head_dim + s.hidden)
                                                         + patched * s.hidden),
                "resumed": s.depth * rows * tokens * s.hidden, "activations": rows * tokens * per_token,
                "scores": rows * s.heads * tokens * tokens,
                # the metric's logits at the scored positions over the whole vocabulary, and their
                # log-softmax in float64 (runs.continuation_metric)
                "logits": rows * w.get("scored", 1) * s.vocab}
    if stage == "mlp_activations":  # a batch's forward, stopped at the recorded layer; the padded rows' T x T
        rows, tokens = w["batch"], w["tokens"]
        return {"activations": rows * tokens * per_token, "scores": rows * s.heads * tokens * tokens}
    if stage == "generation":  # the KV cache, a step's activations and logits
        rows, tokens = w["batch"], w["prompt_tokens"] + w["new_tokens"]
        return {"kv_cache": rows * tokens * s.depth * 2 * s.kv_heads * s.head_dim,
                "activations": rows * w["prompt_tokens"] * per_token,
                "per_layer": s.depth * rows * w["prompt_tokens"] * s.hidden, "logits": rows * s.vocab}
    if stage == "lora_step":  # what the backward pass keeps, and the logits with their gradient
        rows, tokens = w["batch"], w["tokens"]
        return {"saved": s.depth * rows * tokens * per_token,
                "scores": s.depth * rows * s.heads * tokens * tokens, "logits": rows * tokens * s.vocab}
    raise ValueError(f"no cost model for stage {stage!r}")


def _references(s: Shape, w: dict) -> int:
    """The head-patching engine's references (``patching.heads.Patcher``): every layer's heads'
    outputs of every prompt under the ablation, kept for the whole job, not one mini-batch's."""
    return s.depth * w["prompts"] * w["tokens"] * s.heads * s.head_dim


def time_features(stage: str, shape: Shape, work: dict) -> dict[str, float]:
    """What a stage's seconds are fitted on, for ``work``:

    - ``multiply_adds``: the stage's multiply-adds in passes of many rows (every token of a
      batch: prompts, recordings, backward passes; attention's T x T products);
    - ``row_multiply_adds``: those of passes of a few rows (generation's steps: one token per
      row; on a CPU a matrix times a few vectors runs many times slower per multiply-add);
    - ``weights_read``: the parameters each pass reads, summed over the passes (a pass of few
      rows costs about its weights, whatever its rows);
    - ``receiver_elements``: edge attribution's per-receiver inputs and gradients, one element of
      width per receiver and point (memory traffic, no multiply-adds);
    - ``runs``: 1, a constant per run (building the batch, the first pass's setup), in the
      stages of a few passes only: beside hundreds of passes it is not identifiable, and fitted
      anyway it made a family left out of the fit many times worse (benchmarks/scale/README.md).

    A pass reads the logits the stage's metric reads: exact patching and edges a few tokens'
    (``readout``), mediation every token's at its scored positions, generation every token's
    at each step."""
    s, w = shape, work
    layer, head = s.layer_parameters(), s.vocab * s.hidden
    decoder = s.depth * layer
    batches = -(-w.get("prompts", w.get("batch", 1)) // w.get("batch", w.get("prompts", 1)))
    if stage == "extraction":  # one forward per batch, and each layer's T x T scores (queries by keys, then values)
        rows, tokens = w.get("batch", 1), w["tokens"]
        scores = s.depth * s.heads * tokens * tokens * s.head_dim * 2
        return {"multiply_adds": batches * rows * (tokens * decoder + scores), "weights_read": batches * decoder,
                "runs": 1}
    if stage == "mlp_activations":  # a forward per batch through the layers up to the recorded one, no LM head
        rows, tokens, run = w["batch"], w["tokens"], w.get("layers_run", s.depth)
        scores = run * s.heads * tokens * tokens * s.head_dim * 2
        return {"multiply_adds": batches * rows * (tokens * run * layer + scores), "weights_read": batches * run * layer,
                "runs": 1}
    if stage in ("heads", "mediation"):
        return _patching_time(stage, s, w, batches)
    if stage == "head_attribution":  # the references' forward, then a forward and a backward (about two)
        return {"multiply_adds": 4 * w["prompts"] * (w["tokens"] * decoder + 2 * head),
                "weights_read": 4 * batches * (decoder + head), "runs": 1}
    if stage == "edge_scores":  # per batch and chunk a recording forward and `steps` forward-and-backwards
        passes = (1 + 3 * w.get("steps", 5)) * w.get("chunks", 1)
        points = batches * w["points_per_batch"]
        return {"multiply_adds": w["prompts"] * w["tokens"] * decoder * passes
                + points * s.hidden * s.senders() * s.receivers(),  # the scores: differences x gradients
                "weights_read": batches * passes * decoder,
                "receiver_elements": points * s.hidden * s.receivers() * (1 + w.get("steps", 5))}
    if stage == "edge_circuit":  # the corrupted recording, the patched forward and its receivers' mixes
        return {"multiply_adds": 3 * w["prompts"] * w["tokens"] * decoder,
                "receiver_elements": w["points"] * s.hidden * s.receivers(), "runs": 1}
    if stage == "generation":  # a prefill (the last position's logits), then a step per new token
        rows = w["batch"]
        return {"multiply_adds": batches * rows * (w["prompt_tokens"] * decoder + head),
                "row_multiply_adds": batches * rows * w["new_tokens"] * (decoder + head), "runs": 1}
    if stage == "lora_step":  # forward and backward (about two forwards), every token's logits
        rows, tokens = w["batch"], w["tokens"]
        scores = s.depth * s.heads * tokens * tokens * s.head_dim * 2
        return {"multiply_adds": 3 * rows * (tokens * (decoder + head) + scores), "weights_read": 3 * (decoder + head),
                "runs": 1}
    raise ValueError(f"no cost model for stage {stage!r}")


def _patching_time(stage: str, s: Shape, w: dict, batches: int) -> dict[str, float]:
    """Exact head patching's (and mediation's, which patches every head in both directions and
    then each layer's MLP and residual stream) time features: its whole forwards, and a resumed
    pass per head (``patching.heads.Patcher.exact``: a head of layer l runs l's o_proj and MLP,
    then the layers above; the last layer's MLP at the read positions only, counted as none). A
    sweep (``exact`` false) runs only its whole forwards, one per k kept."""
    depth, mlp, attention = s.depth, s.mlp_parameters(), s.attention_parameters()
    o = s.heads * s.head_dim * s.hidden
    resumed = s.heads * (depth * o + (depth - 1) * mlp + depth * (depth - 1) / 2 * attention
                         + (depth - 1) * (depth - 2) / 2 * mlp)
    head = s.vocab * s.hidden
    if stage == "heads":  # the reference's and the recording's forwards (and any sweep's; attribution is its own stage)
        forwards, head_passes, scored = w.get("forwards", 2), s.heads * depth, 0
        if not w.get("exact", True):  # a sweep: whole patched forwards only, no head resumed alone
            head_passes, resumed = 0, 0
    else:  # both conditions recorded, ARM's seeds; per direction a recording, the parts and three groups
        forwards = 2 + w.get("arm_seeds", 0) + 2 * (1 + 2 * w.get("patched", depth) + 3)
        head_passes, scored, resumed = 2 * s.heads * depth, w.get("scored", 1), 2 * resumed
    per_row_token = forwards * depth * s.layer_parameters() + resumed  # parameters, summed over the passes
    passes = forwards + head_passes
    # the LM head: every token's logit at mediation's scored positions (exact patching reads a few)
    logits = passes * head if scored else 0
    return {"multiply_adds": w["prompts"] * (w["tokens"] * per_row_token + scored * logits),
            "weights_read": batches * (per_row_token + logits)}


@dataclass(frozen=True)
class Estimate:
    """A job's estimated peak memory (bytes) and seconds, and what they rest on."""

    memory_bytes: float
    weights_bytes: float
    seconds: float | None
    terms: dict

    def describe(self) -> str:
        terms = ", ".join(f"{name} {value / 1e9:.2f} GB" for name, value in self.terms.items())
        time = "no time fit for this device" if self.seconds is None else f"{self.seconds / 60:.1f} min"
        return (f"{self.memory_bytes / 1e9:.1f} GB (weights {self.weights_bytes / 1e9:.1f} GB; {terms}); {time}")


def in_sequence(first: Estimate | None, then: Estimate | None, then_runs: int = 1) -> Estimate | None:
    """One job's estimate of two stages run one after the other (``then`` ``then_runs`` times): the
    larger peak (each frees what it held), the seconds of all (None where either has none)."""
    if first is None or then is None:
        return None
    larger = max(first, then, key=lambda found: found.memory_bytes)
    seconds = None if first.seconds is None or then.seconds is None else first.seconds + then.seconds * then_runs
    return Estimate(larger.memory_bytes, larger.weights_bytes, seconds, larger.terms)


@functools.lru_cache(maxsize=4)
def load_coefficients(path: Path = COEFFICIENTS) -> dict:
    """The fitted table (read once per process: Snakemake asks every planned job's resources).
    Callers read it and never change it."""
    return json.loads(path.read_text()) if path.exists() else {}


def estimate(stage: str, config: dict, work: dict, dtype_bytes: int, device: str = "cpu",
             coefficients: dict | None = None) -> Estimate | None:
    """The job's peak memory and time on ``device`` ("cpu" or "cuda") with weights and activations
    of ``dtype_bytes`` each, or None where the family or the stage has no fit."""
    shape = Shape.of(config)
    table = load_coefficients() if coefficients is None else coefficients
    fitted = table.get("stages", {}).get(stage)
    if shape is None or fitted is None:
        return None
    scale = dtype_bytes / fitted["dtype_bytes"]  # coefficients are per element at the measured dtype
    counted = features(stage, shape, work)
    if set(counted) - set(fitted["memory"]):  # a table fitted before a term was added: refit it
        return None
    terms = {name: fitted["memory"][name] * value * scale for name, value in counted.items()}
    terms["constant"] = fitted["constant_bytes"]  # the interpreter's and the allocator's share
    weights = shape.parameters() * dtype_bytes
    per_feature = fitted.get("seconds", {}).get(device)
    timed = time_features(stage, shape, work)
    seconds = None if per_feature is None or set(timed) - set(per_feature) else sum(
        per_feature[name] * value for name, value in timed.items())
    return Estimate(weights + sum(terms.values()), weights, seconds, terms)


def described(stage: str, config: dict, work: dict, dtype_bytes: int, device: str, repeats: int = 1) -> str:
    """A log line: the stage's estimate for ``work`` done ``repeats`` times, or why there is none."""
    found = estimate(stage, config, work, dtype_bytes, device)
    if found is None:
        return f"{stage}: no cost estimate (the fit has no family or coefficients for it)"
    if repeats > 1 and found.seconds is not None:
        found = Estimate(found.memory_bytes, found.weights_bytes, found.seconds * repeats, found.terms)
    sizes = ", ".join(f"{key} {value}" for key, value in work.items())
    times = f", {repeats} times" if repeats > 1 else ""
    reach = ("" if Shape.of(config).depth <= MEASURED_DEPTH else
             f" (extrapolated: the fit measured 1 to {MEASURED_DEPTH} layers; a deep narrow model's time can be "
             f"over-estimated many times, benchmarks/scale/README.md)")
    return f"{stage} ({sizes}{times}): estimated peak and time of this workload {found.describe()}{reach}"
