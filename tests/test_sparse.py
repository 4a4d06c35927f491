"""Edge-gated attention and its losses (arXiv 2512.05865, docs/sparsify.md): the gates, their
gradients, the density penalty, the constraint's multiplier, chunked losses, generation and
checkpointing through the gates."""

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from attnlab import interventions, sparsify
from attnlab.attention import sparse
from attnlab.interventions import intervened
from attnlab.sparsify.settings import Multiplier
from test_attention import TINY, _inside


def _fake_module(bias: float, heads: int = 2, groups: int = 1):
    config = SimpleNamespace(**{sparse.CONFIG_KEY: {"gate_bias": bias}})
    return SimpleNamespace(config=config, head_dim=8, num_key_value_groups=groups, layer_idx=0)


def _causal_mask(length: int) -> torch.Tensor:
    allowed = torch.ones(length, length).tril().bool()
    return torch.zeros(1, 1, length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("name", list(TINY))
def test_fully_open_gates_equal_eager_attention(name):
    """A gate bias so large that every edge is open gives eager attention exactly."""
    model = TINY[name]()
    ids = torch.randint(3, 101, (2, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = model(ids, attention_mask=mask).logits
        sparse.make_sparse(model, 1e4)
        gated = model(ids, attention_mask=mask).logits
        tracker = sparse.GateTracker()
        with intervened(model, gates=tracker):
            model(ids, attention_mask=mask)
    assert model.config._attn_implementation == interventions.IMPLEMENTATION
    assert (gated - eager)[mask.bool()].abs().max() < 1e-5
    assert all(torch.all(d == 1) for d in tracker.density_per_head().values())


def test_deterministic_gate_closes_exactly_the_edges_with_nonpositive_gate_logits():
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 2, 9, 8, generator=generator) for _ in range(3))
    bias = 0.3
    module = _fake_module(bias)
    tracker = sparse.GateTracker()
    with _inside(gates=tracker):
        out, weights = interventions.attend(module, query, key, value, _causal_mask(9), scaling=8 ** -0.5)
    logits = query @ key.transpose(2, 3) * 8 ** -0.5
    causal = torch.ones(9, 9).tril().bool()
    hand_mask = causal & (logits + bias > 0)  # built by hand: open iff causal and s + b > 0
    softmax = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    expected = softmax * hand_mask  # not renormalised
    assert torch.allclose(weights, expected, atol=1e-6)
    assert torch.allclose(out, (expected @ value).transpose(1, 2), atol=1e-6)
    assert 0 < hand_mask.sum() < causal.sum() * 2  # the test exercises closed and open edges
    density = tracker.density_per_head()[0]
    assert torch.allclose(density, (hand_mask.sum((-1, -2)) / causal.sum()).double()[0])


def test_straight_through_gradient_is_the_expected_density_gradient():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 6, 6, generator=generator, requires_grad=True)
    gate, expected = sparse.stochastic_gate(logits, 0.5, torch.Generator().manual_seed(1))
    assert set(gate.detach().unique().tolist()) <= {0.0, 1.0}  # hard samples in the forward pass
    weights = torch.randn(logits.shape, generator=generator)
    (gate * weights).sum().backward()
    straight_through = logits.grad.clone()
    logits.grad = None
    (torch.sigmoid(logits + 0.5) * weights).sum().backward()
    assert torch.allclose(straight_through, logits.grad)
    # Samples are Bernoulli(σ(s + b)): their mean over many draws approaches σ.
    draws = torch.stack([sparse.stochastic_gate(logits.detach(), 0.5, torch.Generator().manual_seed(s))[0]
                         for s in range(400)]).mean(0)
    assert (draws - expected.detach()).abs().mean() < 0.03


def test_noisy_straight_through_gradient_is_that_of_the_sampled_logit():
    """gate_gradient: noisy differentiates σ(s + b + L) with the very noise L of the sample."""
    logits = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    gate, _ = sparse.stochastic_gate(logits, 0.5, torch.Generator().manual_seed(1), "noisy")
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
    (gate * weights).sum().backward()
    uniform = torch.rand(logits.shape, generator=torch.Generator().manual_seed(1)).clamp_(1e-6, 1 - 1e-6)
    noisy = logits.detach() + 0.5 + torch.log(uniform) - torch.log1p(-uniform)
    assert torch.equal(gate.detach(), (noisy > 0).float())  # the same draw as the forward pass
    slope = torch.sigmoid(noisy) * (1 - torch.sigmoid(noisy))
    assert torch.allclose(logits.grad, slope * weights, atol=1e-6)
    with pytest.raises(ValueError, match="gate gradient must be one of"):
        sparse.stochastic_gate(logits, 0.5, None, "gumbel")


def test_training_penalty_is_the_mean_sigmoid_over_causal_edges():
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 2, 7, 8, generator=generator, requires_grad=True)
    key, value = (torch.randn(2, 2, 7, 8, generator=generator) for _ in range(2))
    tracker = sparse.GateTracker(training=True, generator=torch.Generator().manual_seed(0))
    with _inside(gates=tracker):
        interventions.attend(_fake_module(0.2), query, key, value, _causal_mask(7), scaling=8 ** -0.5)
    penalty = tracker.expected_density()
    penalty.backward()
    grad = query.grad.clone()
    query.grad = None
    causal = torch.ones(7, 7).tril().bool()
    by_hand = torch.sigmoid(query @ key.transpose(2, 3) * 8 ** -0.5 + 0.2)[..., causal].mean()
    by_hand.backward()
    assert torch.allclose(penalty, by_hand, atol=1e-6)
    assert torch.allclose(grad, query.grad, atol=1e-7)


def test_multiplier_moves_symmetrically_and_at_most_a_factor_exp_lr_per_step():
    settings = {"init": 1.0, "ema": 0.5, "lr": 0.25, "min": 1e-3, "max": 1e3}
    multiplier = Multiplier(**settings)
    state = sparsify.TrainState(lam=1.0)
    sparsify.update_multiplier(state, 0.05, slack=0.1, multiplier=multiplier)  # first C: no averaging
    assert state.c_ema == 0.05 and state.lam == pytest.approx(math.exp(0.25 * 0.5))
    sparsify.update_multiplier(state, 10.0, slack=0.1, multiplier=multiplier)  # far over: clipped to +1
    assert state.c_ema == pytest.approx(5.025)
    assert state.lam == pytest.approx(math.exp(0.25 * 1.5))
    state = sparsify.TrainState(lam=1.0)
    for constraint in (0.3, -0.1):  # 3 slacks over, then fully met: the same step each way
        sparsify.update_multiplier(state, constraint, slack=0.1, multiplier=Multiplier(**{**settings, "ema": 0.0}))
    assert state.lam == pytest.approx(1.0)
    state = sparsify.TrainState(lam=999.0)
    sparsify.update_multiplier(state, 1.0, slack=0.1, multiplier=multiplier)
    assert state.lam == 1e3  # capped


def _autograd_loss_terms(logits, ids, reference):
    """The losses written plainly over the whole shifted batch (what the chunked version replaces)."""
    shifted = logits[:, :-1].float()
    ce = torch.nn.functional.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), ids[:, 1:].reshape(-1))
    log_p = torch.log_softmax(reference[:, :-1].float(), -1)
    log_q = torch.log_softmax(shifted, -1)
    return ce, (log_p.exp() * (log_p - log_q)).sum(-1).mean()


# several chunks per sequence, one, and rows long enough (>= 32768) to be reduced by 2 threads
@pytest.mark.parametrize("vocab,chunk", [(17, 64), (17, 2 ** 20), (40000, 3 * 40000)])
def test_chunked_losses_equal_autograd_over_the_whole_batch_bit_for_bit(vocab, chunk, monkeypatch):
    monkeypatch.setitem(sparsify.losses._CHUNK_ELEMENTS, "cpu", chunk)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 8, vocab, generator=generator) * 4
    reference = torch.randn(3, 8, vocab, generator=generator) * 4
    ids = torch.randint(0, vocab, (3, 8), generator=generator)
    try:
        _assert_losses_equal(logits, reference, ids)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("length,rows", [(128, 21), (8, 3), (3, 5), (2, 2)])
def test_loss_chunks_cover_every_position_once_in_even_blocks_of_at_least_two_rows(length, rows, monkeypatch):
    """A one-row block would be summed across threads in another order than the whole batch
    (a different last bit of the KL; it once moved the multiplier at step 28 of make sparse)."""
    monkeypatch.setitem(sparsify.losses._CHUNK_ELEMENTS, "cpu", rows * 10)
    blocks = list(sparsify.losses._chunks(torch.Size([2, length, 10]), torch.device("cpu")))
    for sequence in (0, 1):
        spans = [(first, last) for s, first, last in blocks if s == sequence]
        assert [p for first, last in spans for p in range(first, last)] == list(range(length - 1))
        sizes = [last - first for first, last in spans]
        assert max(sizes) - min(sizes) <= 1 and (min(sizes) >= 2 or length == 2)


def _assert_losses_equal(logits, reference, ids):
    for weights in ((0.0, 0.7), (1.3, 0.0), (1.3, 0.7)):  # the KL constraint, CE only (control), both
        results = []
        for losses in (_autograd_loss_terms, sparsify.losses.loss_terms):
            leaf = logits.clone().requires_grad_(True)
            ce, kl = losses(leaf, ids, reference)
            (weights[0] * ce + weights[1] * kl).backward()
            results.append((ce.detach(), kl.detach(), leaf.grad))
        for plain, chunked in zip(*results):
            assert torch.equal(plain, chunked)
    ce, kl = sparsify.losses.loss_terms(logits, ids, None)
    assert kl is None and torch.equal(ce, _autograd_loss_terms(logits, ids, reference)[0])
    # bfloat16 logits (CUDA autocast): float32 losses, the gradient in the logits' dtype
    leaf = logits.bfloat16().requires_grad_(True)
    ce, kl = sparsify.losses.loss_terms(leaf, ids, reference.bfloat16())
    kl.backward()
    assert ce.dtype == kl.dtype == torch.float32 and leaf.grad.dtype == torch.bfloat16
    assert not leaf.grad[:, -1].any()  # the last position predicts nothing


def test_learning_rate_warms_up_then_stays_or_decays_by_cosine_to_zero():
    settings = SimpleNamespace(lr=1.0, warmup_steps=2, steps=6, lr_schedule="constant")
    assert [sparsify.learning_rate(settings, step) for step in range(6)] == [0.5, 1, 1, 1, 1, 1]
    settings.lr_schedule = "cosine"
    rates = [sparsify.learning_rate(settings, step) for step in range(7)]
    assert rates[:2] == [0.5, 1.0]
    expected = [0.5 * (1 + math.cos(math.pi * k / 5)) for k in range(1, 6)]  # 5 steps after warm-up
    assert rates[2:6] == pytest.approx(expected[:4]) and rates[5] > 0
    assert rates[6] == pytest.approx(0.0, abs=1e-12)  # a step past the last would not move


def test_generation_with_a_kv_cache_matches_the_full_forward():
    model = TINY["llama-gqa"]()
    sparse.make_sparse(model, 0.0)  # many edges closed
    ids = torch.randint(3, 101, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=4, do_sample=False)
        full = model(generated).logits[0, 7:-1].argmax(-1)
    assert torch.equal(generated[0, 8:], full)


def test_gradient_checkpointing_replays_the_sampled_gates():
    """A layer recomputed in the backward pass must see the forward pass's gate draws."""
    ids = torch.randint(3, 101, (2, 10), generator=torch.Generator().manual_seed(4))
    grads = []
    for checkpointing in (False, True):
        model = TINY["llama-gqa"]().train()
        sparse.make_sparse(model, 0.5)  # σ(0.5) ≈ 0.62: many sampled gates are closed
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False,
                                                   "context_fn": interventions.recompute_context})
        tracker = sparse.GateTracker(training=True, generator=torch.Generator().manual_seed(3))
        with intervened(model, gates=tracker):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss + tracker.expected_density()
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6), name


def test_per_layer_calibration_lowers_the_cheapest_layers_first(monkeypatch):
    """Greedy rounds on a model whose KL and density are additive per layer (measurement faked)."""
    kl_cost, closes = [0.1, 0.0, 0.05, 0.02], [0.01, 0.01, 0.01, 0.0]  # per step lowered
    start, step = 1.0, 0.5

    def measure(trainer, bias, ids, references):
        lowered = [(start - b) / step for b in bias]
        return {"kl": sum(c * n for c, n in zip(kl_cost, lowered)),
                "density": 0.5 - sum(c * n for c, n in zip(closes, lowered))}

    monkeypatch.setattr(sparsify.calibrate, "_measure", measure)
    trainer = SimpleNamespace(student=SimpleNamespace(config=LlamaConfig(num_hidden_layers=4)))
    options = SimpleNamespace(max_kl=0.12, lowest=-0.5,
                              per_layer=SimpleNamespace(step=step, rounds=5, sensitivity_sequences=2))
    biases, record = sparsify.calibrate_per_layer(trainer, torch.zeros(4, 8), None, start, options)
    first, second, third = record["rounds"]
    assert first["ranking"] == [1, 2, 0]  # KL per edge closed; layer 3 closes nothing
    assert first["lowered"] == [1, 2] and first["kl"] == pytest.approx(0.05)  # with layer 0: 0.15
    assert second["ranking"] == [1, 2] and second["lowered"] == [1, 2]  # 0.10
    assert third["lowered"] == [1]  # layer 2 again would make 0.15; then layer 1 reaches `lowest`
    assert biases == [1.0, -0.5, 0.0, 1.0] == record["gate_bias"]
    for done in record["rounds"]:  # bisection: every prefix tried up to the accepted one fits, longer ones not
        accepted = len(done["lowered"])
        assert all((t["kl"] <= 0.12) == (t["layers"] <= accepted) for t in done["tried"])


def test_gates_sampled_under_bfloat16_are_computed_in_float32():
    """Under bf16 autocast the logits are bf16; in bf16 the noise's 1 - 1e-6 rounds to 1
    (infinite noise, a gate that never closes): the gate math runs in float32."""
    logits = (torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    gate, expected = sparse.stochastic_gate(logits, 0.5, torch.Generator().manual_seed(1))
    assert gate.dtype == torch.bfloat16 and expected.dtype == torch.float32
    same, _ = sparse.stochastic_gate(logits.float(), 0.5, torch.Generator().manual_seed(1))
    assert torch.equal(gate.float(), same)  # the same draw as from the float32 logits
    assert torch.equal(expected, torch.sigmoid(logits.float() + 0.5))


def test_edges_near_the_gate_threshold_are_counted_from_s_plus_b_over_allowed_edges():
    """The diagnostic of gpu_checks: allowed edges with |s + b| under the tracker's distance, per
    head, open (s + b > 0) apart from closed, counted by hand from the logits (a count from s
    alone, or over masked edges, differs)."""
    generator = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(1, 2, 9, 8, generator=generator) for _ in range(3))
    bias, distance = 0.3, 0.25
    tracker = sparse.GateTracker(near_threshold=distance)
    with _inside(gates=tracker):
        interventions.attend(_fake_module(bias), query, key, value, _causal_mask(9), scaling=8 ** -0.5)
    logits = query @ key.transpose(2, 3) * 8 ** -0.5
    causal = torch.ones(9, 9).tril().bool()
    gate_logits = logits + bias
    near = (gate_logits.abs() < distance) & causal
    hand_open, hand_closed = (near & (gate_logits > 0)).sum(dim=(0, 2, 3)), (near & (gate_logits <= 0)).sum(dim=(0, 2, 3))
    assert hand_open.min() > 0 and hand_closed.min() > 0
    assert int(near.sum()) != int(((logits.abs() < distance)[..., causal]).sum())  # s alone would differ
    assert int(near.sum()) != int((gate_logits.abs() < distance).sum())  # as would masked edges
    assert torch.equal(tracker.near_open_per_head[0], hand_open)
    assert torch.equal(tracker.near_closed_per_head[0], hand_closed)
    assert not torch.equal(hand_open, hand_closed)  # the two sides apart
    assert sparse.GateTracker().near_open_per_head == {}  # not counted unless asked


def test_open_edges_of_bfloat16_gates_are_counted_exactly():
    """A bf16 sum is exact only up to 256; a bf16 model's density must not round."""
    logits = torch.randn(4, 2, 64, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    allowed = torch.ones(64, 64).tril().bool()[None, None]
    tracker = sparse.GateTracker()
    sparse.count_open_edges(tracker, 0, sparse.deterministic_gate(logits, 0.1), allowed)
    exact = ((logits.float() + 0.1 > 0) & allowed).sum(dim=(0, 2, 3)).double()
    assert exact.min() > 256 and torch.equal(tracker.open_per_head[0], exact)


def test_a_float64_sparse_copy_with_left_padding_stays_finite():
    """The eager blocks take the softmax in float64 for a float64 model: in float32 the mask's
    float64 minimum became -inf, a padding row NaN, and 0 · NaN reached the real tokens."""
    model = TINY["llama-gqa"]().double()
    sparse.make_sparse(model, 0.0)
    ids = torch.randint(3, 101, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits
        alone = model(ids[0:1, 4:]).logits
    assert torch.isfinite(padded[mask.bool()]).all()
    # the same prompt alone (its positions shifted by the padding: rotary angles are float32)
    torch.testing.assert_close(padded[0, 4:], alone[0], atol=1e-6, rtol=0)


def test_the_model_card_gives_the_held_out_cross_entropy_dense_first_then_sparse(tmp_path):
    """The card's row is labelled "dense / sparse": swapped values would credit the copy with its
    base's loss. Distinct hand-written values, each in its place."""
    from attnlab.attention.saved_copy import write_card

    write_card(tmp_path, "copy", {"base": "smollm2-135m", "heldout_ce_dense": 2.25, "heldout_ce_sparse": 2.5,
                                  "heldout_kl": 0.125, "heldout_density": 0.1875})
    card = (tmp_path / "README.md").read_text()
    assert "| held-out cross-entropy, dense / sparse, nats per token | 2.25 / 2.5 |" in card.splitlines()
    assert "| held-out KL(dense ‖ sparse), nats per token | 0.125 |" in card.splitlines()
