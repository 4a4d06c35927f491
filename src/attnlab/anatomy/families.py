"""The model families attnlab knows, as data (pure standard library: Snakemake reads this while it
parses the workflow, to refuse a model no stage can run before any job starts).

A family says where each part of a decoder sits, as attribute names under transformers' own
modules, and how its config names what the stages read. ``attnlab.anatomy.parts`` turns these
names into modules of a loaded model; no other module of the library names a submodule.

Block layouts (``norm_places``):

- ``pre``: x + attn(norm1(x)), then + mlp(norm2(·)) (Llama, Qwen2, GPT-2, OLMo);
- ``sandwich``: x + norm_a(attn(norm1(x))), then + norm_m(mlp(norm2(·))) (Gemma-3);
- ``post``: x + norm_a(attn(x)), then + norm_m(mlp(·)) (OLMo-2): no norm before a sublayer;
- ``pre`` with ``parallel_field`` true in the config (GPT-NeoX: ``use_parallel_residual``):
  x + attn(norm1(x)) + mlp(norm2(x)), the MLP reading the block's input beside the attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# What each kind of norm computes (w: weight, b: bias, both per unit):
NORM_KINDS = {
    "rms": "x · rsqrt(mean(x²) + eps) · w",
    "rms_one_plus": "x · rsqrt(mean(x²) + eps) · (1 + w)  (Gemma: w stored as w − 1)",
    "layer": "(x − mean(x)) · rsqrt(var(x) + eps) · w + b  (torch LayerNorm)",
    "layer_no_params": "(x − mean(x)) · rsqrt(var(x) + eps)  (OLMo-1: no weight, no bias)",
}

STAGES = ("generation", "extraction", "head patching", "edge circuits", "MLP analysis and ARM",
          "sparse post-training", "fused kernels")


@dataclass(frozen=True)
class Family:
    """Where a family's parts sit (attribute names) and how its config names its shape."""

    name: str
    classes: tuple[str, ...]  # the transformers classes of the family's causal LMs
    model_types: tuple[str, ...]  # config.json's model_type (of the text config, for wrappers)
    blocks: str  # the decoder's ModuleList of blocks
    attention: str  # a block's attention module
    projections: dict  # "q", "k", "v", "o" -> attribute of the attention; fused: "qkv"
    norm_kind: str  # one of NORM_KINDS, for every norm of the residual stream
    norm_places: str  # "pre", "sandwich" or "post" (module docstring)
    norms: dict  # "attention_in", "attention_out", "mlp_in", "mlp_out" -> attribute of the block
    final_norm: str  # attribute of the decoder
    mlp: str  # a block's MLP
    mlp_parts: dict  # "in" (the activation's input projection), "activation", "up" (gated), "out"
    embeddings: str  # the decoder's token embeddings
    positions: str  # "rope" or "learned" (absolute, added to the token embeddings)
    qk_norm: str | None = None  # None; "head": per head over head_dim; "all": over every head at once
    qk_norms: tuple[str, str] = ("q_norm", "k_norm")  # attributes of the attention
    dropout: tuple[str, ...] = ("attention_dropout",)  # config fields of dropout, attention first
    contiguous_inputs: bool = False  # its projections view their input (GPT-2's Conv1D): no strided views
    fused_gate_up: bool = False  # the MLP's gate and up projections are one (Phi-3: gate half, then up half)
    kernels_lack: tuple[str, ...] = ()  # what the fused kernels do not compute for it: its layers stay eager
    # a fused qkv's rows: "stacked" (every query head, then every key head, then every value head:
    # GPT-2, Phi-3) or "interleaved" (each head's query, key and value side by side: GPT-NeoX)
    qkv_layout: str = "stacked"
    # the config field saying the block is parallel (x + attn(norm1(x)) + mlp(norm2(x)): the MLP
    # reads the block's input, not the attention's output), where the family has one
    parallel_field: str | None = None
    config_fields: dict = field(default_factory=lambda: dict(CONFIG_FIELDS))

    @property
    def gated_mlp(self) -> bool:
        return "up" in self.mlp_parts

    @property
    def fused_qkv(self) -> bool:
        return "qkv" in self.projections

    def activation_formula(self) -> str:
        """The MLP activation the MLP analysis and ARM read, in the family's own names."""
        return f"{self.mlp_parts['activation']}({self.pre_activation_formula()})"

    def pre_activation_formula(self) -> str:
        if self.fused_gate_up:
            return f"gate half of {self.mlp_parts['in']}(x)"
        return f"{self.mlp_parts['in']}(x)"


CONFIG_FIELDS = {"layers": "num_hidden_layers", "heads": "num_attention_heads",
                 "kv_heads": "num_key_value_heads", "hidden": "hidden_size"}
_LLAMA_PROJECTIONS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
_GATED_MLP = {"in": "gate_proj", "activation": "act_fn", "up": "up_proj", "out": "down_proj"}
_PRE_NORMS = {"attention_in": "input_layernorm", "attention_out": None,
              "mlp_in": "post_attention_layernorm", "mlp_out": None}
_SANDWICH_NORMS = {"attention_in": "input_layernorm", "attention_out": "post_attention_layernorm",
                   "mlp_in": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm"}


def _llama_like(name: str, classes: tuple[str, ...], model_types: tuple[str, ...], **changes) -> Family:
    settings = dict(name=name, classes=classes, model_types=model_types, blocks="layers", attention="self_attn",
                    projections=_LLAMA_PROJECTIONS, norm_kind="rms", norm_places="pre", norms=_PRE_NORMS,
                    final_norm="norm", mlp="mlp", mlp_parts=_GATED_MLP, embeddings="embed_tokens", positions="rope")
    return Family(**{**settings, **changes})


FAMILIES = (
    _llama_like("llama", ("LlamaForCausalLM",), ("llama",)),
    _llama_like("qwen2", ("Qwen2ForCausalLM",), ("qwen2",)),
    _llama_like("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), ("gemma3_text", "gemma3"),
                norm_kind="rms_one_plus", norm_places="sandwich", qk_norm="head", norms=_SANDWICH_NORMS),
    # Gemma-3's sandwich norms without its q/k norms; attention logits soft-capped (tanh(s/c)·c,
    # the attention function's softcap), final logits soft-capped by the model's own forward
    _llama_like("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), norm_kind="rms_one_plus", norm_places="sandwich",
                norms=_SANDWICH_NORMS, kernels_lack=("attention logit soft-capping",)),
    _llama_like("olmo", ("OlmoForCausalLM",), ("olmo",), norm_kind="layer_no_params"),
    _llama_like("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qk_norm="head"),
    _llama_like("mistral", ("MistralForCausalLM",), ("mistral",)),
    # q, k and v stacked in one Linear (q heads, then k heads, then v heads), the gate and up
    # projections in another (gate half first): the activation's input is the gate half
    _llama_like("phi3", ("Phi3ForCausalLM",), ("phi3",), projections={"qkv": "qkv_proj", "o": "o_proj"},
                mlp_parts={"in": "gate_up_proj", "activation": "activation_fn", "up": "gate_up_proj",
                           "out": "down_proj"}, fused_gate_up=True,
                dropout=("attention_dropout", "resid_pdrop", "embd_pdrop")),
    _llama_like("olmo2", ("Olmo2ForCausalLM",), ("olmo2",), norm_places="post", qk_norm="all",
                norms={"attention_in": None, "attention_out": "post_attention_layernorm",
                       "mlp_in": None, "mlp_out": "post_feedforward_layernorm"}),
    Family(name="gpt2", classes=("GPT2LMHeadModel",), model_types=("gpt2",), blocks="h", attention="attn",
           projections={"qkv": "c_attn", "o": "c_proj"}, norm_kind="layer", norm_places="pre",
           norms={"attention_in": "ln_1", "attention_out": None, "mlp_in": "ln_2", "mlp_out": None},
           final_norm="ln_f", mlp="mlp", mlp_parts={"in": "c_fc", "activation": "act", "out": "c_proj"},
           embeddings="wte", positions="learned", dropout=("attn_pdrop", "resid_pdrop", "embd_pdrop"),
           contiguous_inputs=True,
           config_fields={"layers": "n_layer", "heads": "n_head", "kv_heads": "n_head", "hidden": "n_embd"}),
)
FAMILIES += (
    # Pythia: parallel attention and MLP, one query_key_value with each head's q, k, v side by side,
    # rotary on rotary_pct of each head, LayerNorms with biases, an untied output embedding
    Family(name="gpt_neox", classes=("GPTNeoXForCausalLM",), model_types=("gpt_neox",), blocks="layers",
           attention="attention", projections={"qkv": "query_key_value", "o": "dense"}, qkv_layout="interleaved",
           norm_kind="layer", norm_places="pre", parallel_field="use_parallel_residual",
           norms={"attention_in": "input_layernorm", "attention_out": None, "mlp_in": "post_attention_layernorm",
                  "mlp_out": None},
           final_norm="final_layer_norm", mlp="mlp", mlp_parts={"in": "dense_h_to_4h", "activation": "act",
                                                                 "out": "dense_4h_to_h"},
           embeddings="embed_in", positions="rope", dropout=("attention_dropout", "hidden_dropout")),
)
BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}
# GGUF's general.architecture -> transformers' model_type, where they differ
GGUF_ARCHITECTURES = {"gemma3": "gemma3_text"}


class UnknownFamily(ValueError):
    """A model whose family attnlab's anatomy does not know (the message says what to do)."""


def known_model_types() -> list[str]:
    return sorted(BY_MODEL_TYPE)


def family_of(model_type: str, model: str = "the model", stages=STAGES) -> Family:
    """The family of a config's ``model_type``; refused, naming the stages and what is missing."""
    family = BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise UnknownFamily(
            f"{model} is of model_type '{model_type}', a family attnlab's model anatomy "
            f"(attnlab.anatomy.families) does not know; it knows {', '.join(known_model_types())}. "
            f"The stages this config runs on it ({', '.join(stages)}) need its blocks, attention "
            "projections (q, k, v, o), norms and their places, MLP and activation located. Use a model "
            "of a known family, or add a Family for it (docs/anatomy.md, \"Model families\")")
    return family


def dropout_off(config) -> dict[str, float]:
    """Set the dropout fields of a transformers config (its text model's) to 0 before a model is
    built from it: the gated attention implements no dropout, and the sparse post-training
    compares the student with a frozen copy that has none. Returns the fields with the values
    they had."""
    text = config.get_text_config()
    family = family_of(text.model_type, stages=("sparse post-training",))
    before = {name: float(getattr(text, name, 0.0) or 0.0) for name in family.dropout}
    for name in family.dropout:
        setattr(text, name, 0.0)
    return before


def text_config(config: dict) -> dict:
    """The text model's part of a config.json (a multimodal wrapper keeps it under text_config)."""
    return config.get("text_config") or config


def config_shape(config: dict) -> tuple[int, int]:
    """(layers, attention heads) of a config.json (or a GGUF header's ``sources.gguf_config``), in
    its family's own field names (GPT-2: n_layer, n_head) or the standard ones."""
    config = text_config(config)
    family = BY_MODEL_TYPE.get(config.get("model_type", ""))
    for fields in ([family.config_fields] if family else []) + [CONFIG_FIELDS]:
        if fields["layers"] in config and fields["heads"] in config:
            return int(config[fields["layers"]]), int(config[fields["heads"]])
    raise KeyError(f"a config with neither {CONFIG_FIELDS['layers']} nor its family's name for the layers")
