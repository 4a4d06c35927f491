"""The shared prefix's cache (attnlab.reasoning.shared_prefix) against the padded batch's own prefill."""

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig

from attnlab.models import left_pad
from attnlab.reasoning.shared_prefix import prefilled_cache, prefix_unshared, shared_prefix_length
from test_attention import _tiny  # random norm weights: a misplaced norm would show


def _gemma3(window: int):
    return _tiny(Gemma3TextConfig, sliding_window=window,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def _rows(prefix: int, suffixes=(9, 3, 14, 1), seed: int = 0) -> list[list[int]]:
    """Rows that share ``prefix`` tokens and then differ, of unequal lengths (left padding)."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 101, (prefix,), generator=generator).tolist()
    rows = [shared + torch.randint(3, 101, (n,), generator=generator).tolist() for n in suffixes]
    for row in rows[1:]:
        row[prefix] = rows[0][prefix] % 100 + 1  # row 0 leaves the prefix at a token the others do not
    return rows


def _prefilled_logits(model, rows):
    """The logits of every column of the left-padded batch: (without a cache, with the shared prefix's)."""
    ids, mask, positions = left_pad(rows)
    with torch.inference_mode():
        whole = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        cache, shared = prefilled_cache(model, rows)
        assert shared == shared_prefix_length(rows) and cache is not None
        rest = model(input_ids=ids[:, shared:], attention_mask=mask, position_ids=positions[:, shared:],
                     past_key_values=cache, use_cache=True).logits
    return whole[:, shared:], rest, mask[:, shared:].bool()


@pytest.mark.parametrize("make", [lambda: _tiny(LlamaConfig), lambda: _gemma3(64)], ids=["llama-gqa", "gemma3"])
def test_the_shared_prefix_cache_is_the_padded_batch_own(make):
    """Every real column after the prefix reads the same logits as the batch's one prefill: the
    prefix laid in after each row's padding, at its own positions (a row padded by more than the
    prefix included)."""
    model = make()
    rows = _rows(prefix=12, suffixes=(9, 3, 14, 1))
    assert shared_prefix_length(rows) == 12 and max(map(len, rows)) - len(rows[3]) > 12
    whole, rest, real = _prefilled_logits(model, rows)
    torch.testing.assert_close(rest[real], whole[real], atol=2e-5, rtol=0)


def test_greedy_decoding_on_the_shared_prefix_gives_the_same_tokens():
    model = _gemma3(64)
    rows = _rows(prefix=12, suffixes=(5, 2, 8))
    ids, mask, _ = left_pad(rows)
    with torch.inference_mode():
        plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                               pad_token_id=0)
        cache, shared = prefilled_cache(model, rows)
        cached = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                pad_token_id=0, past_key_values=cache)
    assert shared == 12
    assert torch.equal(cached, plain)


def test_a_sliding_window_shorter_than_the_prefix_prefills_row_by_row():
    rows = _rows(prefix=12)
    assert prefilled_cache(_gemma3(8), rows) == (None, 0)
    assert prefilled_cache(_gemma3(13), rows)[1] == 12  # keeps window - 1 tokens: 12 fit in 13


def test_the_prefix_is_not_shared_where_it_could_change_what_runs():
    model = _tiny(LlamaConfig)
    rows = _rows(prefix=6)
    assert prefix_unshared(model, rows) is None
    assert prefix_unshared(model, rows[:1]) == "one row"
    assert prefix_unshared(model, [[1, 2, 3], [4, 5]]) == "no shared prefix"
    assert shared_prefix_length([[7, 8, 9], [7, 8, 9]]) == 2  # each row keeps a token to run
    handle = model.model.layers[1].self_attn.register_forward_hook(lambda *args: None)
    assert prefix_unshared(model, rows).startswith("forward hooks on model.layers.1.self_attn")
    handle.remove()
