"""The KV cache of a padded batch's shared prefix, computed once instead of once per row.

Every prompt of a job often starts with the same tokens: the system prompt, the inserted run of a
condition, a base model's few-shot examples (Gemma-3's 4 worked examples are 100-350 of its
114-472 prompt tokens in the default). On a CPU the prefill of those tokens is most of a short
job: 32 arithmetic rows of 170 tokens took 25 s to prefill, of which 162 tokens are common.

``prefilled_cache`` runs the common prefix once (batch 1) and lays its keys and values into
each row of the left-padded batch at that row's own columns: row r, padded by ``p_r`` tokens,
holds padding in columns ``[0, p_r)`` (zeros, masked as padding always is) and the prefix's
positions ``0, 1, ...`` from column ``p_r`` on. Keys and values depend on a token's position,
not on its column, so this is the cache the batch's own prefill would write into its first
columns, up to float rounding (a batch of 1 rounds as a batch of 1); the rest of the batch then
runs as transformers' generate runs any prompt it is given with a cache: a chunked prefill,
with the same attention mask, positions and columns as without the cache. On both embedded
models every generation of the 24 prompt files the default had on 2026-11-26 (GSM8K included)
gave the same tokens as without it.

It is not used where it could change what runs: a batch of one row, a model with forward hooks
(an intervention such as ARM reads its prefill), or a sliding window that would not hold the
whole prefix.
"""

from __future__ import annotations

import os

import torch
from transformers import DynamicCache

from attnlab.models import first_hooked_module


def shared_prefix_length(rows: list[list[int]]) -> int:
    """How many leading tokens every row shares, leaving each row at least one token to run."""
    return min(len(os.path.commonprefix(rows)), min(len(row) for row in rows) - 1)


def prefix_unshared(model, rows: list[list[int]]) -> str | None:
    """Why the batch's prefix is run row by row (as part of its prefill), or None."""
    if len(rows) < 2:
        return "one row"
    if shared_prefix_length(rows) < 1:
        return "no shared prefix"
    hooked = first_hooked_module(model)
    if hooked is not None:
        return f"forward hooks on {hooked or 'the model'} (an intervention reads the prefill)"
    return None


@torch.inference_mode()
def prefilled_cache(model, rows: list[list[int]]) -> tuple[DynamicCache | None, int]:
    """(A cache holding the left-padded batch's first columns, how many), or (None, 0) where a
    sliding window is shorter than the prefix. The batch is ``rows`` left-padded to the longest."""
    length = shared_prefix_length(rows)
    width = max(len(row) for row in rows)
    single_cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([rows[0][:length]], device=model.device), past_key_values=single_cache,
          use_cache=True, logits_to_keep=1)
    if any(layer.keys.shape[-2] != length for layer in single_cache.layers):
        return None, 0  # a sliding-window layer kept only its window
    cache = DynamicCache(config=model.config)
    for index, layer in enumerate(single_cache.layers):
        cache.update(*(_laid_out(states, rows, width, length) for states in (layer.keys, layer.values)), index)
    return cache, length


def _laid_out(states: torch.Tensor, rows: list[list[int]], width: int, length: int) -> torch.Tensor:
    """[rows, heads, length, dim]: the prefix's ``states`` ([1, heads, length, dim]) placed in each
    left-padded row after its padding, zeros in the padding columns."""
    out = states.new_zeros(len(rows), *states.shape[1:])
    for index, row in enumerate(rows):
        padding = width - len(row)
        if padding < length:
            out[index, :, padding:] = states[0, :, :length - padding]
    return out
