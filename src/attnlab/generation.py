"""Batched greedy decoding with left padding and the KV cache."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm
from transformers import GenerationConfig

log = logging.getLogger(__name__)


def check_context(prompts: pd.DataFrame, max_new_tokens: int, max_context: int) -> None:
    too_long = prompts[prompts["n_prompt_tokens"] + max_new_tokens > max_context]
    if len(too_long):
        item = too_long.iloc[0]
        raise ValueError(
            f"item '{item['id']}': {item['n_prompt_tokens']} prompt tokens + {max_new_tokens} new "
            f"tokens exceed the model's context of {max_context} ({len(too_long)} items do); "
            "lower generation.max_new_tokens or drop these items"
        )


def greedy_config(model, tokenizer, max_new_tokens: int, stop_strings: list[str]) -> GenerationConfig:
    """Greedy decoding, whatever sampling the model's own generation config asks for."""
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=model.generation_config.eos_token_id or tokenizer.eos_token_id,
        stop_strings=stop_strings or None,
    )


def _generate_batch(model, tokenizer, ids: list[list[int]], config: GenerationConfig):
    batch = tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt").to(model.device)
    with torch.inference_mode():
        out = model.generate(**batch, generation_config=config, tokenizer=tokenizer)
    return out[:, batch["input_ids"].shape[1]:].cpu()


def _decode_rows(tokenizer, new_tokens: torch.Tensor, config: GenerationConfig) -> list[dict]:
    eos = config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    rows = []
    for row in new_tokens.tolist():
        # A finished row is filled with padding; EOS itself counts as generated.
        end = next((i + (t in eos_ids) for i, t in enumerate(row)
                    if t in eos_ids or t == config.pad_token_id), len(row))
        text = tokenizer.decode(row[:end], skip_special_tokens=True)
        stopped = [text.index(s) for s in config.stop_strings or [] if s in text]
        rows.append({"response": text[:min(stopped)] if stopped else text, "n_new_tokens": end,
                     "hit_token_limit": end == len(row) and not stopped and row[-1] not in eos_ids})
    return rows


def generate_all(model, tokenizer, prompts: pd.DataFrame, batch_size: int,
                 max_new_tokens: int, stop_strings: list[str] | None = None) -> pd.DataFrame:
    """Responses for every prompt, in the prompts' order.

    Prompts are sorted longest first so that padding is small and an
    out-of-memory error shows up on the first batch; on CUDA OOM the batch is
    halved and retried.
    """
    config = greedy_config(model, tokenizer, max_new_tokens, stop_strings or [])
    order = prompts["n_prompt_tokens"].sort_values(ascending=False, kind="stable").index.tolist()
    results: dict[int, dict] = {}
    progress = tqdm(total=len(order), desc="generate", unit="prompt", mininterval=5)
    start = 0
    while start < len(order):
        rows = order[start:start + batch_size]
        ids = [np.asarray(prompts.at[i, "input_ids"]).tolist() for i in rows]
        try:
            new_tokens = _generate_batch(model, tokenizer, ids, config)
        except torch.cuda.OutOfMemoryError:
            if batch_size == 1:
                raise
            batch_size //= 2
            torch.cuda.empty_cache()
            log.warning("CUDA out of memory: retrying with batch size %d", batch_size)
            continue
        for i, decoded in zip(rows, _decode_rows(tokenizer, new_tokens, config)):
            results[i] = decoded
        start += len(rows)
        progress.update(len(rows))
    progress.close()
    out = pd.DataFrame([results[i] for i in prompts.index])
    out.insert(0, "id", prompts["id"].values)
    return out
