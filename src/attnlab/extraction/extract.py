"""Attention statistics for every layer, head and prompt, into one HDF5 file: the layout
(datasets, chunks, attributes, the ``complete`` flag) is ``attnlab.extraction.h5format``'s, whose
``open_attention`` reads it without torch."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from attnlab import anatomy
from attnlab.attention import reduction, sparse
from attnlab.config.checks import HeadRangeError
from attnlab.interventions import intervened
from attnlab.io import atomic_path
from attnlab.models import left_pad, padded_span_mask
from attnlab.reasoning.prompts import SPANS

log = logging.getLogger(__name__)


@dataclass
class Extraction:
    received: list[np.ndarray]  # per layer [H, N, T]
    lam: list[np.ndarray]
    maps: dict[int, np.ndarray]  # layer -> [H, N, T, T]
    sparse: dict | None = None  # a sparse model's gate settings: its maps are gated


def extract(model, prompts: pd.DataFrame, batch_size: int, map_layers: list[int]) -> Extraction:
    """Run every prompt through the model once, reducing attention per layer."""
    config = model.config.get_text_config()
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    if any(not 0 <= layer < layers for layer in map_layers):
        raise HeadRangeError(f"attention.full_map_layers {list(map_layers)}: the model has {layers} "
                             f"layers (0-based: 0..{layers - 1})")
    n, width = len(prompts), int(prompts["n_prompt_tokens"].max())
    received = [np.full((heads, n, width), np.nan, np.float32) for _ in range(layers)]
    lam = [np.full((heads, n, width), np.nan, np.float32) for _ in range(layers)]
    maps = {layer: np.full((heads, n, width, width), np.nan, np.float16) for layer in map_layers}
    spans = prompts[["inserted_start", "inserted_end"]].to_numpy()
    base = anatomy.of(model, stages=("extraction",)).decoder  # hidden states only: the LM head is not needed
    device = next(model.parameters()).device
    for start in tqdm(range(0, n, batch_size), desc="extract", unit="batch", mininterval=5):
        rows = list(range(start, min(start + batch_size, n)))
        ids = [np.asarray(prompts["input_ids"].iloc[r]).tolist() for r in rows]
        lengths = [len(x) for x in ids]
        batch_width = max(lengths)
        padded, real, positions = left_pad(ids)
        inserted = padded_span_mask(lengths, spans[rows], batch_width)
        out = reduction.BatchReduction(real.bool().to(device), inserted.to(device), map_layers=tuple(map_layers))
        with intervened(model, reduce=out), torch.inference_mode():
            base(input_ids=padded.to(device), attention_mask=real.to(device),
                 position_ids=positions.to(device), use_cache=False)
        out.on_host()
        for i, (row, length) in enumerate(zip(rows, lengths)):
            pad = batch_width - length
            for layer in range(layers):
                received[layer][:, row, :length] = out.received[layer][i, :, pad:].numpy()
                lam[layer][:, row, :length] = out.lam[layer][i, :, pad:].numpy()
            for layer in map_layers:
                maps[layer][:, row, :length, :length] = out.maps[layer][i, :, pad:, pad:].numpy()
    return Extraction(received, lam, maps, getattr(config, sparse.CONFIG_KEY, None))


def _versions() -> dict:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "h5py": h5py.__version__, "numpy": np.__version__}


def write_attention(path: str | Path, extraction: Extraction, prompts: pd.DataFrame, attrs: dict) -> None:
    n, width = extraction.received[0].shape[1:]
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as h5:
        compression = {"compression": "gzip", "compression_opts": 4, "shuffle": True}
        for name, arrays in (("received", extraction.received), ("lam", extraction.lam)):
            group = h5.create_group(name)
            for layer, array in enumerate(arrays):
                group.create_dataset(f"layer_{layer:02d}", data=array,
                                     chunks=(1, n, width), **compression)
        maps = h5.create_group("maps")
        for layer, array in extraction.maps.items():
            maps.create_dataset(f"layer_{layer:02d}", data=array,
                                chunks=(1, 1, width, width), **compression)
        token_ids = np.full((n, width), -1, np.int32)
        for row, ids in enumerate(prompts["input_ids"]):
            token_ids[row, : len(ids)] = ids
        h5.create_dataset("token_ids", data=token_ids, **compression)
        h5.create_dataset("lengths", data=prompts["n_prompt_tokens"].to_numpy(np.int32))
        spans = np.stack([prompts[[f"{r}_start", f"{r}_end"]].to_numpy(np.int32) for r in SPANS], 1)
        h5.create_dataset("spans", data=spans)
        h5.create_dataset("ids", data=prompts["id"].astype(str).tolist(), dtype=h5py.string_dtype())
        h5.attrs.update({key: json.dumps(value) if isinstance(value, (dict, list)) else value
                         for key, value in attrs.items()})
        h5.attrs["regions"] = json.dumps(list(SPANS))
        h5.attrs["metric_definition"] = reduction.METRIC_DEFINITION
        h5.attrs["sparse_attention"] = json.dumps(extraction.sparse)  # null for a dense model
        h5.attrs["versions"] = json.dumps(_versions())
        h5.attrs["n_layers"], h5.attrs["n_heads"] = len(extraction.received), extraction.received[0].shape[0]
        h5.attrs["complete"] = True
