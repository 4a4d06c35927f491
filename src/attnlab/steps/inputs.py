"""Models, datasets, few-shot pools and prompts."""

from __future__ import annotations

from attnlab import io
from attnlab.steps.common import log


def prepare_model(name: str, source: dict, out_dir: str, prompt_format: str | None = None) -> None:
    from attnlab.models import prepare_model as prepare

    prepare(name, source, out_dir, prompt_format)


def prepare_dataset(name: str, spec: dict, out_path: str) -> None:
    from attnlab.reasoning.data import prepare_dataset as prepare

    io.write_parquet(prepare(name, spec), out_path)


def prepare_fewshot(name: str, spec: dict, evaluated_path: str, out_path: str, seed: int) -> None:
    from attnlab.config.plan import FEWSHOT_POOL
    from attnlab.reasoning.data import fewshot_pool

    pool = fewshot_pool(name, spec, io.read_parquet(evaluated_path), FEWSHOT_POOL, seed)
    io.write_parquet(pool, out_path)


def make_prompts(model_dir: str, dataset_path: str, out_path: str, condition_name: str,
                 condition: dict, prompt_cfg: dict, prompt_format: str, fewshot: int = 0,
                 fewshot_path: str | None = None) -> None:
    from attnlab.reasoning.prompts import make_prompts as build
    from attnlab.tokenization import context_length, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    questions = io.read_parquet(dataset_path)
    examples = io.read_parquet(fewshot_path).head(fewshot) if fewshot else None
    if examples is not None and len(examples) < fewshot:
        log.warning("only %d of %d few-shot examples available", len(examples), fewshot)
    prompts = build(tokenizer, questions, condition_name, condition, prompt_cfg,
                    prompt_format, context_length(model_dir), examples)
    io.write_parquet(prompts, out_path)
