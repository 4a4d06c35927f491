"""The fused attention kernels (attnlab.attention.kernels, Triton) against the eager computation.

In Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by conftest.py before anything
imports them), float32, tiny sizes: values to 1e-5, gradients against autograd of the eager formula
and a finite difference, the same densities, received attention and λ, with left padding, an
inserted span, sliding windows and grouped-query heads; every model-level test counts the kernel
launches, so none passes by falling back to the eager path."""

import math

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from attnlab import interventions  # noqa: E402
from attnlab.attention import fused, sparse  # noqa: E402
from attnlab.attention.kernels import launch  # noqa: E402
from attnlab.attention.kernels.layout import MaskLayout, allowed_by, layout_of  # noqa: E402
from attnlab.attention.kernels.reference import training_gate_with_kernel_noise  # noqa: E402
from attnlab.extraction.extract import extract  # noqa: E402
from attnlab.interventions import intervened  # noqa: E402
from test_attention import TINY, _prompts  # noqa: E402

SCALE, BIAS = 0.25, 0.3


def _inputs(batch=2, heads=4, kv_heads=2, length=29, head_dim=16, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, head_dim, generator=generator, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, length, head_dim, generator=generator, dtype=dtype) for _ in "kv")
    return [x.requires_grad_() for x in (q, k, v)]


def _eager(q, k, v, allowed, gate: launch.Gate, noise=None):
    """The eager formula (docs/sparsify.md): output [B, M, H, D], expected rows, gated weights."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    logits = q @ k.transpose(-1, -2) * SCALE
    p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    expected = torch.sigmoid(logits + gate.bias)
    if gate.kind == launch.DENSE:
        g = torch.ones_like(logits)
    elif gate.kind == launch.DETERMINISTIC:
        g = (logits + gate.bias > 0).to(logits.dtype)
    else:
        surrogate = torch.sigmoid(logits + gate.bias + noise) if gate.noisy_gradient else expected
        g = (logits + gate.bias + noise > 0).to(logits.dtype) + surrogate - surrogate.detach()
    weights = p * g
    penalty = (expected * allowed).sum(-1) if gate.kind == launch.SAMPLED else torch.zeros(p.shape[:-1])
    return (weights @ v).transpose(1, 2), penalty, weights


def _padded_layout(batch, length, window=None, pads=(5,)):
    pads = torch.tensor(tuple(pads) + (0,) * (batch - len(pads)))  # left padding of pads[i] keys in row i
    key_real = torch.arange(length)[None, :] >= pads[:, None]
    return MaskLayout(key_real, 0, window)


GATES = {
    "dense": launch.Gate(),
    "deterministic": launch.Gate(launch.DETERMINISTIC, BIAS),
    "sampled": launch.Gate(launch.SAMPLED, BIAS, seed=99),
    "sampled-noisy": launch.Gate(launch.SAMPLED, BIAS, seed=99, noisy_gradient=True),
}


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("gate_name", list(GATES))
def test_kernels_equal_the_eager_formula_values_gradients_and_statistics(gate_name, window):
    _compare_with_eager(gate_name, window)


def _compare_with_eager(gate_name: str, window: int | None, pads=(5,), gate=None, inputs=None, **shape):
    gate = gate or GATES[gate_name]
    q, k, v = inputs or _inputs(**shape)
    batch, heads, length = q.shape[:3]
    layout = _padded_layout(batch, length, window, pads)
    allowed = allowed_by(layout, batch, length, length, "cpu")
    noise = launch.sampled_noise(gate.seed, batch, heads, length, length, "cpu")
    inserted = torch.zeros(batch, length, dtype=torch.bool)
    inserted[:, 8:14] = True
    out, expected, lse, stats = launch.attention(q, k, v, layout, gate, SCALE, inserted)
    want, want_expected, weights = _eager(q, k, v, allowed, gate, noise)
    real = layout.key_real  # padding rows attend to nothing: their output is not compared
    assert (out - want)[real].abs().max() < 1e-5
    rows = dict(zip(launch.ROW_STATS, stats))
    w = weights.detach()
    torch.testing.assert_close(rows["gated_mass"][real[:, None].expand_as(lse)],
                               w.sum(-1)[real[:, None].expand_as(lse)], atol=1e-5, rtol=0)
    torch.testing.assert_close(rows["inserted_mass"], (w * inserted[:, None, None]).sum(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(rows["allowed"], allowed.sum(-1).float().expand_as(lse), atol=0, rtol=0)
    if gate.kind != launch.DENSE:
        hard = _hard(q, k, gate, noise) * allowed
        assert torch.equal(rows["opened"], hard.sum(-1))
        assert 0 < hard.sum() < allowed.expand_as(hard).sum()  # the test sees closed and open edges
    # N sigmoids summed in float32 in other orders: ~log2(N) eps32 ≈ 1e-6 relative (seen 1.9e-6 at N=18)
    torch.testing.assert_close(expected, want_expected, atol=1e-5, rtol=1e-5)
    if gate.kind != launch.SAMPLED:  # received attention: under inference gates only
        columns = launch.received_columns(q.detach(), k.detach(), lse, layout, gate, SCALE)
        later = torch.ones(length, length).tril(-1).bool()
        want_columns = (w * later * real[:, None, :, None]).sum(-2)
        torch.testing.assert_close(columns, want_columns, atol=1e-5, rtol=0)  # padding keys receive 0
    else:
        with pytest.raises(ValueError, match="not sampled ones"):
            launch.received_columns(q.detach(), k.detach(), lse, layout, gate, SCALE)
    _assert_same_gradients(q, k, v, out, expected, want, want_expected, real)


def _hard(q, k, gate, noise):
    groups = q.shape[1] // k.shape[1]
    logits = q.detach() @ k.detach().repeat_interleave(groups, 1).transpose(-1, -2) * SCALE
    if gate.kind == launch.SAMPLED:
        logits = logits + noise
    return (logits + gate.bias > 0).float()


def _assert_same_gradients(q, k, v, out, expected, want, want_expected, real):
    generator = torch.Generator().manual_seed(5)
    d_out = torch.randn(out.shape, generator=generator) * real[:, :, None, None]
    d_expected = torch.randn(expected.shape, generator=generator)
    got = torch.autograd.grad((out * d_out).sum() + (expected * d_expected).sum(), (q, k, v))
    reference = torch.autograd.grad((want * d_out).sum() + (want_expected * d_expected).sum(), (q, k, v))
    # float32 sums over N keys in other orders: seen 1.3e-6 at 3 (5 ulp); 1e-5 of their scale: 25x that
    for name, a, b in zip("qkv", got, reference):
        assert (a - b).abs().max() < 1e-5 * max(1.0, float(b.abs().max())), name


@pytest.mark.parametrize("gate_name", ["dense", "deterministic"])
def test_kernel_gradients_pass_a_finite_difference_check(gate_name):
    """Central differences along random directions: the backward kernels' gradient is the
    derivative of the forward kernel's output (hard gates are locally constant). The kernels
    accumulate in float32 whatever the inputs, so the step is 1e-4 and the tolerance 1e-5; a
    wrong term of the gradient is off by far more."""
    gate = GATES[gate_name]
    q, k, v = _inputs(batch=1, heads=2, kv_heads=1, length=19, seed=3, dtype=torch.float64)
    layout = MaskLayout(None, 0, None)
    weights = torch.randn(1, 19, 2, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def loss(*inputs):
        return (launch.attention(*inputs, layout, gate, SCALE)[0] * weights).sum()

    gradients = torch.autograd.grad(loss(q, k, v), (q, k, v))
    generator = torch.Generator().manual_seed(6)
    for _ in range(3):
        directions = [torch.randn(x.shape, generator=generator, dtype=torch.float64) for x in (q, k, v)]
        step = 1e-4
        with torch.no_grad():
            plus, minus = (loss(*(x + sign * step * d for x, d in zip((q, k, v), directions))) for sign in (1, -1))
        numeric = (plus - minus) / (2 * step)
        analytic = sum((g * d).sum() for g, d in zip(gradients, directions))
        assert math.isclose(numeric, analytic, rel_tol=1e-5, abs_tol=1e-6), (numeric, analytic)


def test_expected_density_gradient_passes_a_finite_difference_check():
    q, k, v = _inputs(batch=1, heads=2, kv_heads=1, length=19, seed=3, dtype=torch.float64)
    layout, gate = MaskLayout(None, 0, None), GATES["sampled"]

    def penalty(query):
        return launch.attention(query, k, v, layout, gate, SCALE)[1].sum()

    (gradient,) = torch.autograd.grad(penalty(q), (q,))
    direction = torch.randn(q.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    with torch.no_grad():  # the rows come back in float32: a wider step, σ is smooth
        numeric = (penalty(q + 1e-2 * direction).double() - penalty(q - 1e-2 * direction).double()) / 2e-2
    assert math.isclose(numeric, (gradient * direction).sum(), rel_tol=1e-3)


def test_sampled_gates_are_bernoulli_of_the_gate_probability():
    noise = launch.sampled_noise(7, 2, 3, 40, 40, "cpu")
    assert torch.equal(noise, launch.sampled_noise(7, 2, 3, 40, 40, "cpu"))  # counters, not state
    assert not torch.equal(noise, launch.sampled_noise(8, 2, 3, 40, 40, "cpu"))
    for logit in (-1.0, 0.0, 2.0):  # P(logit + L > 0) = σ(logit) for logistic L
        assert abs(float((logit + noise > 0).float().mean()) - 1 / (1 + math.exp(-logit))) < 0.01


# ---------------------------------------------------------------- the mask's structure


def _eager_mask(model, ids, attention_mask):
    """The 4D mask transformers builds for the attnlab implementation, per attention kind."""
    masks = {}

    def spy(module, query, key, value, mask, **kwargs):
        masks[module.layer_idx] = (mask, kwargs.get("sliding_window"))
        return original(module, query, key, value, mask, **kwargs)

    original = interventions.attend
    from transformers import AttentionInterface

    AttentionInterface.register("spy", spy)
    model.set_attn_implementation("spy")
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionMaskInterface.register("spy", eager_mask)
    sparse.make_sparse(model, 1e4)
    model.set_attn_implementation("spy")
    with torch.no_grad():
        model(ids, attention_mask=attention_mask)
    return masks


def test_layouts_rebuild_the_models_own_masks_and_refuse_others():
    model = TINY["gemma3-sliding"]()
    ids = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(1))
    padding = torch.ones_like(ids)
    padding[1, :4] = 0
    for layer, (mask, window) in _eager_mask(model, ids, padding).items():
        layout = layout_of(mask, 12, 12, window)
        assert layout is not None and layout.window == window
        assert torch.equal(allowed_by(layout, 2, 12, 12, "cpu"), mask == 0), layer
        assert torch.equal(layout.key_real, padding.bool())
    causal = torch.zeros(1, 1, 6, 6).masked_fill(~torch.ones(6, 6).tril().bool(), torch.finfo(torch.float32).min)
    assert layout_of(causal, 6, 6, None).key_real.all()
    assert layout_of(causal, 6, 6, 3) is None  # a window the mask does not have
    assert layout_of(torch.zeros(1, 1, 6, 6), 6, 6, None) is None  # bidirectional
    assert layout_of(causal + 0.5 * torch.randn(6, 6), 6, 6, None) is None  # an additive bias
    chunked = causal.clone()
    chunked[..., 4:, :2] = torch.finfo(torch.float32).min  # chunked attention: keys 0-1 dropped for 4-5
    assert layout_of(chunked, 6, 6, None) is None


# ---------------------------------------------------------------- through the models


@pytest.fixture()
def kernel_calls(monkeypatch):
    """Counts the kernels' launches, with the fused path switched on for CPU tensors."""
    monkeypatch.setenv(fused.MODE_VARIABLE, "on")
    calls = []
    original = launch.attention

    def counted(*args, **kwargs):
        calls.append(args[4].kind)
        return original(*args, **kwargs)

    monkeypatch.setattr(launch, "attention", counted)
    return calls


def _both_paths(monkeypatch, run):
    monkeypatch.setenv(fused.MODE_VARIABLE, "off")
    eager = run()
    monkeypatch.setenv(fused.MODE_VARIABLE, "on")
    return eager, run()


FUSED = [arch for arch in TINY if arch != "gemma2-softcap"]  # soft-capping: test_kernel_refusals.py


@pytest.mark.parametrize("arch", FUSED)
@pytest.mark.parametrize("gated", [False, True], ids=["dense", "sparse"])
def test_extraction_through_the_kernels_equals_the_eager_blocks(arch, gated, kernel_calls, monkeypatch):
    model = TINY[arch]()
    if gated:
        sparse.make_sparse(model, 0.1)
    prompts = _prompts([12, 8, 15], inserted=(2, 6), vocab=101)  # padding and an inserted span
    eager, kernels = _both_paths(monkeypatch, lambda: extract(model, prompts, 2, []))
    layers = model.config.num_hidden_layers
    assert kernel_calls == [launch.DETERMINISTIC if gated else launch.DENSE] * (2 * layers)
    for layer in range(layers):
        for name in ("received", "lam"):
            a, b = getattr(eager, name)[layer], getattr(kernels, name)[layer]
            assert np.array_equal(np.isnan(a), np.isnan(b))
            np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    if gated:  # gated rows lose mass: λ below 1 somewhere, so the test sees the gates
        assert min(np.nanmin(kernels.lam[layer]) for layer in range(layers)) < 0.9


def test_a_kept_map_layer_stays_eager_and_the_others_fuse(kernel_calls, monkeypatch):
    model = TINY["llama-gqa"]()
    prompts = _prompts([12, 8], inserted=(2, 6), vocab=101)
    eager, kernels = _both_paths(monkeypatch, lambda: extract(model, prompts, 2, [1]))
    assert len(kernel_calls) == 2  # layers 0 and 2
    np.testing.assert_array_equal(eager.maps[1], kernels.maps[1])
    for layer in range(3):
        np.testing.assert_allclose(kernels.received[layer], eager.received[layer], atol=1e-5)


@pytest.mark.parametrize("arch", ["llama-gqa", "gemma3-sliding", "gpt2", "olmo2"])
def test_sparse_inference_logits_and_open_edges_equal_the_eager_gates(arch, kernel_calls, monkeypatch):
    model = TINY[arch]()
    sparse.make_sparse(model, 0.0)
    ids = torch.randint(3, 101, (2, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0

    def run():
        tracker = sparse.GateTracker()
        with intervened(model, gates=tracker), torch.no_grad():
            logits = model(ids, attention_mask=mask).logits
        return logits, tracker

    (eager, eager_tracker), (kernels, kernel_tracker) = _both_paths(monkeypatch, run)
    assert len(kernel_calls) == model.config.num_hidden_layers
    assert (eager - kernels)[mask.bool()].abs().max() < 1e-5
    for layer, density in eager_tracker.density_per_head().items():
        assert torch.equal(density, kernel_tracker.density_per_head()[layer])
    assert 0.05 < eager_tracker.inference_density() < 0.95


def test_generation_of_a_sparse_copy_with_a_kv_cache_equals_the_eager_gates(kernel_calls, monkeypatch):
    model = TINY["llama-gqa"]()
    sparse.make_sparse(model, 0.0)
    ids = torch.randint(3, 101, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0

    def run():
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)

    eager, kernels = _both_paths(monkeypatch, run)
    assert len(kernel_calls) == 3 * 4  # prefill and three cached steps, per layer
    assert torch.equal(eager, kernels)


@pytest.mark.parametrize("arch,gradient,checkpointing", [("llama-gqa", "expected", False),
                                                      ("llama-gqa", "noisy", True), ("gpt2", "expected", False)])
def test_a_training_step_through_the_kernels_equals_the_eager_step(arch, gradient, checkpointing, kernel_calls,
                                                                   monkeypatch):
    """Loss, penalty, training density and every weight's gradient, the eager blocks drawing the
    kernels' noise; with checkpointing, the replayed layers draw the same gates."""
    monkeypatch.setattr(sparse, "training_gate", training_gate_with_kernel_noise)
    ids = torch.randint(3, 101, (2, 21), generator=torch.Generator().manual_seed(4))

    def step():
        model = TINY[arch]().train()
        for module in model.modules():  # GPT-2's dropout of 0.1 off, as the trainer's config does
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        sparse.make_sparse(model, 0.5)
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False,
                                                   "context_fn": interventions.recompute_context})
        tracker = sparse.GateTracker(training=True, generator=torch.Generator().manual_seed(3),
                                     gradient=gradient)
        with intervened(model, gates=tracker):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss + tracker.expected_density()
            loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), tracker.training_density(), grads

    (eager_loss, eager_density, eager_grads), (loss, density, grads) = _both_paths(monkeypatch, step)
    assert len(kernel_calls) == 3 * (2 if checkpointing else 1)  # replayed layers run them again
    assert abs(loss - eager_loss) < 1e-5 and density == eager_density
    assert 0.2 < density < 0.95
    assert eager_grads.keys() == grads.keys()
    for name in grads:
        assert (grads[name] - eager_grads[name]).abs().max() < 1e-5, name


def test_the_mode_switch_is_checked_and_off_keeps_the_eager_blocks(kernel_calls, monkeypatch):
    model = TINY["llama-gqa"]()
    monkeypatch.setenv(fused.MODE_VARIABLE, "off")
    extract(model, _prompts([9, 7], inserted=(2, 4), vocab=101), 2, [])
    assert kernel_calls == []
    monkeypatch.setenv(fused.MODE_VARIABLE, "fast")
    with pytest.raises(ValueError, match="ATTNLAB_FUSED_ATTENTION='fast': expected one of"):
        fused.enabled(torch.device("cpu"))
    monkeypatch.setenv(fused.MODE_VARIABLE, "auto")
    assert not fused.enabled(torch.device("cpu"))  # auto: CUDA tensors only


@triton.jit
def _uniforms_at(OUT, COUNTERS, seed, COUNT: tl.constexpr):
    """Triton's four Philox uniforms at given counters, [COUNT, 4]: the noise's reference."""
    offs = tl.arange(0, COUNT)
    numbers = tl.randint4x(seed, tl.load(COUNTERS + offs))
    for k in tl.static_range(4):
        tl.store(OUT + offs * 4 + k, tl.random.uint_to_uniform_float(numbers[k]))


NUMBER_OF_COLUMN = {0: 0, 1: 2, 2: 1, 3: 3}  # the number of the four column j takes, by j mod 4: written out


def test_the_gate_noise_is_its_counter_formula_and_every_edge_draws_its_own():
    """Edge (i, j) of head bh draws Philox at counter (bh · M + i) · ⌈N/4⌉ + ⌊j/4⌋, number
    ``NUMBER_OF_COLUMN[j mod 4]`` of the four: checked at known edges of every residue against
    Triton's generator at counters computed here (M ≠ N, so swapped axes would differ; N = 11 is
    not a multiple of 4), and with fewer queries than keys (a decoding step's shape) no two edges
    share a draw."""
    seed, batch, heads, queries, keys = 7, 2, 3, 5, 11
    noise = launch.sampled_noise(seed, batch, heads, queries, keys, "cpu")
    edges = [(0, 0, 0), (1, 2, 7), (4, 4, 10), (5, 3, 1), (2, 1, 5), (3, 0, 6), (5, 4, 8), (0, 3, 9)]  # (b · H + h, i, j)
    assert {j % 4 for _, _, j in edges} == {0, 1, 2, 3}
    quads = (keys + 3) // 4
    counters = torch.tensor([(bh * queries + i) * quads + j // 4 for bh, i, j in edges], dtype=torch.int64)
    uniforms = torch.empty(len(edges), 4, dtype=torch.float32)
    _uniforms_at[(1,)](uniforms, counters, seed, COUNT=len(edges))
    uniform = torch.stack([uniforms[n, NUMBER_OF_COLUMN[j % 4]] for n, (_, _, j) in enumerate(edges)])
    expected = torch.log(uniform) - torch.log1p(-uniform)
    got = torch.stack([noise.view(batch * heads, queries, keys)[bh, i, j] for bh, i, j in edges])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.unique(noise).numel() == noise.numel()
