"""A prepared model's tokenizer and context length, without importing torch; and what a prepared
folder records so that its tokenizer loads in one parse (``save_tokenizer``).

Steps that only tokenize (``make_prompts``, 16 jobs in the default) skip the import of torch
and of the model config (``AutoConfig`` imports torch), about 3 s of each job on 2 cores: 8.2 s
per job became 3.3 s. Every step reads a tokenizer whose class only rebuilds the backend as that
backend (``_backend_stands_in``), which saves Gemma-3's jobs another 1.8 s each.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PreTrainedTokenizerFast

# Class attributes a tokenizer class may set that change what it returns, copied onto the
# generic backend when it stands in for the class (``_backend_stands_in``).
_CLASS_SETTINGS = ("padding_side", "truncation_side", "model_input_names")
# What a class may define and still be the generic backend built from its tokenizer.json.
_ALLOWED_IN_CLASS = {"__module__", "__doc__", "__init__", "__qualname__", "__firstlineno__",
                     "__static_attributes__", "vocab_files_names", "model", *_CLASS_SETTINGS}


def _declared_class(path: Path):
    """The tokenizer class a prepared folder names, or None (imports only that class's module;
    ``AutoTokenizer`` would import torch)."""
    import transformers

    config = path / "tokenizer_config.json"
    if not config.is_file():
        return None
    name = json.loads(config.read_text()).get("tokenizer_class")
    return getattr(transformers, name, None) if name else None


def _backend_stands_in(path: Path):
    """The folder's tokenizer class when the generic backend loaded from its tokenizer.json is
    the same tokenizer, else None.

    The generic backend (``TokenizersBackend``) is that class itself. A class such as
    ``GemmaTokenizer`` only rebuilds the backend from the vocabulary in its constructor; the
    folder's tokenizer.json is the serialization of what it built, so the generic backend reads
    it directly. That skips transformers' second, pure-Python parse of the file: 4.3 s -> 2.5 s
    for Gemma-3's 262k-entry vocabulary, in each of its jobs. A class with any method of its
    own is loaded as itself, through ``AutoTokenizer``.
    """
    if not (path / "tokenizer.json").is_file():
        return None
    declared = _declared_class(path)
    if declared is PreTrainedTokenizerFast:
        return declared
    if declared is None or declared.__mro__[1] is not PreTrainedTokenizerFast:
        return None
    return declared if set(vars(declared)) <= _ALLOWED_IN_CLASS else None


def load_tokenizer(path: str | Path):
    """Tokenizer set up for batched decoding: left padding, a pad token."""
    path = Path(path)
    declared = _backend_stands_in(path) if path.is_dir() else None
    if declared is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    else:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        for setting in _CLASS_SETTINGS:
            if setting in vars(declared):
                setattr(tokenizer, setting, getattr(declared, setting))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def context_length(path: str | Path) -> int:
    """The longest sequence (prompt + new tokens) the model was trained for."""
    config_file = Path(path) / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        text_config = config.get("text_config") or config
        if "max_position_embeddings" in text_config:
            return int(text_config["max_position_embeddings"])
    # A folder that leaves it to the class's default: the config class knows it (imports torch).
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text_config.max_position_embeddings)


def save_tokenizer(tokenizer, folder: str | Path) -> None:
    """``tokenizer.save_pretrained(folder)``, with its added tokens also in tokenizer_config.json.

    transformers 5 reads a tokenizer's added (special) tokens from tokenizer_config.json's
    ``added_tokens_decoder`` when it is there, else from tokenizer.json, which it then parses a
    second time, in Python, after the Rust backend's own parse: 0.9 s of every Gemma-3 job (a
    33 MB file), for 6,384 entries that fill 0.8 MB here. Version 4 wrote the field; version 5
    still reads it. A folder without it (prepared before) loads as before, the same tokenizer."""
    folder = Path(folder)
    tokenizer.save_pretrained(folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["added_tokens_decoder"] = {str(index): token.__getstate__()
                                      for index, token in sorted(tokenizer.added_tokens_decoder.items())}
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
