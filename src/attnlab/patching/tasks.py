"""Mechanistic-interpretability tasks with clean/corrupted prompt pairs.

Every task yields prompts whose answer is the next token after the prompt.
Name, place, object, noun and argument slots are filled only with words
that are exactly one token (with their leading space) under the model's
tokenizer, so every prompt of a template has the same token length and a
corrupted prompt lines up position by position with its clean prompt.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import Counter
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

NAMES = """Mary John Alice Bob Tom James Michael David Sarah Emma Anna Laura Kate Paul Mark Peter
George Jack Henry Lucy Rose Grace Amy Jane Susan Linda Karen Lisa Nancy Betty Helen Sandra Donna
Carol Ruth Sharon Michelle Kevin Brian Jason Ryan Eric Adam Justin Daniel Matthew Andrew Joshua
Steven Edward Thomas Robert William Richard Joseph Charles Christopher Anthony Frank Scott Gary
Larry Jeff Jerry Dennis Walter Patrick Harry Carl Arthur Roger Joe Juan Jim Louis Bill Ben Sam
Max Leo Alex Ethan Noah Liam Mia Ella Lily Chloe Zoe Ruby Ivy Eva Nina Sophie Julia Clara Hannah
Olivia Victoria Martin""".split()
PLACES = "store garden restaurant school hospital office house station park beach".split()
OBJECTS = "ring kiss bone basketball computer necklace drink snack book ball".split()
IOI_TEMPLATES = [
    "Then, {B} and {A} went to the {PLACE}. {B} gave a {OBJECT} to",
    "Then, {B} and {A} had a lot of fun at the {PLACE}. {B} gave a {OBJECT} to",
    "Then, {B} and {A} were working at the {PLACE}. {B} decided to give a {OBJECT} to",
    "Then, {B} and {A} were thinking about going to the {PLACE}. {B} wanted to give a {OBJECT} to",
    "Then, {B} and {A} had a long argument, and afterwards {B} said to",
    "After {B} and {A} went to the {PLACE}, {B} gave a {OBJECT} to",
    "When {B} and {A} got a {OBJECT} at the {PLACE}, {B} decided to give it to",
    "When {B} and {A} got a {OBJECT} at the {PLACE}, {B} decided to give the {OBJECT} to",
    "While {B} and {A} were working at the {PLACE}, {B} gave a {OBJECT} to",
    "While {B} and {A} were commuting to the {PLACE}, {B} gave a {OBJECT} to",
    "After the lunch, {B} and {A} went to the {PLACE}. {B} gave a {OBJECT} to",
    "Afterwards, {B} and {A} went to the {PLACE}. {B} gave a {OBJECT} to",
    "Then, {B} and {A} had a long argument. Afterwards {B} said to",
    "The {PLACE} {B} and {A} went to had a {OBJECT}. {B} gave it to",
    "Friends {B} and {A} found a {OBJECT} at the {PLACE}. {B} gave it to",
]
# IOI-long: the same sentences after an unrelated prefix and a longer clause.
IOI_LONG_PREFIX = ("The weather had been mild for most of the week, and the town was busy "
                   "with people preparing for the autumn fair. ")
IOI_LONG_TEMPLATES = [
    "Then in the morning, after a quiet breakfast, {B} and {A} went to the {PLACE}. {B} gave a {OBJECT} to",
    "Later that day, once the rain had stopped, {B} and {A} walked to the {PLACE}. {B} handed a {OBJECT} to",
    "In the evening, when the shops were closing, {B} and {A} arrived at the {PLACE}. {B} gave a {OBJECT} to",
    "Early on Sunday, before anyone else was awake, {B} and {A} went to the {PLACE}. {B} passed a {OBJECT} to",
]
GREATER_THAN_NOUNS = """war strike dispute expedition campaign occupation project program journey
trip contract deal reign rule conflict crisis blockade siege drought famine flood boom recession
depression revolution rebellion movement partnership alliance treaty marriage relationship
friendship career tour season festival exhibition trial investigation study survey experiment
mission voyage construction renovation restoration excavation migration settlement colonization
empire dynasty regime administration presidency tenure term residency apprenticeship training
course semester lease loan mortgage subscription membership sponsorship ban embargo boycott
shutdown lockdown curfew quarantine outbreak epidemic pandemic competition tournament league
championship race rivalry feud battle invasion retreat truce ceasefire negotiation collaboration
venture business company firm band orchestra show series broadcast production performance""".split()
ARG_NAMES = """value name data size count index key item path file text line word mode level
score token label limit offset start end step rate scale weight shape width height depth color
order state flag status result source target parent child node edge graph tree list table row
column field record entry message event action query filter config option param buffer stream
socket port host user group role price amount total number length format version""".split()
DOCSTRING_DESCRIPTIONS = ["the input to process", "how many times to repeat", "where to write the output",
                          "the current state", "an optional limit", "the name to use",
                          "the size of each block", "whether to be verbose"]
DOCSTRING_FUNCTIONS = "load process update render compute build merge parse check apply".split()


class TaskError(ValueError):
    """A task cannot be generated as configured."""


@dataclass
class TaskPrompts:
    """Clean and corrupted prompts with the tokens the metric reads."""

    task: str
    clean: list[str]
    corrupted: list[str]
    templates: list[int]  # prompts of one template have equal token length
    answers: list[int]  # IOI/IOI-long: IO token; Docstring: correct argument token
    distractors: list[list[int]]  # IOI: [S token]; Docstring: the wrong argument tokens
    years: list[int] = field(default_factory=list)  # Greater-Than: YY of each prompt
    info: dict = field(default_factory=dict)


def single_tokens(tokenizer, words: list[str], what: str) -> dict[str, int]:
    """Words that are exactly one token with a leading space, as word -> token id."""
    kept = {}
    for word in words:
        ids = tokenizer(" " + word, add_special_tokens=False).input_ids
        if len(ids) == 1:
            kept[word] = ids[0]
    log.info("%s: %d of %d candidates are one token under %s", what, len(kept), len(words),
             type(tokenizer).__name__)
    if not kept:
        raise TaskError(f"no {what} is a single token under tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)}; "
                        f"candidates were {words}")
    return kept


def _ioi(tokenizer, n: int, seed: int, templates: list[str], prefix: str, task: str) -> TaskPrompts:
    rng = random.Random(seed)
    names = single_tokens(tokenizer, NAMES, "IOI names")
    if len(names) < 5:
        raise TaskError(f"{task} needs at least 5 single-token names, {len(names)} survive: {sorted(names)}")
    places = single_tokens(tokenizer, PLACES, "IOI places")
    objects = single_tokens(tokenizer, OBJECTS, "IOI objects")
    out = TaskPrompts(task, [], [], [], [], [])
    variants = [(t, order) for t in templates for order in ("BABA", "ABBA")]
    for i in range(n):
        index = i % len(variants)
        template, order = variants[index]
        if order == "ABBA":  # the first two names swap places
            template = template.replace("{B} and {A}", "{A} and {B}", 1)
        a, b, c, d, e = rng.sample(sorted(names), 5)
        place, obj = rng.choice(sorted(places)), rng.choice(sorted(objects))
        out.clean.append(prefix + template.format(A=a, B=b, PLACE=place, OBJECT=obj))
        # Corrupted (ABC): all three name slots get fresh names.
        out.corrupted.append(prefix + _fill_three(template, c, d, e).format(PLACE=place, OBJECT=obj))
        out.templates.append(index)
        out.answers.append(names[a])
        out.distractors.append([names[b]])
    out.info = {"names": len(names), "places": len(places), "objects": len(objects)}
    return out


def _fill_three(template: str, first: str, second: str, third: str) -> str:
    """Replace the three name slots, in order of appearance, with three names."""
    filled = template
    for name in (first, second, third):
        cut = min(pos for pos in (filled.find("{A}"), filled.find("{B}")) if pos >= 0)
        filled = filled[:cut] + name + filled[cut + 3:]
    return filled


def ioi(tokenizer, n: int, seed: int) -> TaskPrompts:
    return _ioi(tokenizer, n, seed, IOI_TEMPLATES, "", "ioi")


def ioi_long(tokenizer, n: int, seed: int) -> TaskPrompts:
    return _ioi(tokenizer, n, seed, IOI_LONG_TEMPLATES, IOI_LONG_PREFIX, "ioi_long")


CENTURIES = range(11, 18)  # the prompts' XX
# The end of every Greater-Than prompt; the pieces of "YY" after it are checked in this context.
YEAR_CONTEXT = "The war lasted from the year {xx}01 to the year {xx}"


def year_continuations(tokenizer) -> tuple[str, list[list[int]]]:
    """The Greater-Than formulation and, for YY = 00..99, the token ids of "YY" after "... the year XX".

    Decided from the pieces the tokenizer actually produces for every century
    used, so the metric reads only splits the model sees: 'two_digit' when
    "XXYY" is the pieces of "XX" followed by the one token "YY" (GPT-2 style),
    'digits' when it is "XX" followed by one token per digit, with the same
    token for a digit wherever it stands. Token counts alone cannot tell: under
    Llama-3 (up to three digits per token) " 1732" is " ", "173", "2", which
    also has one token after " ", "17". No exact formulation: TaskError.
    """
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    failures = {}
    for formulation in ("two_digit", "digits"):
        pieces, failure = _year_pieces(tokenizer, formulation)
        if failure is None:
            return formulation, pieces
        failures[formulation] = failure
    raise TaskError(f"Greater-Than is not supported under tokenizer {name}: no formulation reads the year "
                    f"as the model sees it (two-digit: {failures['two_digit']}; "
                    f"digit by digit: {failures['digits']})")


def _year_pieces(tokenizer, formulation: str) -> tuple[list[list[int]], str | None]:
    """Per YY, the continuation ids of ``formulation``, or a description of the first year that breaks it."""
    def encode(text):
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    size = {"two_digit": 1, "digits": 2}[formulation]
    expected: list[list[int]] = []
    for xx in CENTURIES:
        prompt = YEAR_CONTEXT.format(xx=xx)
        head = encode(prompt)
        for yy in range(100):
            full, year = encode(prompt + f"{yy:02d}"), f"{xx}{yy:02d}"
            tail = full[len(head):]
            if full[:len(head)] != head:
                return [], f'the prompt\'s "{xx}" is not its own tokens in the year {year}'
            if len(tail) != size:
                return [], f'"{yy:02d}" is {len(tail)} token(s) after "{xx}" in the year {year}'
            if len(expected) < 100:
                expected.append(tail)
            elif tail != expected[yy]:
                return [], f'"{yy:02d}" is other tokens after "{xx}" than after "{CENTURIES[0]}" (year {year})'
    if formulation == "digits":
        # p(d1 d2) = p(d1) p(d2 | d1) reads one id per digit, the same in either place.
        digit = [expected[10 * d][0] for d in range(10)]
        for yy in range(100):
            if expected[yy] != [digit[yy // 10], digit[yy % 10]] or len(set(digit)) != 10:
                return [], f'the digits of "{yy:02d}" are not the same tokens in both places'
    return expected, None


def year_formulation(tokenizer) -> str:
    """'two_digit' if "XXYY" splits as "XX" + "YY" (GPT-2 style), 'digits' if digit by digit."""
    return year_continuations(tokenizer)[0]


def greater_than(tokenizer, n: int, seed: int) -> TaskPrompts:
    rng = random.Random(seed)
    nouns = single_tokens(tokenizer, GREATER_THAN_NOUNS, "Greater-Than nouns")
    formulation = year_formulation(tokenizer)
    out = TaskPrompts("greater_than", [], [], [], [], [])
    template = "The {noun} lasted from the year {xx}{yy:02d} to the year {xx}"
    for _ in range(n):
        noun, xx, yy = rng.choice(sorted(nouns)), rng.randint(CENTURIES[0], CENTURIES[-1]), rng.randint(2, 98)
        out.clean.append(template.format(noun=noun, xx=xx, yy=yy))
        out.corrupted.append(template.format(noun=noun, xx=xx, yy=1))
        out.templates.append(0)
        out.years.append(yy)
        out.answers.append(-1)
        out.distractors.append([])
    out.info = {"nouns": len(nouns), "formulation": formulation}
    return out


def docstring(tokenizer, n: int, seed: int) -> TaskPrompts:
    rng = random.Random(seed)
    args = single_tokens(tokenizer, ARG_NAMES, "Docstring argument names")
    if len(args) < 12:
        raise TaskError(f"Docstring needs 12 single-token argument names, {len(args)} survive: {sorted(args)}")
    out = TaskPrompts("docstring", [], [], [], [], [])
    for _ in range(n):
        chosen = rng.sample(sorted(args), 12)
        clean, fresh = chosen[:6], chosen[6:]
        # One template per function name; descriptions are fixed so that
        # prompts of a template have equal token length.
        template = rng.randrange(len(DOCSTRING_FUNCTIONS))
        function = DOCSTRING_FUNCTIONS[template]
        descriptions = DOCSTRING_DESCRIPTIONS[:5]
        out.clean.append(_docstring_prompt(function, clean, clean, descriptions))
        # Corrupted: the docstring names other arguments than the signature.
        out.corrupted.append(_docstring_prompt(function, clean, fresh, descriptions))
        out.templates.append(template)
        out.answers.append(args[clean[5]])
        out.distractors.append([args[a] for a in clean[:5]])
    out.info = {"argument_names": len(args)}
    return out


def _docstring_prompt(function: str, signature: list[str], documented: list[str],
                      descriptions: list[str]) -> str:
    lines = [f"def {function}(self, {', '.join(signature)}):", '    """Do the work.', ""]
    lines += [f"    :param {name}: {text}" for name, text in zip(documented[:5], descriptions)]
    return "\n".join(lines) + "\n    :param"


GENERATORS = {"ioi": ioi, "ioi_long": ioi_long, "greater_than": greater_than, "docstring": docstring}


def generate_task(task: str, tokenizer, n: int, seed: int) -> TaskPrompts:
    prompts = GENERATORS[task](tokenizer, n, seed)
    check_alignment(tokenizer, prompts)
    return prompts


def check_alignment(tokenizer, prompts: TaskPrompts) -> None:
    """Clean and corrupted prompts must have equal token lengths, per template."""
    lengths: dict[int, int] = {}
    for clean, corrupted, template in zip(prompts.clean, prompts.corrupted, prompts.templates):
        a = len(tokenizer(clean).input_ids)
        b = len(tokenizer(corrupted).input_ids)
        if a != b or lengths.setdefault(template, a) != a:
            raise TaskError(f"{prompts.task}: prompts of template {template} differ in token length "
                            f"({a}, {b}, {lengths[template]}): {clean!r} / {corrupted!r}")


def subset(prompts: TaskPrompts, indices) -> TaskPrompts:
    """The prompts at ``indices``, in that order (every per-prompt list picked alike)."""
    indices = [int(i) for i in indices]

    def pick(values: list) -> list:
        return [values[i] for i in indices] if values else values
    return dataclasses.replace(prompts, clean=pick(prompts.clean), corrupted=pick(prompts.corrupted),
                               templates=pick(prompts.templates), answers=pick(prompts.answers),
                               distractors=pick(prompts.distractors), years=pick(prompts.years))


def split_for_ranking(n: int, share: float, seed: int) -> tuple[list[int], list[int]]:
    """Prompt indices heads are ranked on and those they are counted on: a seeded draw of
    ``round(share * n)`` prompts (at least one, leaving at least one) to rank on. ``share`` 0:
    ranked and counted on all of them (the count is then measured on the prompts that chose
    the heads, which flatters it)."""
    if share == 0:
        everything = list(range(n))
        return everything, everything
    if not 0 < share < 1:
        raise ValueError(f"the share of prompts heads are ranked on must be in [0, 1), not {share}")
    if n < 2:
        raise TaskError(f"ranking on one share of the prompts and counting on the rest needs at "
                        f"least 2 prompts, not {n}: raise pruning.tasks.<task>.n or set rank_share: 0")
    ranked = min(n - 1, max(1, round(share * n)))
    order = random.Random(f"rank split {seed}").sample(range(n), n)  # a stream apart from the task's
    return sorted(order[:ranked]), sorted(order[ranked:])


# Mean ablation's pool is drawn with the task's seed plus this: another stream of the same
# generator, so the same templates (IOI's and IOI-long's in turn, Docstring's at random)
MEAN_POOL_SEED_OFFSET = 1_000_003


def held_apart(pool: TaskPrompts, prompts: TaskPrompts, at_least: int = 2) -> TaskPrompts:
    """The prompts of ``pool`` whose clean text is none of ``prompts``': mean ablation's reference,
    apart from every prompt ranked or counted on (a template's mean that holds the ablated prompt
    ablates it only in part: by 1/m with m prompts of its template). Refused unless every template
    of ``prompts`` keeps ``at_least`` prompts (one is a resample, not a mean)."""
    taken = set(prompts.clean)
    kept = subset(pool, [i for i, text in enumerate(pool.clean) if text not in taken])
    have = Counter(kept.templates)
    short = {t: have.get(t, 0) for t in sorted(set(prompts.templates)) if have.get(t, 0) < at_least}
    if short:
        raise TaskError(f"{prompts.task}: mean ablation's pool of {len(pool.clean)} prompts "
                        f"({len(pool.clean) - len(kept.clean)} dropped as prompts of the task itself) holds fewer "
                        f"than {at_least} prompts of template(s) {short} (template: prompts); raise "
                        f"pruning.mean_pool (now {len(pool.clean)})")
    return kept
