"""Answer extraction, two graders, and accuracy with its confidence interval (a proportion's:
Wilson's, ``attnlab.reasoning.paired``; the bootstrap here serves statistics that are not proportions).

Graders:
- ``math_verify``: Hugging Face math-verify, ``verify(parse(gold), parse(pred))``
  with gold first; both sides are wrapped in ``\\boxed{}`` so plain strings and
  LaTeX parse alike.
- ``lenient``: the grader of the paper's code (arXiv 2510.01032): normalise both
  strings, correct if ``pred == gold or pred in gold``. It is generous (a
  prediction "1" matches gold "10"); an empty prediction is never correct here.
  Which of its two rules matched is kept (``lenient_rule``) and counted per cell
  (``lenient_substring_only``), because most of its excess over math-verify comes
  from substring matches of a last-number fallback ("1" for gold "41").
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
from scipy import stats

from attnlab.reasoning.paired import INTERVAL, wilson

GRADERS = ("math_verify", "lenient")
EXTRACTIONS = ("boxed", "hash", "last_number", "none")  # extract_answer's sources, in its order
# lenient_match's verdicts: equal after normalising, a substring of gold only, neither, nothing extracted
LENIENT_RULES = ("exact", "substring", "no_match", "no_answer")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    depth, begin = 1, starts[-1]
    for pos in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[pos], 0)
        if depth == 0:
            return text[begin:pos].strip()
    return None  # unbalanced: the answer was cut off


def extract_answer(text: str, fallback: str = "last_number") -> tuple[str | None, str]:
    """(answer, how it was found): the last \\boxed{}, GSM8K's "####", or the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip().split("\n")[0].strip()
        if after:
            return after, "hash"
    if fallback == "last_number":
        numbers = NUMBER.findall(text)
        if numbers:
            return numbers[-1].replace(",", ""), "last_number"
    return None, "none"


def _present(pred) -> bool:
    """A non-empty extracted answer (pandas turns a missing one into NaN)."""
    return isinstance(pred, str) and bool(pred.strip())


def grade_math_verify(gold: str, pred: str | None) -> bool:
    from math_verify import parse, verify

    if not _present(pred):
        return False
    return bool(verify(parse(f"\\boxed{{{gold}}}"), parse(f"\\boxed{{{pred}}}")))


def normalise_lenient(text: str) -> str:
    """String normalisation for the lenient grader (LaTeX noise removed)."""
    text = re.sub(r"\\text\{([^}]*)\}", r"\1", text)
    text = re.sub(r"\\(?:left|right|!|,|;|:)", "", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = text.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\%", "").replace("$", "")
    text = re.sub(r"\s+", "", text).rstrip(".").lower()
    return text


def lenient_match(gold: str, pred: str | None) -> str:
    """Which rule of the lenient grader accepts ``pred`` (one of LENIENT_RULES)."""
    if not _present(pred):
        return "no_answer"
    gold_n, pred_n = normalise_lenient(gold), normalise_lenient(pred)
    if not pred_n:
        return "no_answer"  # "" would be a substring of anything
    if pred_n == gold_n:
        return "exact"
    return "substring" if pred_n in gold_n else "no_match"


def grade_lenient(gold: str, pred: str | None) -> bool:
    return lenient_match(gold, pred) in ("exact", "substring")


def grade_items(prompts: pd.DataFrame, generations: pd.DataFrame, fallback: str) -> pd.DataFrame:
    """One row per item: gold, extracted prediction, both grades and the lenient rule that matched.
    Every prompt must have exactly one generation and every generation a prompt: an item lost
    between the two would shrink n without a word."""
    missing = sorted(set(prompts["id"]) - set(generations["id"]), key=str)
    unknown = sorted(set(generations["id"]) - set(prompts["id"]), key=str)
    if missing or unknown:
        raise ValueError(f"prompts and generations disagree: {len(missing)} prompts have no generation "
                         f"(ids {missing[:10]}{' …' if len(missing) > 10 else ''}) and {len(unknown)} "
                         f"generations no prompt (ids {unknown[:10]}); the generations file is stale "
                         "or cut short: rerun its generate job (snakemake -R <generations file>)")
    merged = prompts[["id", "answer", "inserted_tokens"]].merge(generations, on="id", validate="1:1")
    extracted = [extract_answer(text, fallback) for text in merged["response"]]
    merged["pred"] = [pred for pred, _ in extracted]
    merged["extraction"] = [how for _, how in extracted]
    merged["math_verify"] = [grade_math_verify(g, p) for g, p in zip(merged["answer"], merged["pred"])]
    rules = pd.Series([lenient_match(g, p) for g, p in zip(merged["answer"], merged["pred"])],
                      index=merged.index, dtype=object)
    merged["lenient"] = rules.isin(["exact", "substring"])
    merged["lenient_rule"] = rules  # after the grade: earlier columns keep their places
    return merged.rename(columns={"answer": "gold"})


def bootstrap_ci(correct, confidence: float, n_resamples: int, seed: int) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of 0/1 outcomes."""
    values = np.asarray(correct, dtype=float)
    if len(values) == 0:
        return float("nan"), float("nan")
    if values.min() == values.max():
        # Every resample of a constant sample has that same mean.
        return float(values[0]), float(values[0])
    result = stats.bootstrap((values,), np.mean, confidence_level=confidence,
                             n_resamples=n_resamples, method="percentile",
                             rng=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def bootstrap_cis(samples: np.ndarray, confidence: float, n_resamples: int, seed: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``bootstrap_ci`` of each row of ``samples`` [rows, n], in one call: every row is
    resampled with the indices a call of ``bootstrap_ci`` on that row alone draws (the same
    seed, the same n), so each interval is that call's, to the last bit in every case compared
    (tests/test_grading.py; 96 attention bands) though the percentile of a 2-D batch may round
    differently (one of 96 accuracy ends differs by 0.08 points when a 1-row batch replaces
    ``bootstrap_ci``, which therefore keeps its own call)."""
    samples = np.asarray(samples, dtype=float)
    low, high = np.full(len(samples), np.nan), np.full(len(samples), np.nan)
    if samples.shape[-1] == 0 or not len(samples):
        return low, high
    constant = samples.min(1) == samples.max(1)
    low[constant] = high[constant] = samples[constant, 0]
    varying = ~constant
    if varying.any():
        result = stats.bootstrap((samples[varying],), np.mean, confidence_level=confidence, axis=-1,
                                 n_resamples=n_resamples, method="percentile",
                                 rng=np.random.default_rng(seed))
        low[varying], high[varying] = result.confidence_interval.low, result.confidence_interval.high
    return low, high


def summarise(graded: pd.DataFrame, confidence: float = 0.95) -> dict:
    """Accuracy (in %) with its confidence interval, for each grader: a proportion's, the Wilson
    score interval (``attnlab.reasoning.paired``)."""
    summary = {"n": int(len(graded)),
               "inserted_tokens": float(graded["inserted_tokens"].mean()),
               # Where each answer came from, so a reader sees grades that rest on the fallback.
               **{f"extracted_{how}": float((graded["extraction"] == how).mean()) for how in EXTRACTIONS},
               "hit_token_limit": float(graded["hit_token_limit"].mean()),
               "n_hit_token_limit": int(graded["hit_token_limit"].sum())}
    for grader in GRADERS:
        low, high = wilson(int(graded[grader].sum()), len(graded), confidence)
        summary[f"{grader}_acc"] = 100 * float(graded[grader].mean())
        summary[f"{grader}_ci_low"], summary[f"{grader}_ci_high"] = 100 * low, 100 * high
    summary["interval"] = f"{INTERVAL}, {100 * confidence:g}%"
    # The paper's number stays above; this says how much of it only a substring match gives.
    substring = graded["lenient_rule"] == "substring"
    summary["lenient_substring_only"] = int(substring.sum())
    summary["lenient_exact_acc"] = 100 * float((graded["lenient_rule"] == "exact").mean())
    return summary
