"""Converted packaged models kept for reuse across working directories (opt-in).

Converting a packaged GGUF model into a Hugging Face folder takes 35 s (SmolLM2) to a minute
(Gemma-3) on 2 cores, and gives the same folder every time for the same inputs. With the
environment variable ``ATTNLAB_MODEL_CACHE`` naming a folder, ``attnlab.models.prepare_model`` keeps
each conversion there and later preparations of the same model copy it instead of converting again
(the test suite shares one conversion between all its workflow runs this way).

A conversion is reused only when everything it was made from is the same: the model's name and
source, the versions of the packages that carry the GGUF (a split package's parts included), of
torch, transformers and gguf, and the text of ``attnlab/models.py``, which converts. Hub ids, local
folders and GGUF files given by path are never cached: their contents can change under the same
name. Unset (the default), nothing is cached.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
from pathlib import Path

from filelock import FileLock

from attnlab.io import atomic_path

ENVIRONMENT_VARIABLE = "ATTNLAB_MODEL_CACHE"
CONVERTER = Path(__file__).with_name("models.py")


def _versions(package: str) -> dict[str, str]:
    """Versions of the installed distributions that carry ``package`` (an import name), its split
    parts included (their names extend the package's), and of the converting libraries."""
    prefix = package.replace("_", "-").lower()
    carriers = {dist.metadata["Name"].lower(): dist.version for dist in importlib.metadata.distributions()
                if dist.metadata["Name"] and dist.metadata["Name"].replace("_", "-").lower().startswith(prefix)}
    libraries = {name: importlib.metadata.version(name) for name in ("torch", "transformers", "gguf")}
    return dict(sorted({**carriers, **libraries}.items()))


def cached_folder(name: str, source: dict) -> Path | None:
    """Where the conversion of ``name`` from ``source`` is (or would be) kept; None when the cache
    is off or the source is not a packaged GGUF."""
    root = os.environ.get(ENVIRONMENT_VARIABLE)
    if not root or "gguf_package" not in source:
        return None
    identity = {"name": name, "source": source, "versions": _versions(source["gguf_package"]),
                "converter": hashlib.sha256(CONVERTER.read_bytes()).hexdigest()}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    return Path(root).expanduser() / f"{name}-{key}"


def locked(cached: Path) -> FileLock:
    """A lock beside the cache entry: one conversion of a model at a time (two jobs or test workers
    preparing it together: the second waits, then copies)."""
    cached.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(f"{cached}.lock")


def copy_folder(source: Path, target: Path) -> None:
    """Copy a prepared folder's files into ``target`` (a new, empty folder). Copies, not links: a
    test or a user that edits a prepared folder must not change the cache."""
    shutil.copytree(source, target, dirs_exist_ok=True)


def keep(prepared: Path, cached: Path) -> None:
    """Store a finished preparation in the cache, atomically (a killed copy leaves no entry)."""
    with atomic_path(cached, directory=True) as tmp:
        copy_folder(prepared, tmp)
