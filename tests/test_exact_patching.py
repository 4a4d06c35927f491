"""Exact patching by resumed passes equals an independent, hand-written computation.

The reference patches one head of one prompt at a time: each prompt runs alone (no padding),
and a forward pre-hook written here, not the library's gates, writes the reference into that
head's slice of o_proj's input. The mean ablation's reference is the template mean computed
here from each prompt's own run.
"""

import numpy as np
import pytest
import torch
from transformers import Gemma3TextConfig

from attnlab.attention import sparse
from attnlab.interventions import intervened
from attnlab.interventions.readout import Readout
from attnlab.interventions.resume import LayerInputs, ResumeAt
from attnlab.patching.heads import Patcher, TaskBatch, build_batch
from attnlab.patching.tasks import TaskPrompts
from test_attention import TINY, _tiny
from test_pruning import WordTokenizer, _out_projection

LENGTHS = [9, 7, 9, 7, 8, 8]  # templates 0, 1, 0, 1, 2, 2: equal lengths within a template
SHARED = 3  # clean and corrupted prompts agree on their first 3 tokens


def _prompts(seed=0) -> TaskPrompts:
    rng = np.random.default_rng(seed)
    clean, corrupted, templates = [], [], []
    for index, length in enumerate(LENGTHS):
        words = [f"w{x}" for x in rng.integers(0, 50, length)]
        clean.append(" ".join(words))
        corrupted.append(" ".join(words[:SHARED] + [f"w{x}" for x in rng.integers(0, 50, length - SHARED)]))
        templates.append({9: 0, 7: 1, 8: 2}[length])
    return TaskPrompts("ioi", clean, corrupted, templates, answers=[int(x) for x in rng.integers(1, 101, 6)],
                       distractors=[[int(x), int(y)] for x, y in rng.integers(1, 101, (6, 2))])


def _o_proj_input(model, ids: list[int], layer: int) -> torch.Tensor:
    seen = {}
    handle = _out_projection(model, layer).register_forward_pre_hook(
        lambda module, args: seen.__setitem__("z", args[0].detach().clone()))
    with torch.no_grad():
        model(torch.tensor([ids]))
    handle.remove()
    return seen["z"][0]


def _last_logits(model, ids: list[int], layer=None, head=None, reference=None) -> torch.Tensor:
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    handles = []
    if layer is not None:
        def patch(module, args):
            z = args[0].clone()
            z[0, :, head * head_dim:(head + 1) * head_dim] = reference[:, head * head_dim:(head + 1) * head_dim]
            return (z,)
        handles.append(_out_projection(model, layer).register_forward_pre_hook(patch))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    for handle in handles:
        handle.remove()
    return logits


def _by_hand(model, prompts: TaskPrompts, ablation: str) -> torch.Tensor:
    """metric(clean) − metric(head ablated), averaged over prompts, one prompt and head at a time."""
    tokenizer = WordTokenizer()  # ids by first sight: the same order as build_batch's
    clean = [tokenizer(p).input_ids for p in prompts.clean]
    corrupted = [tokenizer(p).input_ids for p in prompts.corrupted]
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    seen = {}

    def o_proj_input(ids, layer):  # each prompt's run once per layer
        key = (tuple(ids), layer)
        if key not in seen:
            seen[key] = _o_proj_input(model, ids, layer)
        return seen[key]

    def metric(logits, i):
        return float(logits[prompts.answers[i]] - logits[prompts.distractors[i]].max())

    def reference(i, layer):
        if ablation == "corrupted":
            return o_proj_input(corrupted[i], layer)
        if ablation == "zero":
            return torch.zeros_like(o_proj_input(clean[i], layer))
        same = [j for j, t in enumerate(prompts.templates) if t == prompts.templates[i]]
        return sum(o_proj_input(clean[j], layer) for j in same) / len(same)

    scores = torch.zeros(layers, heads, dtype=torch.float64)
    for i, ids in enumerate(clean):
        full = metric(_last_logits(model, ids), i)
        for layer in range(layers):
            r = reference(i, layer)
            for head in range(heads):
                scores[layer, head] += full - metric(_last_logits(model, ids, layer, head, r), i)
    return scores / len(clean)


def _model(arch: str, sparse_copy: bool):
    model = TINY[arch]()
    if sparse_copy:
        sparse.make_sparse(model, 0.0)  # about half the edges gated shut (0.5 shuts none here)
    return model


ARCHES = [("llama-gqa", False), ("qwen2", False), ("gemma3-sliding", False), ("llama-gqa", True), ("gpt2", False),
          ("olmo", False), ("olmo2", False), ("gpt2", True), ("qwen3", False), ("mistral-sliding", False),
          ("phi3", False), ("gemma2-softcap", False), ("gemma2-softcap", True), ("gpt_neox", False), ("gpt_neox", True)]


def _patching_cases():
    """Every family under every ablation; the fast suite (make test-fast) takes every family under
    corrupted patching and the mean and zero ablations on Llama (195 s all together, 40 s these)."""
    for ablation in ("corrupted", "mean", "zero"):
        for arch, sparse_copy in ARCHES:
            fast = ablation == "corrupted" or (arch, sparse_copy) == ("llama-gqa", False)
            yield pytest.param(arch, sparse_copy, ablation, id=f"{ablation}-{arch}-{sparse_copy}",
                               marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize("arch,sparse_copy,ablation", list(_patching_cases()))
def test_exact_patching_equals_one_head_of_one_prompt_at_a_time(arch, sparse_copy, ablation):
    """Gemma-3 (sliding window 5 on layers 0 and 2, shorter than the prompts; sandwich and q/k
    norms) beside Llama (GQA), Qwen2 (q/k/v biases), GPT-2 (c_proj, learned positions), OLMo,
    OLMo-2 (post-norms) and sparse copies."""
    model = _model(arch, sparse_copy)
    prompts = _prompts()
    patcher = Patcher(model, build_batch(prompts, WordTokenizer()), ablation, batch_size=4)
    fast = patcher.exact()
    hand = _by_hand(model, prompts, ablation)
    assert hand.abs().max() > 1e-2  # heads matter on this model: the comparison can fail
    # float32 (a float64 Gemma-2 turns padded rows NaN): scores are differences of metrics of logits
    # ≲ 2 after 3 layers in other orders, seen to 2.5e-7 (2 ulp at 1-2); 5e-6 is 40 ulp, 20x that
    np.testing.assert_allclose(fast.numpy(), hand.numpy(), atol=5e-6, rtol=0)
    np.testing.assert_allclose(patcher.exact_one_forward_per_head().numpy(), fast.numpy(), atol=5e-6, rtol=0)


def test_gemma3_sliding_window_exact_patching_equals_one_forward_per_head():
    """A sliding window longer than the prompts (the prefix is cached) and one shorter (it is not)."""
    for window in (16, 5):
        model = _tiny(Gemma3TextConfig, sliding_window=window,
                      layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        patcher = Patcher(model, build_batch(_prompts(), WordTokenizer()), "corrupted", batch_size=4)
        np.testing.assert_allclose(patcher.exact().numpy(), patcher.exact_one_forward_per_head().numpy(),
                                   atol=1e-6, rtol=0)


def test_the_mean_reference_is_the_template_mean_of_each_prompts_own_run():
    """The mean ablation's reference, per template and position, against means taken by hand."""
    model = TINY["qwen2"]()
    prompts = _prompts()
    tokenizer = WordTokenizer()  # ids by first sight: the batch's own tokenizer
    patcher = Patcher(model, build_batch(prompts, tokenizer), "mean", batch_size=4)
    width = max(LENGTHS)
    for layer in range(3):
        got = torch.cat([chunk[layer] for chunk in patcher.references])  # [prompts, width, d], left padded
        for i, template in enumerate(prompts.templates):
            same = [j for j, t in enumerate(prompts.templates) if t == template]
            want = sum(_o_proj_input(model, tokenizer(prompts.clean[j]).input_ids, layer) for j in same) / len(same)
            np.testing.assert_allclose(got[i, width - LENGTHS[i]:].numpy(), want.numpy(), atol=1e-5)


def test_resumed_passes_recompute_nothing_below_their_layer():
    """Layer 0's attention runs once per chunk (the recording pass): every resumed pass starts
    above it; in every pass of exact patching the last layer's MLP sees only the positions the
    metric reads."""
    model = TINY["llama-gqa"]()
    patcher = Patcher(model, build_batch(_prompts(), WordTokenizer()), "zero", batch_size=4)
    calls, widths = [], []
    first = model.model.layers[0].self_attn.register_forward_pre_hook(lambda m, a, k: calls.append(1),
                                                                      with_kwargs=True)
    last = model.model.layers[-1].mlp.register_forward_pre_hook(lambda m, a: widths.append(a[0].shape[1]))
    patcher.exact()
    first.remove()
    last.remove()
    assert len(calls) == len(patcher._chunks())
    assert widths and set(widths) == {1}  # IOI reads the last position: the last MLP runs there alone


def test_digit_greater_than_rows_read_two_positions():
    """Ten rows per prompt and a metric on the last two positions and the whole vocabulary (the
    digit-tokenizer Greater-Than shape): resumed passes keep both positions and every logit."""
    model = TINY["llama-gqa"]().double()  # float32: 7e-10 apart (1-2 ulp of the metric), here 0
    rng = np.random.default_rng(1)
    clean = torch.from_numpy(rng.integers(3, 101, (20, 8)))
    corrupted = clean.clone()
    corrupted[:, 4:6] = torch.from_numpy(rng.integers(3, 101, (20, 2)))
    digits = torch.arange(10, 20)

    def metric(logits, prompts):
        n = logits.shape[0] // 10
        first = logits[::10, -2].softmax(-1)[:, digits]
        second = logits[:, -1].softmax(-1)[:, digits].view(n, 10, 10)
        return (first[:, :, None] * second).reshape(n, 100)[:, 50:].sum(-1)
    batch = TaskBatch(clean, corrupted, torch.ones_like(clean), [0, 1], metric, rows_per_prompt=10,
                      read_positions=2)
    patcher = Patcher(model, batch, "corrupted", batch_size=10)
    fast, slow = patcher.exact().numpy(), patcher.exact_one_forward_per_head().numpy()
    # the scores are small (a probability sum near 0.005 on this model, heads moving it by ~1e-5):
    # an absolute tolerance would pass scores off by percents, or all 0; each score to 0.1% of
    # itself (float64 rounding, the scores' own to float32 ~4e-12), and heads that matter
    scale = float(np.abs(slow).max())
    assert scale > 1e-5 and (np.abs(slow) > 1e-6).sum() >= 6
    np.testing.assert_allclose(fast, slow, rtol=1e-3, atol=1e-4 * scale)


def test_resuming_leaves_the_model_as_it_was():
    model = TINY["llama-gqa"]()
    ids = torch.randint(3, 101, (2, 6), generator=torch.Generator().manual_seed(0))
    layers = list(model.model.layers)
    attention, mlp, head = layers[1].self_attn, layers[-1].mlp, model.get_output_embeddings()
    recorded = LayerInputs()
    with torch.no_grad():
        with intervened(model, record=recorded):
            plain = model(ids, use_cache=False).logits
        resume = ResumeAt(1, recorded.hidden[1], recorded.attention[1])
        with intervened(model, resume=resume, readout=Readout(1, torch.tensor([4, 7]), fast=True)):
            resumed = model(ids, use_cache=False, logits_to_keep=1).logits
    assert list(model.model.layers) == layers and model.model.layers[1].self_attn is attention
    assert model.model.layers[-1].mlp is mlp and model.get_output_embeddings() is head
    np.testing.assert_allclose(resumed[:, -1, [4, 7]].numpy(), plain[:, -1, [4, 7]].numpy(), atol=1e-5)
    assert torch.isinf(resumed[:, -1, 5]).all()  # a logit nobody reads is not computed
    with torch.no_grad():
        assert torch.equal(model(ids, use_cache=False).logits, plain)


def test_a_resumed_pass_never_holds_more_rows_than_the_batch_size():
    """The batch size (halved on an out-of-memory retry) bounds every forward of exact patching."""
    model = TINY["llama-gqa"]()
    rows = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, a, out: rows.append(out.shape[0]))
    for batch_size in (2, 4, 12):
        rows.clear()
        patcher = Patcher(model, build_batch(_prompts(), WordTokenizer()), "corrupted", batch_size=batch_size)
        patcher.exact()
        assert max(rows) <= batch_size and max(rows) >= min(batch_size, 6)
    hook.remove()
