"""Config checks the schema cannot express (pure standard library).

Snakemake imports this while it parses the workflow (``attnlab.config.validate.check``, from
common.smk), so a bad value fails in a dry run, before any job; the steps call
the same checks again where they read the value.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path


FUSED_MODE_VARIABLE = "ATTNLAB_FUSED_ATTENTION"  # attention.fused: whether layers go through the kernels
FUSED_MODES = ("auto", "on", "off")
FUSED_LARGEST_HEAD = 256  # the kernels' largest head dimension; a larger head stays on the eager path


def fused_mode() -> str:
    """``ATTNLAB_FUSED_ATTENTION`` (auto, on, off), read on every call: the kernels' launcher and
    the config check both ask here."""
    value = os.environ.get(FUSED_MODE_VARIABLE, "auto").strip().lower()
    if value not in FUSED_MODES:
        raise ValueError(f"{FUSED_MODE_VARIABLE}={value!r}: expected one of {FUSED_MODES}")
    return value


class ConfigError(ValueError):
    """A configured value cannot work; the message says which key and how to fix it."""


class HeadRangeError(ConfigError):
    """A configured layer or head does not exist in the model."""


def check_heads(heads: list[dict], n_layers: int, n_heads: int, model: str,
                key: str = "attention.heads") -> None:
    """Every {layer, head} (0-based) must exist in a model of this shape; ``key`` is where they
    are configured."""
    bad = [h for h in heads if not (0 <= h["layer"] < n_layers and 0 <= h["head"] < n_heads)]
    if bad:
        raise HeadRangeError(
            f"model '{model}' has {n_layers} layers x {n_heads} heads (0-based: layers "
            f"0..{n_layers - 1}, heads 0..{n_heads - 1}); configured {bad} is out of range. "
            f"Fix {key} in the config."
        )


def check_layer(layer: int, n_layers: int, model: str, key: str) -> None:
    if not 0 <= layer < n_layers:
        raise HeadRangeError(f"model '{model}' has {n_layers} layers (0-based: 0..{n_layers - 1}); "
                             f"{key} is {layer}. Fix {key} in the config.")


def damaged_model_files(folder: str | Path) -> list[str]:
    """What is wrong with a prepared model folder, file by file: a config that is not JSON, a
    safetensors file shorter or longer than its own header says (a copy or conversion cut
    short). Reads only the JSON files and the safetensors headers, never the weights."""
    import struct

    folder, problems = Path(folder), []
    for name in ("config.json", "tokenizer_config.json"):
        path = folder / name
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        try:
            json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as error:
            problems.append(f"{path}: not JSON ({error})")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        problems.append(f"{folder}: no *.safetensors weights")
    for path in weights:
        size = path.stat().st_size
        try:
            with open(path, "rb") as handle:
                length = struct.unpack("<Q", handle.read(8))[0]
                header = json.loads(handle.read(length)) if 8 + length <= size else None
        except (struct.error, ValueError, UnicodeDecodeError):
            header = None
        if header is None:
            problems.append(f"{path}: its header is cut short or unreadable ({size} bytes)")
            continue
        end = max((spec["data_offsets"][1] for key, spec in header.items() if key != "__metadata__"), default=0)
        if size != 8 + length + end:
            problems.append(f"{path}: {size} bytes where its header describes {8 + length + end}")
    return problems


def prepared_model_config(folder: str | Path) -> dict | None:
    """A prepared model folder's config.json, None before it exists."""
    path = Path(folder) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def prepared_has_chat_template(folder: str | Path) -> bool | None:
    """Whether a prepared model folder carries a chat template; None before it exists."""
    folder = Path(folder)
    tokenizer_config = folder / "tokenizer_config.json"
    if not tokenizer_config.is_file():
        return None
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    return bool(json.loads(tokenizer_config.read_text()).get("chat_template"))


def check_chat_template(model: str, prompt_format: str, has_template: bool | None) -> None:
    """``prompt_format: chat`` needs a tokenizer with a chat template (base models have none)."""
    if prompt_format == "chat" and has_template is False:
        raise ConfigError(
            f"models.{model}.prompt_format is 'chat' but the model's tokenizer has no chat "
            f"template (a base model?); set models.{model}.prompt_format: raw, which uses "
            "prompt.raw_template"
        )


RAW_PLACEHOLDERS = ("system", "user")


def check_raw_template(template: str) -> None:
    """``prompt.raw_template`` may only hold {system} and {user}; literal braces are doubled."""
    key = "prompt.raw_template"
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(template) if field is not None]
    except ValueError as error:  # a stray '{' or '}'
        raise ConfigError(f"{key} {template!r}: {error}; write a literal brace as '{{{{' or '}}}}'") from None
    unknown = [field for field in fields if field not in RAW_PLACEHOLDERS]
    if unknown:
        shown = ", ".join("{" + field + "}" for field in unknown)
        raise ConfigError(f"{key} {template!r} has the unknown placeholder(s) {shown}; the allowed "
                          "placeholders are {system} and {user} (write a literal brace as '{{' or '}}')")


def check_arithmetic_range(dataset: str, source: dict) -> None:
    """A generated arithmetic set needs low <= high (else it has no problems at all)."""
    spec = source.get("arithmetic")
    if spec and spec["low"] > spec["high"]:
        raise ConfigError(f"datasets.{dataset}.source.arithmetic: low ({spec['low']}) is above high "
                          f"({spec['high']}), so there are no problems; swap them or lower low")
