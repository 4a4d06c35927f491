"""The static-cache decoding loop (attnlab.reasoning.decoding, engine static_cache) against transformers'
greedy generate (engine static) on tiny random models: the same tokens, EOS, stop strings and
token limits, sliding windows shorter than the prompts; which models it refuses. The real-model
checks (SmolLM2; Gemma-3 past its 512-token window) are in test_generation.py."""

import functools
import logging

import pandas as pd
import pytest
import torch
from transformers import MistralConfig, Qwen2Config

from attnlab.attention import sparse
from attnlab.interventions import intervened
from attnlab.interventions.mlp import ArmSettings
from attnlab.models import left_pad
from attnlab.reasoning import decoding
from attnlab.reasoning.generation import chosen_engine, generate_all
from test_attention import TINY, _tiny

# Sliding windows shorter than the prompts (up to 12 tokens), besides TINY's Gemma-3 (window 5):
# Qwen2 with its later layers sliding (a dict of masks by layer kind), Mistral with every layer
# sliding and no layer_types (one mask).
SLIDING = {
    "qwen2-sliding": lambda: _tiny(Qwen2Config, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "mistral": lambda: _tiny(MistralConfig, sliding_window=4),
}

EOS = 7


class _Tokenizer:
    """What the engines use of a tokenizer: padding, decoding (token ids as words), ids."""

    pad_token_id, eos_token_id = 0, EOS

    def pad(self, batch, padding, return_tensors):
        ids, mask, _ = left_pad(batch["input_ids"])
        return _Batch(input_ids=ids, attention_mask=mask)

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i in (0, EOS)))


class _Batch(dict):
    def to(self, device):
        return self


def _model(arch="llama-gqa"):
    model = {**TINY, **SLIDING}[arch]()
    if model.config.model_type != "gemma2":  # Gemma-2 has eager attention alone (soft-capping)
        model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = EOS
    return model


def _prompts(lengths=(5, 9, 12, 3, 7, 10), seed=1):
    generator = torch.Generator().manual_seed(seed)
    ids = [torch.randint(8, 101, (n,), generator=generator).tolist() for n in lengths]
    return pd.DataFrame({"id": [f"p{i}" for i in range(len(ids))], "input_ids": ids,
                         "n_prompt_tokens": [len(i) for i in ids]})


def test_static_cache_gives_the_static_engines_tokens():
    """Batches of 4 (one of 2), left padding, rows ending at EOS, at a stop string and at the limit."""
    model, tokenizer, prompts = _model(), _Tokenizer(), _prompts()
    plain = generate_all(model, tokenizer, prompts, 4, 20, engine="static")
    assert plain["hit_token_limit"].any() and not plain["hit_token_limit"].all()  # EOS and the limit
    long_row = plain.index[plain["hit_token_limit"]][0]
    stop = tokenizer.decode(plain.at[long_row, "new_token_ids"][5:7])  # ends that row at its 7th token
    for stops in ([], [stop]):
        static = generate_all(model, tokenizer, prompts, 4, 20, stops, engine="static")
        cached = generate_all(model, tokenizer, prompts, 4, 20, stops, engine="static_cache")
        assert set(cached["engine"]) == {"static_cache"} and set(static["engine"]) == {"static"}
        pd.testing.assert_frame_equal(cached.drop(columns="engine"), static.drop(columns="engine"))
    assert static.at[long_row, "n_new_tokens"] <= 7 and not static.at[long_row, "hit_token_limit"]


def test_one_new_token_and_a_single_row():
    model, tokenizer = _model(), _Tokenizer()
    for prompts, tokens in ((_prompts(), 1), (_prompts((6,)), 5)):
        static = generate_all(model, tokenizer, prompts, 4, tokens, engine="static")
        cached = generate_all(model, tokenizer, prompts, 4, tokens, engine="static_cache")
        pd.testing.assert_frame_equal(cached.drop(columns="engine"), static.drop(columns="engine"))


def test_decode_batch_pads_after_each_end_and_stops_when_all_rows_end():
    model = _model()
    rows = _prompts()["input_ids"].tolist()[:3]
    tokens, lengths, graphed = decoding.decode_batch(model, rows, 40, {EOS}, 0, graphs=False)
    assert not graphed and tokens.shape[0] == 3
    assert lengths == [row.index(EOS) + 1 if EOS in row else tokens.shape[1] for row in tokens.tolist()]
    for row in tokens.tolist():
        if EOS in row:
            assert set(row[row.index(EOS) + 1:]) <= {0}
    every_row_ends = all(EOS in row for row in tokens.tolist())
    assert tokens.shape[1] == 40 or (every_row_ends and tokens.shape[1] < 40)


@pytest.mark.parametrize("limit", [1, 5, 8, 9, 17, 40])
def test_checking_rows_behind_the_decoding_gives_the_same_tokens(limit, monkeypatch):
    """overlap (CUDA's default) reads chunk i while chunk i + 1 decodes and drops that chunk when
    every row has ended: the same tokens, lengths and width as reading each chunk at once, with
    rows ending at EOS, at a stop, and at the limit; each read lags one chunk behind the steps."""
    model = _model()
    rows = _prompts()["input_ids"].tolist()
    stopped = lambda tokens: tokens[-1:] == [tokens[0]] and len(tokens) > 1  # noqa: E731 -- a repeat ends a row
    reads, wait, decoded, decode_step = [], decoding._HostReads.wait, [0], decoding._decode_step
    monkeypatch.setattr(decoding, "_decode_step", lambda *a: (decoded.__setitem__(0, decoded[0] + 1), decode_step(*a))[1])
    monkeypatch.setattr(decoding._HostReads, "wait", staticmethod(
        lambda pending: (reads.append((pending[0], 1 + decoded[0])), wait(pending))[1]))
    every_row_at_10 = lambda tokens: len(tokens) >= 10  # noqa: E731 -- all rows end within the third chunk
    for stop in (None, stopped, every_row_at_10):
        at_once = decoding.decode_batch(model, rows, limit, {EOS}, 0, stop, graphs=False, overlap=False)
        reads.clear()
        decoded[0] = 0
        behind = decoding.decode_batch(model, rows, limit, {EOS}, 0, stop, graphs=False, overlap=True)
        assert torch.equal(behind[0], at_once[0]) and behind[1] == at_once[1]
        assert reads[0] == (1, 1) and reads[-1][0] == at_once[0].shape[1]
        # (tokens read, tokens decoded when read): a chunk further on, but at the limit
        assert all(now == min(seen + decoding.CHECK_EVERY, limit) for seen, now in reads[1:])
    every_row_ends = decoding.decode_batch(model, rows, 40, {EOS}, 0, lambda tokens: True, graphs=False, overlap=True)
    assert every_row_ends[0].shape[1] == 1 and every_row_ends[1] == [1] * len(rows)


def test_ends_are_found_incrementally_as_in_one_pass():
    rows = [[5, 6, EOS, 1], [5, 5, 5, 5], [9, 3, 3, 1]]
    stopped = lambda tokens: tokens[-2:] == [3, 3]  # noqa: E731
    ends = decoding.RowEnds(3, {EOS}, stopped)
    assert not ends.update([row[:2] for row in rows])
    assert not ends.update(rows)
    assert ends.ends == [2, None, 2]
    assert decoding.RowEnds(3, {EOS}, None).update(rows) is False


def test_models_the_loop_cannot_serve_take_the_static_engine(caplog):
    gemma = _model("gemma3-sliding")
    assert chosen_engine("static_cache", gemma) == ("static_cache", None)  # sliding windows served
    gemma.config.layer_types = ["sliding_attention", "chunked_attention", "full_attention"]
    assert "layer kinds ['chunked_attention']" in chosen_engine("static_cache", gemma)[1]
    unstated = _model()
    unstated.config.sliding_window, unstated.config.use_sliding_window = 4, False
    assert "which layers slide" in chosen_engine("static_cache", unstated)[1]
    llama = _model()
    assert chosen_engine("auto", llama) == ("static", None)  # on a CPU auto is static
    assert chosen_engine("static_cache", llama) == ("static_cache", None)
    eager = _model()
    eager.set_attn_implementation("eager")  # served with additive masks (Gemma-2's only attention)
    assert chosen_engine("static_cache", eager) == ("static_cache", None)
    gated = _model()
    sparse.make_sparse(gated, 0.0)
    assert "attention implementation 'attnlab'" in chosen_engine("static_cache", gated)[1]
    with intervened(llama, arm=ArmSettings(layer=0)):
        assert "forward hooks" in chosen_engine("static_cache", llama)[1]
        with caplog.at_level(logging.WARNING):
            out = generate_all(llama, _Tokenizer(), _prompts((4, 5)), 2, 3, engine="static_cache")
    assert set(out["engine"]) == {"static"} and "cannot serve this model" in caplog.text


def _position_sensitive(arch: str):
    """A float64 tiny model whose logits move with position: GPT-2 with its learned positions
    scaled up tenfold, or Llama with its queries and keys scaled up (rotary angles then matter).

    Gemma-2 stays float32: transformers' eager Gemma-2 attention in float64 makes a left-padded
    row NaN (its softmax runs in float32, where float64's mask minimum is -inf, so a padding query
    with every key masked is NaN, and its NaN values reach the row's real queries through zero
    weights); generate() then emits token 0 for that row. float32, bfloat16 and float16, the
    dtypes a job runs, give no NaN (checked while fixing issue 67's end rule, which had cut those
    rows to no tokens and so hidden this)."""
    model = _model("gpt2" if arch == "gpt2-positions" else arch)
    model = model.float() if arch == "gemma2-softcap" else model.double()
    with torch.no_grad():
        if arch == "gpt2-positions":
            model.transformer.wpe.weight *= 10
        elif arch != "gemma2-softcap":  # its scores are sharpened already (test_attention._sharper_scores)
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight *= 8
                layer.self_attn.k_proj.weight *= 8
    return model


@pytest.mark.parametrize("arch", ["gpt2-positions", "llama-gqa", "gemma3-sliding", "gemma2-softcap", *SLIDING])
@pytest.mark.parametrize("engine", ["static", "static_cache", "continuous"])
def test_each_decode_steps_logits_equal_a_forward_over_the_whole_sequence(engine, arch):
    """Every logit vector that chose a token (the prefill's, then each decode step's, recorded at
    the model's output) against a forward over that row's prompt and tokens so far, alone and
    without a cache: a position id off by one in a decode step moves them, and so does a sliding
    window applied one column off or not at all (≤ 1e-5 in float64; Gemma-2 in float32). Every
    row has generated tokens to compare."""
    # longest first: the engines batch the prompts in that order, so batch rows are prompt rows
    model, tokenizer, prompts = _position_sensitive(arch), _Tokenizer(), _prompts((12, 9, 7, 5))
    calls, forward = [], model.forward

    @functools.wraps(forward)  # its signature too: generate passes what the forward declares
    def recorded(*args, **kwargs):  # not a hook: the static-cache loop declines hooked models
        output = forward(*args, **kwargs)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[0] == len(prompts):
            calls.append((tuple(ids.shape), output.logits[:, -1].detach().clone()))
        return output
    model.forward = recorded
    if engine == "continuous" and arch == "gemma2-softcap":  # refused, saying why; static stands in
        with pytest.raises(Exception, match="soft-capping"):
            generate_all(model, tokenizer, prompts, len(prompts), 6, engine=engine)
        engine = "continuous_or_static"
    try:
        got = generate_all(model, tokenizer, prompts, len(prompts), 6, engine=engine)
    finally:
        del model.forward
    if engine == "continuous_or_static":
        engine = "static"
    assert set(got["engine"]) == {engine}
    assert (got["n_new_tokens"] > 0).all()
    if engine == "continuous":  # its steps run rows in and out of its batch: compare the tokens alone
        calls = None
    worst = 0.0
    for row, (ids, new) in enumerate(zip(prompts["input_ids"], got["new_token_ids"])):
        for step, token in enumerate(new):
            with torch.no_grad():
                full = model(torch.tensor([list(ids) + list(new[:step])]), use_cache=False).logits[0, -1]
            assert int(full.argmax()) == token, (row, step)
            if calls is not None:
                worst = max(worst, float((calls[step][1][row] - full).abs().max()))
    assert worst < 1e-5



# A pad id (not EOS) that each tiny model emits greedily before its end on _prompts((12, 9, 7, 5)):
# Llama's token 0 in its first row; Mistral's token 98, its third row's first five tokens.
EMITTED_PADS = {"llama-gqa": 0, "mistral": 98}


@pytest.mark.parametrize("arch", list(EMITTED_PADS))
@pytest.mark.parametrize("engine", ["static", "static_cache", "continuous"])
def test_a_generated_pad_token_is_a_token_like_any_other(engine, arch):
    """Each row's tokens are those of transformers' generate() for that prompt alone, up to its
    first EOS: a pad token the model emits does not end the row (it did, before issue 67)."""
    tokenizer = _Tokenizer()
    tokenizer.pad_token_id = pad = EMITTED_PADS[arch]
    model, prompts = _model(arch), _prompts((12, 9, 7, 5))
    got = generate_all(model, tokenizer, prompts, len(prompts), 12, engine=engine)
    assert set(got["engine"]) == {engine}
    pads_inside = 0
    for ids, new, count in zip(prompts["input_ids"], got["new_token_ids"], got["n_new_tokens"]):
        with torch.no_grad():
            out = model.generate(torch.tensor([list(ids)]), max_new_tokens=12, do_sample=False,
                                 eos_token_id=EOS, pad_token_id=pad)[0, len(ids):].tolist()
        expected = out[:out.index(EOS) + 1] if EOS in out else out
        assert list(new) == expected and count == len(expected)
        pads_inside += pad in expected[:-1]
    assert pads_inside >= 1  # the case this test is about: a pad token before the row's end


def test_without_reported_lengths_a_row_ends_after_its_first_eos():
    """An engine that reports no lengths: the padding after EOS ends a row, a pad token before it
    does not; with lengths, they decide (both as written here, by hand)."""
    from transformers import GenerationConfig

    from attnlab.reasoning.generation import _decode_rows

    config = GenerationConfig(pad_token_id=0, eos_token_id=EOS)
    rows = torch.tensor([[5, 0, 6, EOS, 0, 0], [5, 6, 8, 9, 10, 11], [EOS, 0, 0, 0, 0, 0]])
    decoded = _decode_rows(_Tokenizer(), rows, config, [])
    assert [row["new_token_ids"] for row in decoded] == [[5, 0, 6, EOS], [5, 6, 8, 9, 10, 11], [EOS]]
    assert [row["hit_token_limit"] for row in decoded] == [False, True, False]
    assert decoded[0]["response"] == "5 6"  # the pad token and EOS decode to nothing
    reported = _decode_rows(_Tokenizer(), rows, config, [], lengths=[3, 6, 1])
    assert [row["n_new_tokens"] for row in reported] == [3, 6, 1]


def test_a_row_whose_eos_is_its_last_allowed_token_did_not_hit_the_token_limit():
    """A row that fills every allowed token with EOS last ended at EOS, not at the limit (its
    answer is whole); a row that fills them with no EOS was cut by the limit. Whether the engine
    reports the lengths (continuous, static_cache) or they are found from EOS (by hand here)."""
    from transformers import GenerationConfig

    from attnlab.reasoning.generation import _decode_rows

    config = GenerationConfig(pad_token_id=0, eos_token_id=EOS)
    rows = torch.tensor([[5, 6, 8, 9, EOS], [5, 6, 8, 9, 10], [5, EOS, 0, 0, 0]])
    for lengths in (None, [5, 5, 2]):
        decoded = _decode_rows(_Tokenizer(), rows, config, [], lengths=lengths)
        assert [row["n_new_tokens"] for row in decoded] == [5, 5, 2]
        assert [row["hit_token_limit"] for row in decoded] == [False, True, False]
        assert [row["response"] for row in decoded] == ["5 6 8 9", "5 6 8 9 10", "5"]
