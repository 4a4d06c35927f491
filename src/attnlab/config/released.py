"""The sparse models released with arXiv 2512.05865 as a model source (``format: circuitlab_gpt2``):
their layout as the lead author's public loader reads it, checked without torch.

What that loader reads (circuits-research/CircuitLab at dcf4cc8, ``src/clt_forge/transformer_lens/``:
``sparse_patching.py``, ``files_to_patch/loading_from_pretrained.py`` and
``files_to_patch/components/abstract_attention.py``; docs/sparsify.md): the hub repository's
``final.pth``, loaded with ``torch.load`` and used as it is as a TransformerLens ``HookedTransformer``
state dict (no key renamed: ``embed.W_E`` [d_vocab, d_model], ``blocks.{l}.attn.W_Q`` [heads, d_model,
d_head], ``unembed.W_U`` [d_model, d_vocab], ...), the vocabulary padded to 50,304 rows (GPT-2's 50,257
rounded up to a multiple of 64), the dimensions, activation and ``use_sparse_attn`` from the
repository's config.json, the GPT-2 tokenizer. Evaluation multiplies each head's softmax weights by
``1[scores > 0]``, scores = q·k/√d_head after the causal mask, not renormalised: attnlab's gate
``1[s + b > 0]`` at b = 0.

Here: the expected keys and shapes, a reader of a checkpoint's keys and shapes that builds no
tensor (the zip's ``data.pkl`` through a whitelist), the config fields, the padding rule and where
the files are. Cheap enough for the config check that runs before any job; the conversion
(``attnlab.released``) runs the same checks on the loaded tensors.
"""

from __future__ import annotations

import json
import math
import pickle
import re
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from attnlab.config.checks import ConfigError

GPT2_FORMAT, LLAMA_FORMAT = "circuitlab_gpt2", "circuitlab_llama"
CHECKPOINT, CONFIG = "final.pth", "config.json"
PAD_MULTIPLE = 64  # 50,257 -> 50,304, as the loader's comment and its hard-coded d_vocab say
DEFAULT_TOKENIZER = "gpt2"  # the loader's tokenizer_name for these models (no tokenizer files on the hub)
LOADER = "CircuitLab (circuits-research/CircuitLab at dcf4cc8, src/clt_forge/transformer_lens/)"
# Activations TransformerLens and transformers both name and compute alike
ACTIVATIONS = ("gelu_new", "gelu", "gelu_fast", "gelu_pytorch_tanh", "relu", "silu")
# TransformerLens config fields and the GPT-2 config names the loader's other branch reads them by
_ALIASES = {"d_model": "n_embd", "n_layers": "n_layer", "n_heads": "n_head", "n_ctx": "n_positions",
            "act_fn": "activation_function", "eps": "layer_norm_epsilon", "d_vocab": "vocab_size"}
# Fields a GPT-2 conversion cannot honour unless they hold these values (absent: TransformerLens's default)
_FIXED = {"normalization_type": ("LN",), "positional_embedding_type": ("standard",), "attention_dir": ("causal",),
          "scale_attn_by_inverse_layer_idx": (False,), "attn_only": (False,), "use_local_attn": (False,),
          "use_attn_scale": (True,), "parallel_attn_mlp": (False,), "final_rms": (False,)}

LLAMA_REFUSAL = (
    "format circuitlab_llama is not supported: the public loader, {loader}, reads "
    "ansonisl/ShortSparseLlama1B's final.pth as a TransformerLens state dict whose Llama layout (grouped "
    "key/value heads, rotary settings, RMS norms, gated MLP) is set by the hub repository's config.json, and no "
    "public code or text read here spells that file out (the loader's branch for these models reads only "
    "d_model, d_head, d_vocab, d_mlp, n_layers, n_ctx, act_fn, tokenizer_name and use_sparse_attn). A conversion "
    "written blind could load wrong weights without a word. Use a released GPT-2 (format: circuitlab_gpt2) or "
    "attnlab's own sparse copy of a Llama (source.sparsify); docs/sparsify.md says more")
LAYOUT_FIX = (f"This format reads final.pth exactly as released and as {LOADER} reads it: a TransformerLens "
              "state dict (docs/sparsify.md, 'The released sparse models'). Point the source at the released "
              "file itself, not a training checkpoint or a re-saved model")


class ReleasedModelError(ConfigError):
    """A released model's files are not what the format reads; the message says which key or field."""


@dataclass(frozen=True)
class Dims:
    """A checkpoint's dimensions, read from its shapes."""

    n_layers: int
    d_model: int
    heads: int
    d_head: int
    d_mlp: int
    n_ctx: int
    padded_vocab: int


@dataclass(frozen=True)
class Settings:
    """What config.json adds to the shapes."""

    activation: str
    eps: float
    gated: bool  # use_sparse_attn (absent: gated, as the format's models are)
    tokenizer_name: str | None
    config_vocab: int | None


def expected_shapes(dims: Dims) -> dict[str, tuple[int, ...]]:
    """Every parameter of a TransformerLens GPT-2-style state dict, in its own order, with its shape."""
    d, heads, d_head, mlp, vocab = dims.d_model, dims.heads, dims.d_head, dims.d_mlp, dims.padded_vocab
    shapes = {"embed.W_E": (vocab, d), "pos_embed.W_pos": (dims.n_ctx, d)}
    for layer in range(dims.n_layers):
        block = f"blocks.{layer}."
        shapes.update({block + "ln1.w": (d,), block + "ln1.b": (d,), block + "ln2.w": (d,), block + "ln2.b": (d,)})
        shapes.update({f"{block}attn.W_{x}": (heads, d, d_head) for x in "QKV"})
        shapes[block + "attn.W_O"] = (heads, d_head, d)
        shapes.update({f"{block}attn.b_{x}": (heads, d_head) for x in "QKV"})
        shapes[block + "attn.b_O"] = (d,)
        shapes.update({block + "mlp.W_in": (d, mlp), block + "mlp.b_in": (mlp,), block + "mlp.W_out": (mlp, d),
                       block + "mlp.b_out": (d,)})
    shapes.update({"ln_final.w": (d,), "ln_final.b": (d,), "unembed.W_U": (d, vocab), "unembed.b_U": (vocab,)})
    return shapes


def optional_shapes(dims: Dims) -> dict[str, tuple[int, ...]]:
    """The attention's buffers, which a state dict saved from a HookedTransformer carries."""
    shapes = {}
    for layer in range(dims.n_layers):
        shapes[f"blocks.{layer}.attn.mask"] = (dims.n_ctx, dims.n_ctx)
        shapes[f"blocks.{layer}.attn.IGNORE"] = ()
    return shapes


_ANCHORS = {"embed.W_E": "[d_vocab, d_model]", "pos_embed.W_pos": "[n_ctx, d_model]",
            "blocks.0.attn.W_Q": "[heads, d_model, d_head]", "blocks.0.mlp.W_in": "[d_model, d_mlp]"}


def _shape(shape) -> str:
    return "not a tensor" if shape is None else f"[{', '.join(str(n) for n in shape)}]"


def dims_of(shapes: dict, where: str) -> Dims:
    """The dimensions, from the shapes of a few keys (each missing or of the wrong rank refused)."""
    for key, form in _ANCHORS.items():
        if key not in shapes:
            raise ReleasedModelError(f"{where}: key '{key}' is missing (expected a tensor {form}){_hint(shapes)}. "
                                     f"{LAYOUT_FIX}")
        if shapes[key] is None or len(shapes[key]) != form.count(",") + 1:
            raise ReleasedModelError(f"{where}: key '{key}' has shape {_shape(shapes[key])}, expected {form}. "
                                     f"{LAYOUT_FIX}")
    layers = 1 + max(int(match.group(1)) for key in shapes if (match := re.match(r"blocks\.(\d+)\.", key)))
    (vocab, d), (n_ctx, d_pos), (heads, d_q, d_head), (d_in, mlp) = (shapes[key] for key in _ANCHORS)
    for key, found in (("pos_embed.W_pos", d_pos), ("blocks.0.attn.W_Q", d_q), ("blocks.0.mlp.W_in", d_in)):
        if found != d:  # the shapes the others are checked against must agree among themselves first
            raise ReleasedModelError(f"{where}: key '{key}' has shape {_shape(shapes[key])}: its d_model is {found}, "
                                     f"embed.W_E's {d} (embed.W_E {_shape(shapes['embed.W_E'])}). {LAYOUT_FIX}")
    if heads * d_head != d:
        raise ReleasedModelError(f"{where}: key 'blocks.0.attn.W_Q' has shape {_shape(shapes['blocks.0.attn.W_Q'])}: "
                                 f"{heads} heads x d_head {d_head} = {heads * d_head}, not d_model {d} (embed.W_E "
                                 f"{_shape(shapes['embed.W_E'])}); transformers' GPT-2 splits d_model into its heads")
    return Dims(layers, d, heads, d_head, mlp, n_ctx, vocab)


def check_layout(shapes: dict, where: str) -> Dims:
    """The checkpoint's dimensions, or a ReleasedModelError naming the first key missing, of the
    wrong shape (found and expected) or unexpected."""
    dims = dims_of(shapes, where)
    expected, optional = expected_shapes(dims), optional_shapes(dims)
    derived = (f"expected from embed.W_E {_shape(shapes['embed.W_E'])} and blocks.0.attn.W_Q "
               f"{_shape(shapes['blocks.0.attn.W_Q'])}: {dims.n_layers} layers")
    for key, shape in expected.items():
        if key not in shapes:
            raise ReleasedModelError(f"{where}: key '{key}' is missing (expected shape {_shape(shape)}, {derived}). "
                                     f"{LAYOUT_FIX}")
        if shapes[key] != shape:
            raise ReleasedModelError(f"{where}: key '{key}' has shape {_shape(shapes[key])}, expected "
                                     f"{_shape(shape)} ({derived}). {LAYOUT_FIX}")
    for key, shape in shapes.items():
        if key in expected or optional.get(key, "absent") == shape:
            continue
        found = f"shape {_shape(shape)}" + (f", expected {_shape(optional[key])}" if key in optional else "")
        raise ReleasedModelError(f"{where}: unexpected key '{key}' ({found}){_hint([key])}. {LAYOUT_FIX}")
    return dims


def _hint(keys) -> str:
    """What a layout with these keys most likely is."""
    keys = list(keys)
    if any(key.startswith("_orig_mod.") for key in keys):
        return ("; its keys carry torch.compile's '_orig_mod.' prefix, which the loader does not strip: save the "
                "state dict of the uncompiled module")
    if any(key in ("model", "model_args", "config", "optimizer") for key in keys):
        return "; a training checkpoint (its weights under 'model'), not the state dict itself"
    if any(key.startswith(("transformer.", "lm_head.")) for key in keys):
        return ("; nanoGPT or transformers names: a transformers GPT-2 folder is a plain `local:` source "
                "(no format)")
    return ""


def read_settings(config: dict, dims: Dims, where: str) -> Settings:
    """config.json's fields checked against the shapes and against what a GPT-2 conversion can honour."""
    def value(field):
        return config.get(field, config.get(_ALIASES.get(field, ""), None))

    for field, size in (("d_model", dims.d_model), ("n_layers", dims.n_layers), ("n_heads", dims.heads),
                        ("d_head", dims.d_head), ("d_mlp", dims.d_mlp), ("n_ctx", dims.n_ctx)):
        if value(field) is not None and int(value(field)) != size:
            raise ReleasedModelError(f"{where}: config.json's {field} is {value(field)}, but the checkpoint's "
                                     f"shapes say {size}: the two files are not of one model; download both "
                                     "from the same repository and revision")
    for field, allowed in _FIXED.items():
        if field in config and config[field] not in allowed:
            raise ReleasedModelError(f"{where}: config.json sets {field}: {config[field]!r}; the conversion into "
                                     f"transformers' GPT-2 honours only {allowed[0]!r}")
    if "attn_scale" in config and not math.isclose(float(config["attn_scale"]), math.sqrt(dims.d_head)):
        raise ReleasedModelError(f"{where}: config.json's attn_scale is {config['attn_scale']}, not "
                                 f"sqrt(d_head) = {math.sqrt(dims.d_head):.6g}, GPT-2's scaling")
    activation = value("act_fn")
    if activation not in ACTIVATIONS:
        raise ReleasedModelError(f"{where}: config.json's act_fn (or activation_function) is {activation!r}; "
                                 f"one of {ACTIVATIONS} is needed (GPT-2's is gelu_new)")
    vocab = value("d_vocab")
    return Settings(activation, float(value("eps") or 1e-5), bool(config.get("use_sparse_attn", True)),
                    config.get("tokenizer_name"), None if vocab is None else int(vocab))


def padded_size(tokens: int) -> int:
    return -(-tokens // PAD_MULTIPLE) * PAD_MULTIPLE


def check_padding(dims: Dims, tokens: int, settings: Settings, where: str, tokenizer: str) -> None:
    """The embedding's rows are the tokenizer's tokens, or those padded up to a multiple of
    PAD_MULTIPLE; config.json's d_vocab is either count."""
    rows, rounded = dims.padded_vocab, padded_size(tokens)
    fix = (f"use the model's own tokenizer (source.tokenizer; the loader uses {DEFAULT_TOKENIZER} for GPT-2) or "
           "the checkpoint as released")
    if rows < tokens:
        raise ReleasedModelError(f"{where}: embed.W_E has {rows} rows, fewer than the {tokens} tokens of the "
                                 f"tokenizer {tokenizer}: this tokenizer is not the model's; {fix}")
    if rows not in (tokens, rounded):
        raise ReleasedModelError(f"{where}: embed.W_E has {rows} rows; the tokenizer {tokenizer} has {tokens} "
                                 f"tokens, padded to a multiple of {PAD_MULTIPLE} that is {rounded} rows: the rows "
                                 f"past {tokens} would not be padding alone; {fix}")
    if settings.config_vocab is not None and settings.config_vocab not in (rows, tokens):
        raise ReleasedModelError(f"{where}: config.json's d_vocab is {settings.config_vocab}, neither the "
                                 f"checkpoint's {rows} rows nor the tokenizer's {tokens} tokens")


# ---- a checkpoint's keys and shapes without torch ----

class _ShapesOnly(pickle.Unpickler):
    """Unpickles a torch.save'd state dict into {key: shape}: tensors become their shapes, storages
    their persistent ids; any other global refuses (the caller then leaves the check to the
    conversion, which loads with torch)."""

    def find_class(self, module, name):
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return lambda storage, offset, size, *rest: tuple(size)
        if module == "torch._utils" and name == "_rebuild_parameter":
            return lambda data, *rest: data
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        return pid


def checkpoint_shapes(path: Path) -> dict | None:
    """{key: shape, or None for a value that is not a tensor} of a torch.save'd mapping; None when it
    cannot be read so (the legacy format, other objects): the conversion checks it then."""
    try:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if name is None:
                return None
            loaded = _ShapesOnly(archive.open(name)).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, TypeError, AttributeError):
        return None
    if not isinstance(loaded, dict):
        return None
    return {str(key): value if isinstance(value, tuple) else None for key, value in loaded.items()}


# ---- where the files are ----

def where(name: str, path) -> str:
    return f"models.{name}.source ({path})"


def local_files(source: dict) -> tuple[Path, Path]:
    """(final.pth, config.json) of a ``local:`` source: a folder holding both, or the checkpoint file
    with config.json beside it."""
    path = Path(source["local"]).expanduser()
    checkpoint = path / CHECKPOINT if path.is_dir() else path
    return checkpoint, checkpoint.parent / CONFIG


def files_at_hand(name: str, source: dict) -> tuple[Path | None, Path | None]:
    """(checkpoint, config.json) without downloading: a local source's (each must exist), a hub
    source's from the local cache (None where not downloaded yet: checked when prepared)."""
    if "local" in source:
        checkpoint, config = local_files(source)
        if not checkpoint.is_file():
            raise ReleasedModelError(f"{where(name, checkpoint)}: no such file; give the downloaded {CHECKPOINT} "
                                     f"(or the folder holding it and its {CONFIG})")
        if not config.is_file():
            raise ReleasedModelError(f"{where(name, checkpoint)}: no {CONFIG} beside it; the loader reads the "
                                     f"model's dimensions, act_fn and use_sparse_attn from the hub repository's "
                                     f"{CONFIG}: download it with {CHECKPOINT} into the same folder")
        return checkpoint, config
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None, None
    found = [try_to_load_from_cache(source["hub"], file, revision=source.get("revision"))
             for file in (CHECKPOINT, CONFIG)]
    return tuple(Path(path) if isinstance(path, str) else None for path in found)


def tokenizer_location(source: dict, settings: Settings) -> str:
    """The tokenizer: the source's, else config.json's tokenizer_name, else the loader's GPT-2."""
    location = str(source.get("tokenizer") or settings.tokenizer_name or DEFAULT_TOKENIZER)
    folder = Path(location).expanduser()
    return str(folder) if folder.is_dir() else location  # transformers reads no "~"


def tokenizer_rows(ids) -> int:
    """The embedding rows a tokenizer addresses: its largest id + 1."""
    return max(ids) + 1


def tokenizer_rows_at_hand(location: str) -> int | None:
    """tokenizer_rows from a tokenizer.json at hand (a local folder's, a hub tokenizer's in the
    cache), without loading it; None otherwise (checked when the model is prepared)."""
    path = Path(location).expanduser() / "tokenizer.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(location, "tokenizer.json")
        except (ImportError, ValueError):  # no hub client, or not a hub id (a folder that is not there)
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    data = json.loads(path.read_text())
    vocab = data.get("model", {}).get("vocab")
    ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab))) if isinstance(vocab, list) else set()
    ids |= {token["id"] for token in data.get("added_tokens", [])}
    return tokenizer_rows(ids) if ids else None


def check_source(name: str, source: dict) -> Dims | None:
    """The config check of a released model's source: the Llama format refused; the checkpoint's
    keys and shapes, config.json and the padding against the tokenizer, as far as the files are at
    hand (a hub model not downloaded yet is checked when prepared). Returns the dimensions read."""
    if source["format"] == LLAMA_FORMAT:
        raise ReleasedModelError(f"models.{name}.source: " + LLAMA_REFUSAL.format(loader=LOADER))
    checkpoint, config = files_at_hand(name, source)
    shapes = checkpoint_shapes(checkpoint) if checkpoint is not None else None
    if shapes is None:
        return None
    dims = check_layout(shapes, where(name, checkpoint))
    if config is None:
        return dims
    settings = read_settings(json.loads(config.read_text()), dims, where(name, config))
    tokenizer = tokenizer_location(source, settings)
    tokens = tokenizer_rows_at_hand(tokenizer)
    if tokens is not None:
        check_padding(dims, tokens, settings, where(name, checkpoint), tokenizer)
    return dims


def released_config(source: dict) -> dict | None:
    """A config-like dict of a released model at hand (its family and shape, read before it is
    prepared: ``sources.source_config``), None otherwise."""
    dims = check_source("?", source)
    if dims is None:
        return None
    return {"model_type": "gpt2", "n_layer": dims.n_layers, "n_head": dims.heads, "n_embd": dims.d_model}
