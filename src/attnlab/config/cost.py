"""What a model-running job costs, from the model's config.json and the stage's settings (pure
standard library: Snakemake reads it while it parses the workflow).

Memory: the weights (counted from the config: embeddings, each layer's q/k/v/o and MLP, the
head where it is not tied) plus, per stage, a sum of terms each a product of the model's shape
and the workload (``features``: the elements a stage holds at its peak). Terms the code
allocates as counted (``EXACT``: edge attribution's gradients and senders, the corrupted
recordings, the KV cache, mediation's two recorded runs) take one element's bytes each; the others a coefficient in bytes per
element fitted by non-negative least squares to the peaks ``benchmarks/scale.py`` measured at
the papers' models' width (``benchmarks/scale_fit.py`` writes ``cost_coefficients.json`` beside
this module). Time: seconds per multiply-add of the stage (``work_units``) and per pass through
a layer (``layer_passes``), fitted the same way for each device kind measured. A family or stage
the table has no coefficients for has no estimate (None), and the caller says so in its log; a
device without a time fit has a memory estimate and no time (``Estimate.seconds`` None).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from attnlab.anatomy.families import BY_MODEL_TYPE, CONFIG_FIELDS, text_config

COEFFICIENTS = Path(__file__).with_name("cost_coefficients.json")
MEASURED_DEPTH = 4  # benchmarks/scale.py measured models of 1, 2 and 4 layers
# Terms counted exactly as the code allocates them: one element of the stage's dtype each, not
# fitted (fitting them beside terms that grow in step with them in every measurement would
# split one sum between them at random)
EXACT = {"edge_scores": ("gradients", "senders"), "edge_circuit": ("recordings", "table"),
         "generation": ("kv_cache",), "mediation": ("recorded",)}
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
                       post_norms=family.norm_places != "pre")
        except (KeyError, TypeError, ValueError):
            return None

    def layer_parameters(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return attention + mlp

    def parameters(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.depth * self.layer_parameters()

    # the edge graph (attnlab.interventions.edges.Graph)
    def senders(self) -> int:
        return 1 + self.depth * (self.heads + 1)

    def receivers(self) -> int:
        return 1 + self.depth * (self.heads + 2 * self.kv_heads + 1)

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
                "scores": rows * s.heads * tokens * tokens}
    if stage == "edge_scores":  # the receivers' gradients, the clean and corrupted recordings at the points
        rows, tokens, points = w["batch"], w["tokens"], w["points_per_batch"]
        return {"gradients": points * s.hidden * s.receivers(), "senders": 2 * points * s.recorded_per_point(),
                "autograd": s.depth * rows * tokens * per_token,
                # one layer's attention projections' size, whatever the depth (the 1-layer peaks
                # of OLMo-7B, Llama and Qwen exceed the other terms by about this: a per-layer copy)
                "projections": s.hidden * s.head_dim * (2 * s.heads + 2 * s.kv_heads)}
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
                "scores": rows * s.heads * tokens * tokens}
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


def work_units(stage: str, shape: Shape, work: dict) -> float:
    """The stage's work in multiply-adds, the unit its seconds are fitted in: tokens × the
    decoder's weights per token (and the output head's where the stage computes every token's
    logits: generation's steps, post-training), times the passes the stage takes. Extraction,
    patching and edges read a few logits only (``logits_to_keep``)."""
    decoder = shape.depth * shape.layer_parameters()
    head = shape.vocab * shape.hidden
    if stage == "extraction":  # the decoder, and each layer's T x T scores
        tokens = work["tokens"]
        return work.get("batch", 1) * tokens * (decoder + shape.depth * tokens * shape.heads * shape.head_dim)
    if stage == "heads":  # a clean and a corrupted forward, then each head's pass resumed at its layer
        layers = shape.depth
        resumed = shape.heads * layers * (layers + 1) / 2  # layer passes: a head of layer l runs L - l layers
        return 2 * work["prompts"] * work["tokens"] * shape.layer_parameters() * (layers + resumed)
    if stage == "mediation":
        layers = shape.depth
        resumed = shape.heads * layers * (layers + 1) / 2
        return work["prompts"] * work["tokens"] * shape.layer_parameters() * (
            2 * resumed + _mediation_forwards(layers, work) * layers)
    if stage == "edge_scores":  # per chunk a recording forward and `steps` forward-and-backwards (3 forwards each)
        return work["prompts"] * work["tokens"] * decoder * (1 + 3 * work.get("steps", 5)) * work.get("chunks", 1)
    if stage == "edge_circuit":  # the patched forward and, for the mixes, about another
        return work["prompts"] * work["tokens"] * decoder * 2
    if stage == "generation":
        return work["batch"] * (work["prompt_tokens"] + work["new_tokens"]) * (decoder + head)
    if stage == "lora_step":  # forward and backward
        return work["batch"] * work["tokens"] * (decoder + head) * 3
    raise ValueError(f"no cost model for stage {stage!r}")


def layer_passes(stage: str, shape: Shape, work: dict) -> float:
    """Passes through one layer the stage takes: each costs time beyond its multiply-adds (the
    hooks and launches of a layer), which a small batch pays more often."""
    layers, batches = shape.depth, -(-work.get("prompts", 1) // work.get("batch", work.get("prompts", 1)))
    if stage == "extraction":
        return layers
    if stage == "heads":
        return batches * (2 * layers + shape.heads * layers * (layers + 1) / 2)
    if stage == "mediation":
        return batches * (2 * shape.heads * layers * (layers + 1) / 2 + _mediation_forwards(layers, work) * layers)
    if stage == "edge_scores":
        return batches * work.get("chunks", 1) * (1 + work.get("steps", 5)) * layers
    if stage == "edge_circuit":
        return batches * layers
    if stage == "generation":
        return work["new_tokens"] * layers
    if stage == "lora_step":
        return 3 * layers
    raise ValueError(f"no cost model for stage {stage!r}")


def _mediation_forwards(layers: int, work: dict) -> int:
    """Mediation's whole forwards besides the heads' resumed passes: each condition recorded, one
    per ARM seed, and in each direction two per patched layer (its MLP, its residual stream) and
    three groups (layer 0's attention, the top heads, every head with every MLP)."""
    return 2 + work.get("arm_seeds", 0) + 2 * (2 * work.get("patched", layers) + 3)


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
    per_unit = fitted.get("seconds_per_unit", {}).get(device)
    per_pass = fitted.get("seconds_per_layer_pass", {}).get(device, 0.0)
    seconds = None if per_unit is None else (per_unit * work_units(stage, shape, work)
                                            + per_pass * layer_passes(stage, shape, work))
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
             f"over-estimated many times, benchmarks/README.md)")
    return f"{stage} ({sizes}{times}): estimated peak and time of this workload {found.describe()}{reach}"
