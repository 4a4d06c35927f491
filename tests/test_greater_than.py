"""Greater-Than's year formulation and metric, on tiny tokenizers built here (no download)."""

import pytest
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from attnlab.patching.heads import Patcher, build_batch
from attnlab.patching.tasks import TaskError, generate_task, year_formulation

# Llama-3's pre-tokenizer pattern: numbers are split into runs of up to three digits.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
NOUNS = ["war", "siege", "trip", "reign", "tour"]  # single tokens, so generate_task finds nouns
DIGITS = "0123456789"


def _tokenizer(kind: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE whose numbers split like GPT-2's, Llama-3's or digit by digit."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    merges: list[tuple[str, str]] = []
    if kind == "gpt2":  # " 1732" -> " 17", "32": "Ġd" first, then "Ġde", then "de"
        pre = byte_level
        merges += [("Ġ", d) for d in DIGITS]
        merges += [("Ġ" + d, e) for d in DIGITS for e in DIGITS]
        merges += [(d, e) for d in DIGITS for e in DIGITS]
    elif kind == "llama3":  # " 1732" -> " ", "173", "2": every 1-3 digit run is one token
        pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                       pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        merges += [(d, e) for d in DIGITS for e in DIGITS]
        merges += [(d + e, f) for d in DIGITS for e in DIGITS for f in DIGITS]
        merges += [(d, e + f) for d in DIGITS for e in DIGITS for f in DIGITS]
    elif kind == "digits":  # " 1732" -> " ", "1", "7", "3", "2" (SmolLM2, Gemma-3)
        pre = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        raise ValueError(kind)
    for noun in NOUNS:  # "Ġwar" from "Ġ" + "w", then + "a", then + "r"
        merges += [("Ġ" + noun[:i], noun[i]) for i in range(len(noun))]
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    unique = list(dict.fromkeys(merges))
    for left, right in unique:
        vocab.setdefault(left + right, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=unique))
    tokenizer.pre_tokenizer = pre
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    wrapped.name_or_path = f"tiny-{kind}"
    return wrapped


def _pieces(tokenizer, text):
    return tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False).input_ids)


def test_the_tiny_tokenizers_split_years_like_their_models():
    assert _pieces(_tokenizer("gpt2"), " 1732")[-2:] == ["Ġ17", "32"]
    assert _pieces(_tokenizer("llama3"), " 1732") == ["Ġ", "173", "2"]
    assert _pieces(_tokenizer("llama3"), " 17") == ["Ġ", "17"]
    assert _pieces(_tokenizer("digits"), " 1732") == ["Ġ", "1", "7", "3", "2"]
    assert _pieces(_tokenizer("gpt2"), " war") == ["Ġwar"]


def test_formulation_follows_the_pieces():
    assert year_formulation(_tokenizer("gpt2")) == "two_digit"
    assert year_formulation(_tokenizer("digits")) == "digits"


def test_llama3_grouping_fails_naming_the_tokenizer_and_year():
    """Counting tokens picks two_digit here (" 17" is 2 tokens, " 1732" 3), reading p("32" | ... "17"),
    a split Llama-3 never makes; the pieces say neither formulation is exact."""
    tokenizer = _tokenizer("llama3")
    with pytest.raises(TaskError, match=r'tokenizer tiny-llama3.*"11" is not its own tokens in the year 1100'):
        year_formulation(tokenizer)
    with pytest.raises(TaskError, match="tiny-llama3"):
        generate_task("greater_than", tokenizer, 4, seed=0)


def _brute_force(model, tokenizer, prompt: str, yy: int) -> float:
    """Σ p(y > YY) − Σ p(y ≤ YY), each p(y) the product of its pieces' probabilities as the
    tokenizer splits prompt + "y": the 100 full sequences (equal lengths, no padding) go through
    the model as independent rows, nothing shared with the metric's digit-extended rows."""
    head = tokenizer(prompt).input_ids
    rows = [tokenizer(prompt + f"{y:02d}").input_ids for y in range(100)]
    assert all(row[:len(head)] == head for row in rows) and len({len(row) for row in rows}) == 1
    with torch.no_grad():
        logp = model(torch.tensor(rows)).logits.double().log_softmax(-1)
    total = 0.0
    for y, row in enumerate(rows):
        p = 1.0
        for i in range(len(head), len(row)):
            p *= logp[y, i - 1, row[i]].exp().item()
        total += p if y > yy else -p
    return total


@pytest.mark.parametrize("kind", ["gpt2", "digits"])
def test_greater_than_metric_matches_brute_force(kind):
    tokenizer = _tokenizer(kind)
    torch.manual_seed(0)
    # A wide init so the next-token distribution is far from uniform.
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.5)
    # float64: in float32 the metric and the brute force differ by up to 2.6e-7 (logits to 15, rows
    # batched otherwise), against 1e-6; in float64 by < 1e-7, the metric's own softmax in float32
    model = LlamaForCausalLM(config).eval().double()
    # Raise the logits of number tokens (unequally) so that p(YY) is far from negligible.
    vocab = tokenizer.get_vocab()
    numbers = torch.tensor(sorted(i for token, i in vocab.items() if token.isdigit() and len(token) <= 2))  # get_vocab's order varies by run
    boost = torch.zeros(len(tokenizer))
    boost[numbers] = 3 + 4 * torch.rand(len(numbers), generator=torch.Generator().manual_seed(6))
    model.lm_head.register_forward_hook(lambda module, args, out: out + boost)
    prompts = generate_task("greater_than", tokenizer, 3, seed=2)
    assert prompts.info["formulation"] == {"gpt2": "two_digit", "digits": "digits"}[kind]
    batch = build_batch(prompts, tokenizer)
    patcher = Patcher(model, batch, "corrupted", batch_size=2 * batch.rows_per_prompt)  # two chunks
    clean = [_brute_force(model, tokenizer, p, yy) for p, yy in zip(prompts.clean, prompts.years)]
    corrupted = [_brute_force(model, tokenizer, p, yy) for p, yy in zip(prompts.corrupted, prompts.years)]
    assert min(abs(c) for c in clean + corrupted) > 0.05  # far from a trivially zero metric
    assert patcher.metric() == pytest.approx(sum(clean) / 3, rel=1e-4, abs=1e-6)
    assert patcher.corrupted_metric() == pytest.approx(sum(corrupted) / 3, rel=1e-4, abs=1e-6)
