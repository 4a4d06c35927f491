"""Greedy decoding: static batches (left padding, KV cache) or continuous batching."""

from __future__ import annotations

import contextlib
import logging
from functools import partial

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from attnlab.reasoning.decoding import RowEnds, decode_batch, unsupported
from attnlab.reasoning.shared_prefix import prefilled_cache, prefix_unshared

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


def greedy_config(model, tokenizer, max_new_tokens: int) -> GenerationConfig:
    """Greedy decoding, whatever sampling the model's own generation config asks for."""
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=model.generation_config.eos_token_id or tokenizer.eos_token_id,
    )


def stop_string_at(text: str, stop_strings: list[str]) -> int | None:
    """Where the response ends: the first stop string's start in ``text``, or None."""
    found = [text.index(s) for s in stop_strings if s in text]
    return min(found) if found else None


def stop_window(stop_strings: list[str]) -> int:
    """How many trailing tokens to decode to see a stop string that the last token completed:
    it starts within the last ``len(s)`` tokens when every token decodes to a character or
    more; the margin covers tokens that decode to none (skipped special tokens)."""
    return 4 * max(len(s) for s in stop_strings) + 8


def holds_stop_string(tokenizer, tokens: list[int], stop_strings: list[str]) -> bool:
    """Whether the generated ``tokens`` (decoded as the response is) now hold a stop string,
    checked on their tail (``stop_window``) so that each step costs the same."""
    tail = tokenizer.decode(tokens[-stop_window(stop_strings):], skip_special_tokens=True)
    return stop_string_at(tail, stop_strings) is not None


class StopOnStrings(StoppingCriteria):
    """Ends a row once its generated text holds a stop string (``holds_stop_string``).

    transformers' ``stop_strings`` (StopStringCriteria) stops at the same tokens (tested),
    but first builds a table over the whole vocabulary, once per process: about 9 s for
    Gemma-3's 262k tokens on a laptop CPU, more than a short job's decoding.
    """

    def __init__(self, tokenizer, stop_strings: list[str], prompt_width: int):
        self.tokenizer, self.stop_strings, self.prompt_width = tokenizer, stop_strings, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = [holds_stop_string(self.tokenizer, row, self.stop_strings)
                for row in input_ids[:, self.prompt_width:].tolist()]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def _generate_batch(model, tokenizer, ids: list[list[int]], config: GenerationConfig,
                    stop_strings: list[str], share_prefix: bool = True):
    """One left-padded batch through transformers' generate; ``share_prefix``: the rows' common
    leading tokens prefilled once (attnlab.reasoning.shared_prefix: the same tokens up to float rounding)."""
    batch = tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt").to(model.device)
    width = batch["input_ids"].shape[1]
    criteria = StoppingCriteriaList([StopOnStrings(tokenizer, stop_strings, width)] if stop_strings else [])
    cache, shared = None, 0
    if share_prefix and prefix_unshared(model, ids) is None:
        cache, shared = prefilled_cache(model, ids)
    log.debug("batch of %d rows, %d columns: %d shared prefix tokens prefilled once", len(ids), width, shared)
    with torch.inference_mode(), attention_backends(model.device):
        out = model.generate(**batch, generation_config=config, stopping_criteria=criteria, past_key_values=cache)
    return out[:, width:].cpu()


def attention_backends(device: torch.device):
    """sdpa's backends for transformers' generate: on CUDA all but cuDNN's. On one H200
    (2026-11-27, SmolLM2 at batch 64, bf16) cuDNN's attention made this engine 3.7x slower
    (553 against 2,051 useful tokens/s, benchmarks/results/gpu_h200_2026-11-27); float32 never
    takes it. Elsewhere nothing changes."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _decode_rows(tokenizer, new_tokens: torch.Tensor, config: GenerationConfig,
                 stop_strings: list[str], lengths: list[int] | None = None) -> list[dict]:
    """Response text (cut at the first stop string), tokens generated, and whether the token
    limit cut it. ``lengths``: each row's generated count where the engine reports it.

    A row ends at the length its engine reports, else just after its first EOS (EOS counts as
    generated; the padding after it is not). A pad token before that is a token the model
    generated, as transformers' generate() keeps it: a model whose pad token is not EOS may
    emit it mid-answer (issue 67)."""
    eos_ids, _ = _ends_of(tokenizer, config, [])
    if lengths is None:  # the engines' own rule, stop strings aside: EOS ends a row, counted with it
        ends = RowEnds(len(new_tokens), eos_ids, None)
        ends.update(new_tokens.tolist())
        lengths = ends.lengths(new_tokens.shape[1])
    rows = []
    for k, row in enumerate(new_tokens.tolist()):
        end = lengths[k]
        text = tokenizer.decode(row[:end], skip_special_tokens=True)
        stop = stop_string_at(text, stop_strings)
        rows.append({"response": text if stop is None else text[:stop], "n_new_tokens": end,
                     "new_token_ids": row[:end],
                     "hit_token_limit": end == len(row) and stop is None and row[-1] not in eos_ids})
    return rows


ENGINES = ("auto", "static", "static_cache", "continuous", "continuous_or_static")


def chosen_engine(engine: str, model) -> tuple[str, str | None]:
    """(the engine that runs, why it is not the one asked for): ``auto`` is ``static_cache`` on
    CUDA (each decode step one CUDA graph, attnlab.reasoning.decoding) and ``static`` elsewhere, where
    transformers' generate is as fast; ``static_cache`` where its loop cannot serve the model
    runs ``static``, saying why."""
    if engine == "auto":
        engine = "static_cache" if model.device.type == "cuda" else "static"
    if engine == "static_cache":
        reason = unsupported(model)
        if reason is not None:
            return "static", reason
    return engine, None


def continuous_unsupported(model) -> str | None:
    """Why transformers' continuous batching cannot serve this model as configured, or None."""
    if getattr(model.config, "attnlab_sparse", None):
        # the engine swaps in paged attention, which would drop the sparse copy's edge gates
        return "a sparse copy's gated attention has no paged version"
    if getattr(model.config.get_text_config(), "attn_logit_softcapping", None) is not None:
        # its paged attention drops the cap: Gemma-2's tokens came out other than generate's (tested)
        return "attention logit soft-capping (Gemma-2), which its paged attention does not apply"
    if model.device.type not in ("cpu", "cuda"):
        return f"device {model.device.type}"
    return None


def generate_all(model, tokenizer, prompts: pd.DataFrame, batch_size: int,
                 max_new_tokens: int, stop_strings: list[str] | None = None,
                 engine: str = "static", share_prefix: bool = True) -> pd.DataFrame:
    """Responses for every prompt, in the prompts' order, greedy; column ``engine`` says which
    engine produced them.

    ``static``: ``model.generate`` on padded batches of ``batch_size`` rows; a batch runs until
    its longest row ends; the leading tokens all its rows share are prefilled once
    (``share_prefix``, attnlab.reasoning.shared_prefix: the same tokens up to float rounding).
    ``static_cache``: the same batches through a static-KV-cache loop whose decode steps are CUDA
    graphs on GPUs (``attnlab.reasoning.decoding``; the column says ``static_cache+cuda_graph`` where the
    graph ran; each row prefills its whole prompt); ``auto``: ``static_cache`` on CUDA, ``static``
    elsewhere (``chosen_engine``). ``continuous``: transformers' continuous batching with paged
    attention and at most ``batch_size`` rows at a time, a finished row's slot refilled at once;
    where it cannot run (a sparse copy's gated attention, an engine error) it fails, saying why.
    ``continuous_or_static``: continuous, falling back to static with a warning where it cannot run.
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown generation engine {engine!r}; expected one of {ENGINES}")
    asked = engine
    engine, reason = chosen_engine(engine, model)
    if reason is not None:
        log.warning("the static_cache engine cannot serve this model (%s): generating with the static "
                    "engine (engine: %s; the generations record engine = static)", reason, asked)
    if engine == "static_cache":
        return _generate_static(model, tokenizer, prompts, batch_size, max_new_tokens, stop_strings,
                                _static_cache_batch)
    if engine != "static":
        reason = continuous_unsupported(model)
        if reason is None:
            try:
                out = _generate_continuous(model, tokenizer, prompts, batch_size, max_new_tokens,
                                           stop_strings or [])
                return out.assign(engine="continuous")
            except ContinuousBatchingFailed as error:
                if engine == "continuous":
                    raise ContinuousBatchingFailed(
                        f"the continuous engine failed ({error}); set generation.engine: static, or "
                        "continuous_or_static to fall back to static where it cannot run") from error
                reason = str(error)
        elif engine == "continuous":
            raise ContinuousBatchingFailed(
                f"generation.engine is continuous, which cannot run here ({reason}); set it to static, "
                "or to continuous_or_static to fall back to static where it cannot run")
        log.warning("continuous batching unavailable (%s): generating with the static engine "
                    "(engine: continuous_or_static; the generations record engine = static)", reason)
    return _generate_static(model, tokenizer, prompts, batch_size, max_new_tokens, stop_strings,
                            partial(_static_batch, share_prefix=share_prefix))


class ContinuousBatchingFailed(RuntimeError):
    """The continuous-batching engine stopped before every prompt was answered."""


def continuous_batching_config(config_class, page: int, **settings):
    """``config_class`` (transformers' ContinuousBatchingConfig) built from the fields the installed
    transformers has: the page is ``page_size`` from 5.23 on, ``block_size`` before (5.17, which GPU
    images carry); ``auto_switch_to_flash`` (5.23) is set False where it exists, as 5.17 never
    switches. A setting the class lacks raises ContinuousBatchingFailed, so that
    ``continuous_or_static`` falls back to static instead of crashing."""
    import dataclasses

    fields = {field.name for field in dataclasses.fields(config_class)}
    page_field = next((name for name in ("page_size", "block_size") if name in fields), None)
    missing = sorted(set(settings) - fields) + ([] if page_field else ["page_size or block_size"])
    if missing:
        raise ContinuousBatchingFailed(f"this transformers' ContinuousBatchingConfig has no {', '.join(missing)}")
    if "auto_switch_to_flash" in fields:
        settings["auto_switch_to_flash"] = False  # keep the model's own attention, as the static engine does
    try:
        return config_class(**{page_field: page}, **settings)
    except (TypeError, ValueError) as error:  # a value this version's checks refuse
        raise ContinuousBatchingFailed(f"ContinuousBatchingConfig refused the settings: {error}") from error


def _generate_continuous(model, tokenizer, prompts: pd.DataFrame, batch_size: int,
                         max_new_tokens: int, stop_strings: list[str]) -> pd.DataFrame:
    """Continuous batching through the engine's manager, streaming when stop strings are set
    so that a row that printed one is cancelled (the engine does not apply them itself)."""
    from transformers import ContinuousBatchingConfig

    config = greedy_config(model, tokenizer, max_new_tokens)
    ids = [np.asarray(row).tolist() for row in prompts["input_ids"]]
    longest = max(len(row) for row in ids) + max_new_tokens
    page = 64  # tokens per cache page: small pages waste little on short prompts
    # KV cache for batch_size rows of the longest sequence: the memory budget scales with the
    # (attempt-halved) batch size, as the static engine's does.
    cb_config = continuous_batching_config(
        ContinuousBatchingConfig, page, num_blocks=batch_size * -(-longest // page) + 1,
        max_requests_per_batch=batch_size, max_batch_tokens=max(longest, 512), allow_block_sharing=False, seed=0)
    tokens: dict[str, list[int]] = {}
    progress = tqdm(total=len(ids), desc="generate (continuous)", unit="prompt", mininterval=5)
    try:
        with model.continuous_batching_context_manager(
                generation_config=config, continuous_batching_config=cb_config, block=True, timeout=30,
                warmup=model.device.type == "cuda") as manager:
            request_ids = manager.add_requests(ids, max_new_tokens=max_new_tokens, streaming=bool(stop_strings))
            while len(tokens) < len(ids):
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise ContinuousBatchingFailed("the engine's thread stopped")
                    continue
                if result.request_id in tokens:
                    continue  # a cancelled row's last streamed tokens
                if result.error is not None:
                    raise ContinuousBatchingFailed(result.error)
                # as the static engine's StopOnStrings
                stopped = bool(stop_strings) and holds_stop_string(tokenizer, list(result.generated_tokens),
                                                                   stop_strings)
                if result.is_finished() or stopped:
                    if not result.is_finished():
                        manager.cancel_request(result.request_id)
                    tokens[result.request_id] = list(result.generated_tokens)
                    progress.update(1)
    except ContinuousBatchingFailed:
        raise
    except Exception as error:  # noqa: BLE001 -- any engine failure means: use the static engine
        raise ContinuousBatchingFailed(f"{type(error).__name__}: {error}") from error
    finally:
        progress.close()
    width = max(max_new_tokens, 1)
    rows = torch.full((len(ids), width), config.pad_token_id if config.pad_token_id is not None else -1)
    for k, request in enumerate(request_ids):
        generated = tokens[request][:width]
        rows[k, :len(generated)] = torch.tensor(generated, dtype=rows.dtype)
    out = pd.DataFrame(_decode_rows(tokenizer, rows, config, stop_strings, lengths=[len(tokens[r][:width]) for r in request_ids]))
    out.insert(0, "id", prompts["id"].values)
    return out


def _ends_of(tokenizer, config: GenerationConfig, stop_strings: list[str]) -> tuple[set[int], object]:
    """(EOS ids, whether a row's tokens hold a stop string, or None without stop strings)."""
    eos = config.eos_token_id
    stopped = (lambda tokens: holds_stop_string(tokenizer, tokens, stop_strings)) if stop_strings else None
    return set(eos if isinstance(eos, list) else [eos]), stopped


def _static_batch(model, tokenizer, ids, config, stop_strings,
                  share_prefix: bool = True) -> tuple[torch.Tensor, list[int], str]:
    tokens = _generate_batch(model, tokenizer, ids, config, stop_strings, share_prefix)
    ends = RowEnds(len(ids), *_ends_of(tokenizer, config, stop_strings))
    ends.update(tokens.tolist())
    return tokens, ends.lengths(tokens.shape[1]), "static"


def _static_cache_batch(model, tokenizer, ids, config, stop_strings) -> tuple[torch.Tensor, list[int], str]:
    """One padded batch through the static-cache loop (attnlab.reasoning.decoding)."""
    eos_ids, stopped = _ends_of(tokenizer, config, stop_strings)
    tokens, lengths, graphed = decode_batch(model, ids, config.max_new_tokens, eos_ids, config.pad_token_id,
                                            stopped)
    return tokens, lengths, "static_cache+cuda_graph" if graphed else "static_cache"


def _generate_static(model, tokenizer, prompts: pd.DataFrame, batch_size: int,
                     max_new_tokens: int, stop_strings: list[str] | None = None,
                     generate_batch=_static_batch) -> pd.DataFrame:
    """Padded batches of ``batch_size`` rows through ``generate_batch`` (transformers' generate,
    or the static-cache loop). Prompts are sorted longest first so that padding is small and an
    out-of-memory error shows up on the first batch; on CUDA OOM the batch is halved and retried."""
    config = greedy_config(model, tokenizer, max_new_tokens)
    stop_strings = stop_strings or []
    order = prompts["n_prompt_tokens"].sort_values(ascending=False, kind="stable").index.tolist()
    results: dict[int, dict] = {}
    progress = tqdm(total=len(order), desc="generate", unit="prompt", mininterval=5)
    start = 0
    while start < len(order):
        rows = order[start:start + batch_size]
        ids = [np.asarray(prompts.at[i, "input_ids"]).tolist() for i in rows]
        try:
            new_tokens, lengths, engine = generate_batch(model, tokenizer, ids, config, stop_strings)
        except torch.cuda.OutOfMemoryError:
            if batch_size == 1:
                raise
            batch_size //= 2
            torch.cuda.empty_cache()
            log.warning("CUDA out of memory: retrying with batch size %d", batch_size)
            continue
        for i, decoded in zip(rows, _decode_rows(tokenizer, new_tokens, config, stop_strings, lengths)):
            results[i] = {**decoded, "engine": engine}
        start += len(rows)
        progress.update(len(rows))
    progress.close()
    out = pd.DataFrame([results[i] for i in prompts.index])
    out.insert(0, "id", prompts["id"].values)
    return out
