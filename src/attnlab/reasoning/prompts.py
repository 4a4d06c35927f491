"""Prompt variants per condition, with token spans for every prompt region.

A prompt is a system prompt, an inserted text and a question. The insertion
goes, by the condition's ``placement``: between the system prompt and the
question (``between``, the paper's best position and the default), at the
start of the system prompt (``system_start``), at a seeded random word boundary
of the question outside any formula (``question_random``) or after the
question (``end``). Its length
is counted in tokens under each model's own tokenizer. For every prompt we
record the half-open token span ``[start, end)`` of each region, and of
``cut`` (the insertion with its separator), so that attention plots can align
prompts and shade the inserted run.
"""

from __future__ import annotations

import logging
import random
import re
from dataclasses import dataclass

import pandas as pd

from attnlab.config.checks import check_raw_template

log = logging.getLogger(__name__)

REGIONS = ("system", "inserted", "question")
# Stored spans: the regions, then the tokens alignment removes (insertion + separator).
SPANS = (*REGIONS, "cut")
PLACEMENTS = ("system_start", "between", "question_random", "end")

# Used by `kind: text` conditions without their own text ("random" in the
# paper, which gives no text). Fixed so that runs are comparable; unrelated to
# mathematics on purpose.
DEFAULT_UNRELATED_TEXT = (
    "The old lighthouse keeper walked along the rocky shore every morning, "
    "listening to the gulls and watching the fishing boats drift out past the "
    "harbour wall. In the village behind him the bakery opened its shutters, "
    "the church bell rang seven times, and children hurried down the narrow "
    "lanes towards the school by the river. Autumn had painted the hills in "
    "shades of copper and gold, and the smell of wood smoke hung over the "
    "rooftops while the tide slowly turned beneath a pale and quiet sky."
)


class PromptError(ValueError):
    """A prompt cannot be built as configured."""


def _token_count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def insertion_text(tokenizer, condition: dict) -> str:
    """The text a condition inserts, about ``length`` tokens long under ``tokenizer``."""
    kind, length = condition["kind"], condition.get("length", 0)
    if kind == "none" or length == 0:
        return ""
    if kind == "repeat":
        unit = condition["unit"]
        # Smallest number of space-separated units reaching the target length
        # (paper: 54 "/" joined by spaces, ~55 tokens).
        for repeats in range(1, 4 * length + 1):
            text = " ".join([unit] * repeats)
            if _token_count(tokenizer, text) >= length:
                return text
        raise PromptError(f"cannot reach {length} tokens by repeating {unit!r}")
    if kind == "text":
        source = condition.get("text") or DEFAULT_UNRELATED_TEXT
        ids = tokenizer(source, add_special_tokens=False).input_ids
        while len(ids) < length:
            source = f"{source} {source}"
            ids = tokenizer(source, add_special_tokens=False).input_ids
        return tokenizer.decode(ids[:length], skip_special_tokens=True).strip()
    raise PromptError(f"unknown condition kind {kind!r}")


TEMPLATE_DATE = "26 Jul 2024"  # Llama-3.1's own default when no date is passed


def format_prompt(tokenizer, prompt_format: str, raw_template: str, system: str, user: str) -> str:
    """The full prompt text in the model's chat template or the raw template."""
    if prompt_format == "chat":
        if not tokenizer.chat_template:
            raise PromptError(
                "prompt_format is 'chat' but the tokenizer has no chat template; "
                "set prompt_format: raw for this model (base models have none)"
            )
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        # Templates that print today's date (Llama-3.1) read date_string: fix it, so a
        # prompt does not depend on the day it was built.
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             date_string=TEMPLATE_DATE)
    check_raw_template(raw_template)  # a stray brace would end in an IndexError or KeyError
    return raw_template.format(system=system, user=user)


def compose(system: str, inserted: str, question: str, placement: str = "between",
            position: int | None = None) -> tuple[str, str, list[tuple[str, str]]]:
    """System and user message texts, and the pieces they are made of, in text order.

    Pieces are ``(region, text)`` with region one of system, inserted,
    separator (the whitespace that joins the insertion to its neighbour) or
    question (twice when the insertion splits it). ``position`` is the number
    of question words before the insertion for ``question_random``.
    """
    if not inserted:
        # an empty insertion sits where the default placement would put it
        return system, question, [("system", system), ("inserted", ""), ("question", question)]
    if placement == "between":
        return system, f"{inserted}\n{question}", [
            ("system", system), ("inserted", inserted), ("separator", "\n"), ("question", question)]
    if placement == "system_start":
        return f"{inserted}\n{system}", question, [
            ("inserted", inserted), ("separator", "\n"), ("system", system), ("question", question)]
    if placement == "end":
        return system, f"{question}\n{inserted}", [
            ("system", system), ("question", question), ("separator", "\n"), ("inserted", inserted)]
    if placement == "question_random":
        words = question.split(" ")
        if position is None or not 1 <= position <= len(words):
            raise PromptError(f"question_random needs a position in 1..{len(words)}, got {position}")
        head, tail = " ".join(words[:position]), " ".join(words[position:])
        pieces = [("system", system), ("question", head), ("separator", " "), ("inserted", inserted)]
        if tail:
            pieces.append(("question", f" {tail}"))
        return system, "".join(text for _, text in pieces[1:]), pieces
    raise PromptError(f"unknown placement {placement!r}; expected one of {PLACEMENTS}")


# A word that is part of a formula: it holds a digit or is only operator characters.
_FORMULA_WORD = re.compile(r"\d|^[-+*/×÷=<>^%()]+$")
# TeX math delimiters: an escaped dollar is text; $$ opens or closes display math as one.
_MATH_DELIMITER = re.compile(r"\\\$|\$\$|\$|\\[()\[\]]")


def _inside_math(text: str) -> bool:
    """Whether the end of ``text`` lies inside a $...$, $$...$$, \\(...\\) or \\[...\\] span."""
    open_ = None
    for match in _MATH_DELIMITER.finditer(text):
        token = match.group()
        if token == "\\$":
            continue
        if open_ is None and token in ("$", "$$", "\\(", "\\["):
            open_ = token
        elif open_ is not None and token == {"$": "$", "$$": "$$", "\\(": "\\)", "\\[": "\\]"}[open_]:
            open_ = None
    return open_ is not None


def insertion_boundaries(question: str) -> list[int]:
    """Word boundaries (after 1..all words) where an insertion cannot change a formula: not
    inside TeX math and not between two formula words ("7 + 5": a "/" there reads as division)."""
    words = question.split(" ")
    allowed = []
    for after in range(1, len(words) + 1):
        if after < len(words) and _FORMULA_WORD.search(words[after - 1]) and _FORMULA_WORD.search(words[after]):
            continue
        if _inside_math(" ".join(words[:after])):
            continue
        allowed.append(after)
    # An unclosed "$" (a currency sign read as TeX) can rule out every boundary but the end,
    # which splits no formula: fewer boundaries, never one inside a formula.
    return allowed or [len(words)]


def random_position(question: str, item_id: str, seed: int) -> int:
    """A word boundary of the question outside math (see insertion_boundaries), fixed per item
    and seed."""
    return random.Random(f"{seed}:{item_id}").choice(insertion_boundaries(question))


def char_ranges(text: str, pieces: list[tuple[str, str]]) -> dict[str, tuple[int, int]]:
    """Character range of every region in ``text``, and of ``cut``: the insertion with its
    separator, i.e. what to remove to get the prompt without insertion.

    Pieces are searched in order, so regions cannot overlap; a separator must
    follow its neighbour directly (a template that trims it leaves it empty).
    """
    found: dict[str, list[tuple[int, int]]] = {name: [] for name in (*REGIONS, "separator")}
    cursor = 0
    for name, piece in pieces:
        if name == "separator":
            end = cursor + len(piece) if text.startswith(piece, cursor) else cursor
            found[name].append((cursor, end))
            cursor = end
            continue
        start = text.find(piece, cursor) if piece else cursor
        if start < 0:
            raise PromptError(f"the prompt template changed the {name} text; cannot locate it")
        found[name].append((start, start + len(piece)))
        cursor = start + len(piece)
    # compose() gives every region a piece; the insertion and its separator are adjacent
    found["cut"] = found["inserted"] + found["separator"]
    return {name: (min(s for s, _ in parts), max(e for _, e in parts)) for name, parts in found.items()
            if name != "separator"}


def token_span(offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """Half-open span of the tokens whose characters overlap ``[start, end)``; an empty range
    (nothing inserted) is an empty span, even where a token straddles its point (Gemma-3 merges
    the system text's last characters with what follows)."""
    inside = [i for i, (s, e) in enumerate(offsets) if e > s and s < end and e > start] if end > start else []
    if not inside:
        # Empty region: an empty span at the first token starting at/after `start`.
        after = [i for i, (s, e) in enumerate(offsets) if e > s and s >= start]
        at = after[0] if after else len(offsets)
        return at, at
    return inside[0], inside[-1] + 1


def fewshot_system(system: str, examples: pd.DataFrame | None, raw_template: str) -> str:
    """The system prompt followed by worked examples, each the question, the raw template's
    text after {user} and a boxed answer, blank lines between; the last one is followed by a
    blank line before the question (with the default template)."""
    if examples is None or not len(examples):
        return system
    after_user = raw_template.split("{user}", 1)[1].replace("{{", "{").replace("}}", "}")
    shots = [f"{q}{after_user} The answer is \\boxed{{{a}}}." for q, a in zip(examples["question"], examples["answer"])]
    return "\n\n".join([system, *shots]) + "\n"


@dataclass
class BuiltPrompt:
    text: str
    input_ids: list[int]
    spans: dict[str, tuple[int, int]]  # SPANS -> [start, end) token indices
    span_exact: bool


def build_prompt(tokenizer, prompt_format: str, raw_template: str, system: str, inserted: str,
                 question: str, placement: str = "between", position: int | None = None) -> BuiltPrompt:
    system_text, user_text, pieces = compose(system, inserted, question, placement, position)
    text = format_prompt(tokenizer, prompt_format, raw_template, system_text, user_text)
    ranges = char_ranges(text, pieces)
    # Chat templates carry their own BOS; a raw prompt gets the tokenizer's.
    encoded = tokenizer(text, add_special_tokens=prompt_format == "raw", return_offsets_mapping=True)
    spans = {name: token_span(encoded.offset_mapping, *ranges[name]) for name in SPANS}
    exact = all(
        tokenizer.decode(encoded.input_ids[s:e], clean_up_tokenization_spaces=False).strip()
        == text[slice(*ranges[name])].strip()
        for name, (s, e) in spans.items()
    )
    return BuiltPrompt(text, list(encoded.input_ids), spans, exact)


def make_prompts(tokenizer, questions: pd.DataFrame, condition_name: str, condition: dict,
                 prompt_cfg: dict, prompt_format: str, max_context: int,
                 examples: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per question: prompt text, token ids and region spans. ``examples``: the
    worked examples of a few-shot (raw-format) model, part of the system region."""
    if examples is not None and len(examples) and prompt_format != "raw":
        raise PromptError("few-shot examples are for prompt_format: raw (base) models")
    system = fewshot_system(prompt_cfg["system"], examples, prompt_cfg["raw_template"])
    if questions.empty:
        raise PromptError(f"condition '{condition_name}': the dataset has no questions; check its "
                          "source and n in the config")
    inserted = insertion_text(tokenizer, condition)
    placement = condition.get("placement", "between")
    rows = []
    for item in questions.itertuples(index=False):
        position = (random_position(item.question, str(item.id), condition.get("seed", 0))
                    if placement == "question_random" else None)
        built = build_prompt(tokenizer, prompt_format, prompt_cfg["raw_template"],
                             system, inserted, item.question, placement, position)
        if len(built.input_ids) > max_context:
            raise PromptError(
                f"item '{item.id}': prompt is {len(built.input_ids)} tokens, longer than the "
                f"model's context of {max_context}; drop the item or shorten the insertion"
            )
        row = {"id": item.id, "question": item.question, "answer": item.answer,
               "condition": condition_name, "prompt_format": prompt_format,
               "prompt": built.text, "input_ids": built.input_ids,
               "n_prompt_tokens": len(built.input_ids), "inserted_text": inserted,
               "inserted_chars": len(inserted), "placement": placement if inserted else "none",
               "arm": bool(condition.get("arm", False)), "span_exact": built.span_exact,
               "template_date": TEMPLATE_DATE if prompt_format == "chat" else "",
               "fewshot": 0 if examples is None else len(examples)}
        for name, (start, end) in built.spans.items():
            row[f"{name}_start"], row[f"{name}_end"] = start, end
        row["inserted_tokens"] = row["inserted_end"] - row["inserted_start"]
        rows.append(row)
    frame = pd.DataFrame(rows)
    inexact = int((~frame["span_exact"]).sum())
    if inexact:
        log.warning("%d prompts have a token merged across a region boundary; "
                    "their spans are approximate (span_exact=False)", inexact)
    log.info("condition %s: %d inserted tokens (%d characters)", condition_name,
             frame["inserted_tokens"].iloc[0] if len(frame) else 0, len(inserted))
    return frame
