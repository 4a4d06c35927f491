"""The attention HDF5 format, read without torch (figures and tables need only this).

Layout (``N`` prompts, ``T`` = longest prompt, ``H`` heads, positions are
token indices of each prompt, left-aligned; padding is NaN or -1):

    /received/layer_{l:02d}  float32 [H, N, T]  attention key j receives from later tokens
    /lam/layer_{l:02d}       float32 [H, N, T]  λ: attention mass query i puts on non-inserted keys
    /maps/layer_{l:02d}      float16 [H, N, T, T]  full attention maps (only configured layers)
    /token_ids               int32   [N, T]     -1 on padding
    /lengths                 int32   [N]
    /spans                   int32   [N, 4, 2]  [start, end) of system, inserted, question, and
                                                cut (the insertion with its separator)
    /ids                     str     [N]        item ids

Per-layer arrays are chunked ``[1, N, T]``: one head across all prompts is
one chunk read. Attributes record the model, condition, tokenizer, metric
definition and package versions; ``complete`` is written last and the file
is renamed into place only after it, so a killed job never leaves a file
that reads as complete.
"""

from __future__ import annotations

from pathlib import Path

import h5py

from attnlab.io import open_hdf5


class IncompleteFileError(RuntimeError):
    """An HDF5 file that a killed job left behind."""


def open_attention(path: str | Path) -> h5py.File:
    """Open an attention file for reading, refusing one a killed job left behind."""
    h5 = open_hdf5(path)
    if not h5.attrs.get("complete", False):
        h5.close()
        raise IncompleteFileError(f"{path} is incomplete (its job did not finish); delete it and rerun "
                                  f"(or rerun its job with `snakemake -R {path}`)")
    return h5
