"""Crash-safe output helpers: write to a temporary sibling, then rename.

A job killed half-way leaves only a ``.tmp-*`` file or folder behind, never
a file under the final name that looks complete; the next successful write of
that output removes such leftovers.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pandas as pd


def _sweep(folder: Path, prefix: str) -> None:
    """Remove what killed earlier writers of the same output left behind (one job writes
    an output at a time, so nothing else is writing these)."""
    for stale in folder.glob(f"{prefix}*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it to ``path`` on success."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{final.name}.tmp-"
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=final.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=final.suffix, dir=final.parent)
        os.close(fd)
        tmp = Path(name)
    # mkstemp/mkdtemp create private files; give the output the usual permissions.
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod((0o777 if directory else 0o666) & ~umask)
    try:
        yield tmp
        if directory and final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _sweep(final.parent, prefix)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def write_parquet(frame: pd.DataFrame, path: str | os.PathLike) -> None:
    with atomic_path(path) as tmp:
        frame.to_parquet(tmp, index=False)


def write_csv(frame: pd.DataFrame, path: str | os.PathLike) -> None:
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False)


def write_json(obj, path: str | os.PathLike) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: str | os.PathLike):
    return json.loads(Path(path).read_text())


# ---- readers of the workflow's own outputs: a truncated file names itself and its fix ----


class UnreadableFileError(RuntimeError):
    """An input file exists but cannot be read (truncated or corrupt)."""


def _unreadable(path, error: Exception) -> UnreadableFileError:
    return UnreadableFileError(
        f"{path} cannot be read ({type(error).__name__}: {error}); it is truncated or corrupt. "
        f"Rerun the job that writes it with `snakemake -R {path}` (or delete the file and run again)."
    )


def read_parquet(path: str | os.PathLike, **kwargs) -> pd.DataFrame:
    import pyarrow

    try:
        return pd.read_parquet(path, **kwargs)
    except FileNotFoundError:
        raise
    except (OSError, pyarrow.ArrowException) as error:
        raise _unreadable(path, error) from error


def open_hdf5(path: str | os.PathLike):
    """An HDF5 file opened for reading (h5py.File, usable in ``with``)."""
    import h5py

    if not Path(path).exists():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return h5py.File(path, "r")
    except OSError as error:
        raise _unreadable(path, error) from error
