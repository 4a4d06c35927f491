"""ARM and the MLP activation statistics, on hand-made tensors and tiny models."""

import dataclasses

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GPT2Config, GPTNeoXConfig, LlamaConfig,
                          MistralConfig,
                          Olmo2Config, OlmoConfig, Phi3Config, Qwen2Config, Qwen3Config)

from attnlab.interventions import intervened
from attnlab.interventions.mlp import (ActivationRecorder, ArmSettings, gini, prompt_statistics,
                                       redistribute)
from attnlab.config.checks import HeadRangeError


def _activations(rows=6, d=200, seed=0):
    """Distinct magnitudes (no ties), both signs, a SiLU-like skew."""
    rng = np.random.default_rng(seed)
    values = rng.normal(0.1, 0.6, size=(rows, d))
    values += np.sign(values) * rng.permutation(rows * d).reshape(rows, d) * 1e-7
    return torch.tensor(values, dtype=torch.float32)


def _expected_count(row: np.ndarray, s: ArmSettings) -> int:
    """The ARM recipe written out with numpy, for one token vector."""
    def median(v):  # the lower median, as torch.median
        return np.sort(v)[(len(v) - 1) // 2]
    magnitude = np.abs(row)
    mad = median(np.abs(magnitude - median(magnitude)))
    eps = 1.4826 * mad * s.c
    share = np.mean(magnitude < eps)
    return int(round(np.clip(share, s.pmin, s.pmax) * len(row)))


def _run(a, settings, seed=0, positions=None, tokens=None):
    """ARM on hand-made activations; by default token t of each row is at position t with id 11."""
    shape = a.shape[:-1]
    positions = torch.arange(shape[-1]).expand(shape) if positions is None else positions
    tokens = torch.full(shape, 11) if tokens is None else tokens
    return redistribute(a, dataclasses.replace(settings, seed=seed), positions, tokens)


@pytest.mark.parametrize("settings", [ArmSettings(), ArmSettings(c=1.0, p=99.5),
                                      ArmSettings(c=0.01, pmin=0.1), ArmSettings(mode="add")])
def test_arm_changes_exactly_the_smallest_entries(settings):
    a = _activations()
    out = _run(a, settings)
    for row, new in zip(a.numpy(), out.numpy()):
        n = _expected_count(row, settings)
        smallest = set(np.argsort(np.abs(row))[:n])
        changed = set(np.nonzero(new != row)[0])
        assert changed == smallest  # exactly n entries, and only those
        untouched = np.setdiff1d(np.arange(len(row)), list(smallest))
        np.testing.assert_array_equal(new[untouched], row[untouched])


def test_arm_preserves_signs_and_draws_in_range():
    a = _activations()
    settings = ArmSettings(c=0.5)
    out = _run(a, settings).numpy()
    for row, new in zip(a.numpy(), out):
        changed = new != row
        assert np.all(np.sign(new[changed]) == np.sign(row[changed]))
        upper = np.sort(row)[int(np.ceil(settings.p / 100 * len(row))) - 1]
        positive, negative = changed & (row > 0), changed & (row < 0)
        assert np.all((new[positive] >= 0) & (new[positive] <= upper))
        assert np.all((new[negative] >= row.min()) & (new[negative] <= 0))


def test_arm_add_moves_entries_away_from_zero():
    a = _activations()
    out = _run(a, ArmSettings(mode="add")).numpy()
    changed = out != a.numpy()
    assert np.all(np.abs(out[changed]) >= np.abs(a.numpy()[changed]))


def test_arm_is_reproducible_by_seed_and_batch_invariant():
    a = _activations(rows=8).reshape(2, 4, -1)
    settings = ArmSettings()
    assert torch.equal(_run(a, settings, seed=3), _run(a, settings, seed=3))
    assert not torch.equal(_run(a, settings, seed=3), _run(a, settings, seed=4))
    # Which entries are chosen depends on each token alone, not on its batch.
    alone = _run(a[1:], settings) != a[1:]
    together = _run(a, settings)[1:] != a[1:]
    assert torch.equal(alone, together)
    # So are the drawn values: keyed by each token's position and id, not by its batch ...
    positions = torch.arange(4).expand(2, 4)
    tokens = torch.tensor([[5, 9, 2, 7], [3, 3, 8, 1]])
    second = _run(a[1:], settings, positions=positions[1:], tokens=tokens[1:])
    assert torch.equal(second, _run(a, settings, positions=positions, tokens=tokens)[1:])
    # ... nor by the left padding in front of it,
    padded = torch.cat([torch.randn(1, 3, a.shape[-1]), a[1:]], dim=1)
    padded_positions = torch.tensor([[0, 0, 0, 0, 1, 2, 3]])
    padded_tokens = torch.cat([torch.zeros(1, 3, dtype=torch.long), tokens[1:]], dim=1)
    assert torch.equal(_run(padded, settings, positions=padded_positions, tokens=padded_tokens)[:, 3:], second)
    # ... and another position or token draws other values.
    assert not torch.equal(_run(a[1:], settings, positions=positions[1:] + 1, tokens=tokens[1:]), second)
    assert not torch.equal(_run(a[1:], settings, positions=positions[1:], tokens=tokens[1:] + 1), second)


def test_arm_draws_are_uniform():
    from attnlab.interventions.mlp import token_keys, uniform_draws

    keys = token_keys(0, torch.arange(64)[:, None], torch.full((64, 1), 5))
    u = uniform_draws(keys, torch.arange(4096).expand(64, -1)).flatten().numpy()
    assert u.min() >= 0 and u.max() < 1 and len(np.unique(u)) > 0.99 * len(u)
    counts = np.histogram(u, bins=16, range=(0, 1))[0]
    assert np.all(np.abs(counts / len(u) * 16 - 1) < 0.05)
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.02


def test_arm_settings_are_checked():
    with pytest.raises(ValueError, match="mode"):
        ArmSettings(mode="swap")
    with pytest.raises(ValueError, match="pmin"):
        ArmSettings(pmin=0.5, pmax=0.2)


def test_statistics_of_a_hand_made_tensor():
    # two prompts x three tokens x four units; the second prompt's last token is masked out
    a = torch.tensor([[[0.0, 0.005, 1.0, -2.0], [0.5, 0.5, 0.5, 0.5], [3.0, 0.0, 0.0, 0.0]],
                      [[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 4.0], [9.0, 9.0, 9.0, 9.0]]])
    g = torch.tensor([[[1.0, 2.0, 0.0, 0.0], [3.0, 2.0, 0.0, 0.0], [5.0, 2.0, 0.0, 3.0]],
                      [[0.0, 1.0, 1.0, 1.0], [2.0, 1.0, -1.0, 1.0], [7.0, 7.0, 7.0, 7.0]]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    stats = {k: v.numpy() for k, v in prompt_statistics(a, g, mask, threshold=0.01).items()}

    np.testing.assert_allclose(stats["near_zero"], [(2 / 4 + 0 + 3 / 4) / 3, (2 / 4 + 3 / 4) / 2])
    np.testing.assert_allclose(stats["l1"], [(3.005 + 2 + 3) / 3, (2 + 4) / 2], rtol=1e-6)
    np.testing.assert_allclose(stats["l2"], [(np.sqrt(5.000025) + 1 + 3) / 3, (np.sqrt(2) + 4) / 2],
                               rtol=1e-6)
    # Gini: sum |x_i - x_j| over all ordered pairs / (2 n^2 mean)
    def by_pairs(x):
        x = np.abs(np.asarray(x))
        return np.abs(x[:, None] - x[None, :]).sum() / (2 * len(x) ** 2 * x.mean())
    first = [by_pairs(a[0, t]) for t in range(3)]
    second = [by_pairs(a[1, t]) for t in range(2)]
    np.testing.assert_allclose(stats["gini"], [np.mean(first), np.mean(second)], rtol=1e-6)
    np.testing.assert_allclose(by_pairs([0, 0.005, 1, 2]), 6.995 / 12.02, rtol=1e-6)
    # gate variance: per unit over the prompt's masked tokens (population), then mean over units
    np.testing.assert_allclose(stats["gate_variance"], [(8 / 3 + 0 + 0 + 2) / 4, (1 + 0 + 1 + 0) / 4],
                               rtol=1e-6)
    np.testing.assert_array_equal(stats["n_tokens"], [3, 2])


def test_gini_extremes():
    assert gini(torch.ones(10)).item() == pytest.approx(0.0)
    assert gini(torch.tensor([0.0] * 9 + [1.0])).item() == pytest.approx(0.9)
    assert gini(torch.zeros(5)).item() == 0.0


def _tiny(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    elif kind == "qwen2":
        config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    elif kind == "gpt2":
        config = GPT2Config(vocab_size=64, n_embd=32, n_inner=48, n_layer=2, n_head=4, n_positions=64,
                            bos_token_id=1, eos_token_id=2)
    elif kind == "gpt_neox":
        config = GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    elif kind in ("qwen3", "mistral", "phi3", "gemma2"):
        classes = {"qwen3": Qwen3Config, "mistral": MistralConfig, "phi3": Phi3Config, "gemma2": Gemma2Config}
        config = classes[kind](vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2)
    elif kind in ("olmo", "olmo2"):
        config = (OlmoConfig if kind == "olmo" else Olmo2Config)(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=2)
    else:
        config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                                  max_position_embeddings=64, sliding_window=4)
    return AutoModelForCausalLM.from_config(config).eval()


def _mlp_parts(model, layer: int):
    """(the pre-activation projection, the activation module) of a block's MLP, found here by
    hand: gate_proj and act_fn; GPT-2's c_fc and act."""
    if model.config.model_type == "gpt2":
        mlp = model.transformer.h[layer].mlp
        return mlp.c_fc, mlp.act
    if model.config.model_type == "gpt_neox":
        mlp = model.gpt_neox.layers[layer].mlp
        return mlp.dense_h_to_4h, mlp.act
    mlp = model.model.layers[layer].mlp
    if model.config.model_type == "phi3":  # the gate half of gate_up_proj feeds the activation
        return _GateHalf(mlp.gate_up_proj), mlp.activation_fn
    return mlp.gate_proj, mlp.act_fn


class _GateHalf:
    """Phi-3's pre-activation: a hook on gate_up_proj that keeps the first half of its output."""

    def __init__(self, projection):
        self.projection = projection

    def register_forward_hook(self, hook):
        return self.projection.register_forward_hook(lambda m, args, out: hook(m, args, out.chunk(2, dim=-1)[0]))

    def __call__(self, x):
        return self.projection(x).chunk(2, dim=-1)[0]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3", "gpt2", "olmo", "olmo2", "qwen3", "mistral", "phi3",
                                  "gemma2", "gpt_neox"])
def test_recorder_sees_act_fn_of_gate_proj(kind):
    model = _tiny(kind)
    pre_activation, act_fn = _mlp_parts(model, 1)
    ids = torch.randint(3, 64, (2, 7))
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[0, 2:6], mask[1, 1:7] = True, True
    captured = {}
    handle = pre_activation.register_forward_hook(lambda m, args, out: captured.update(g=out))
    edges = np.linspace(-0.5, 0.5, 11)
    recorder = ActivationRecorder(1, 0.01, edges)
    recorder.mask = mask
    with torch.no_grad(), intervened(model, activations=recorder):
        model(ids)
    handle.remove()
    g = captured["g"]
    expected = prompt_statistics(act_fn(g), g, mask, 0.01)
    table = recorder.table()
    for name in ("near_zero", "l1", "gini", "gate_variance"):
        np.testing.assert_allclose(table[name], expected[name].numpy(), rtol=1e-5)
    histogram = recorder.histogram()
    assert histogram["count"].sum() == mask.sum().item() * 48
    values = act_fn(g)[mask].flatten().numpy()
    assert histogram["count"].iloc[0] == (values < -0.5).sum()
    assert histogram["count"].iloc[-1] == (values >= 0.5).sum()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3", "gpt2", "olmo", "olmo2", "qwen3", "mistral", "phi3",
                                  "gemma2", "gpt_neox"])
def test_arm_runs_on_prefill_and_every_decoding_step(kind):
    model = _tiny(kind)
    calls = []
    act = _mlp_parts(model, 0)[1]
    counter = act.register_forward_hook(lambda m, args, out: calls.append(out.shape[1]))
    ids = torch.randint(3, 64, (1, 5))
    with torch.no_grad():
        plain = model(ids).logits
        with intervened(model, arm=ArmSettings(layer=0, seed=1)):
            changed = model(ids).logits
            calls.clear()
            model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
            decoding = list(calls)
        after = model(ids).logits
    counter.remove()
    assert not torch.allclose(plain, changed)
    assert torch.equal(plain, after)  # the hook is gone after the block
    assert decoding == [5, 1, 1, 1]  # prefill, then one token per decoding step


def test_mlp_layer_out_of_range():
    model = _tiny("llama")
    with pytest.raises(HeadRangeError, match="2 layers"):
        recorder = ActivationRecorder(5, 0.01, np.linspace(0, 1, 3))
        with intervened(model, arm=ArmSettings(layer=0), activations=recorder):
            pass
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())  # ARM's not left in


def _arm_outputs(model, ids_rows, settings):
    """Layer-0 activations after ARM for left-padded rows, as the pipeline runs them."""
    from attnlab.models import left_pad

    ids, mask, positions = left_pad(ids_rows)
    seen = []
    with intervened(model, arm=settings), torch.no_grad():
        handle = model.get_decoder().layers[0].mlp.act_fn.register_forward_hook(
            lambda m, args, out: seen.append(out))
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        handle.remove()
    return seen[0], logits


def test_arm_in_a_model_does_not_depend_on_the_batch():
    """A prompt alone and left padded beside a longer one: the same ARM activations and logits."""
    model = _tiny("llama")
    settings = ArmSettings(layer=0, seed=5, c=0.5)
    short, long = [5, 17, 9, 33, 2], [8, 8, 41, 12, 7, 19, 3, 25]
    alone, alone_logits = _arm_outputs(model, [short], settings)
    batched, batched_logits = _arm_outputs(model, [long, short], settings)
    plain, _ = _arm_outputs(model, [short], None)
    assert not torch.allclose(alone, plain)  # ARM did redraw entries
    torch.testing.assert_close(batched[1, -5:], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched_logits[1, -5:], alone_logits[0], atol=1e-5, rtol=1e-5)


def test_arm_draws_in_decoding_match_the_prefill():
    """A token drawn for in a decoding step gets the draws it gets when the same text is prefilled,
    and greedy generations do not depend on the batch."""
    model = _tiny("llama")
    settings = ArmSettings(layer=0, seed=2, c=0.5)
    prompt = torch.tensor([[5, 17, 9, 33, 2]])
    seen = []
    with intervened(model, arm=settings), torch.no_grad():
        handle = model.get_decoder().layers[0].mlp.act_fn.register_forward_hook(
            lambda m, args, out: seen.append(out))
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                                   min_new_tokens=4, do_sample=False)
        handle.remove()
    decoded = torch.cat(seen[1:], dim=1)  # the three decoding steps' activations
    prefilled, _ = _arm_outputs(model, [generated[0, :-1].tolist()], settings)
    torch.testing.assert_close(decoded[0], prefilled[0, -3:], atol=1e-5, rtol=1e-5)
    other = torch.tensor([[8, 8, 41, 12, 7, 19, 3, 25]])
    ids = torch.cat([other, torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], dim=1)])
    mask = torch.cat([torch.ones_like(other), torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])])
    with intervened(model, arm=settings), torch.no_grad():
        together = model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                                  do_sample=False, pad_token_id=0)
    assert together[1, -4:].tolist() == generated[0, -4:].tolist()


def test_arm_without_token_ids_is_refused():
    model = _tiny("llama")
    embeds = model.get_input_embeddings()(torch.tensor([[5, 17, 9]]))
    with intervened(model, arm=ArmSettings(layer=0)), torch.no_grad():
        with pytest.raises(RuntimeError, match="input_ids"):
            model(inputs_embeds=embeds)
        model(torch.tensor([[5, 17, 9]]))  # the refused call left nothing behind


def test_mean_intervals_use_students_t():
    """Three prompts: the half-width is t(0.975, 2) = 4.30 standard errors, not the normal 1.96."""
    from scipy import stats

    from attnlab.interventions.mlp import summarise_statistics

    values = np.array([0.1, 0.4, 0.3])
    frame = lambda shift: pd.DataFrame({"id": ["a", "b", "c"], "n_tokens": [5, 5, 5],  # noqa: E731
                                        **{name: values + shift for name in
                                           ("near_zero", "l1", "l2", "gini", "gate_variance")}})
    table = summarise_statistics({"plain": frame(0.0), "more": frame(np.array([0.1, 0.3, 0.2]))}, "plain")
    low, high = stats.t.interval(0.95, 2, loc=values.mean(), scale=stats.sem(values))
    row = table.set_index("condition").loc["plain"]
    assert row["l1_ci_low"] == pytest.approx(low) and row["l1_ci_high"] == pytest.approx(high)
    delta = np.array([0.1, 0.3, 0.2])
    low, high = stats.t.interval(0.95, 2, loc=delta.mean(), scale=stats.sem(delta))
    more = table.set_index("condition").loc["more"]
    assert more["gini_delta_ci_low"] == pytest.approx(low) and more["gini_delta_ci_high"] == pytest.approx(high)


def test_the_paired_difference_records_how_many_prompts_both_conditions_have():
    """A condition that lost a prompt is compared on the prompts both have, and says how many."""
    from attnlab.interventions.mlp import summarise_statistics

    statistics = ("near_zero", "l1", "l2", "gini", "gate_variance")
    plain = pd.DataFrame({"id": ["a", "b", "c"], "n_tokens": 5, **{s: [0.1, 0.4, 0.3] for s in statistics}})
    more = pd.DataFrame({"id": ["a", "c"], "n_tokens": 5, **{s: [0.3, 0.6] for s in statistics}})
    table = summarise_statistics({"plain": plain, "more": more}, "plain").set_index("condition")
    assert table.loc["plain", "n_paired"] == 3 and table.loc["more", "n_paired"] == 2
    assert table.loc["more", "n_prompts"] == 2
    assert table.loc["more", "l1_delta"] == pytest.approx(np.mean([0.3 - 0.1, 0.6 - 0.3]))


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_recording_stops_at_the_recorded_layer_with_the_full_forwards_numbers(kind):
    """record_activations ends each forward at the recorded layer's activation: the same table
    and histogram as a recorder over the whole forward, and no later layer runs."""
    from attnlab.mechanism.recording import record_activations
    from attnlab.models import left_pad, padded_span_mask

    model = _tiny(kind)
    torch.manual_seed(1)
    rows = [torch.randint(3, 64, (n,)).tolist() for n in (9, 6, 8)]
    prompts = pd.DataFrame({"input_ids": rows, "question_start": [2, 1, 3], "question_end": [9, 6, 8],
                            "inserted_start": [4, 1, 3], "inserted_end": [6, 1, 5]})
    edges = np.linspace(-0.5, 0.5, 11)
    ran_after = []
    handle = model.get_decoder().layers[1].register_forward_hook(lambda *args: ran_after.append(1))
    table, histogram = record_activations(model, prompts, 0, 0.01, edges, batch_size=2)
    handle.remove()
    assert not ran_after

    whole = ActivationRecorder(0, 0.01, edges)
    for start in (0, 2):
        batch = prompts.iloc[start:start + 2]
        ids, mask, positions = left_pad(batch["input_ids"].tolist())
        lengths = [len(r) for r in batch["input_ids"]]
        question = padded_span_mask(lengths, batch[["question_start", "question_end"]].to_numpy(), ids.shape[1])
        inserted = padded_span_mask(lengths, batch[["inserted_start", "inserted_end"]].to_numpy(), ids.shape[1])
        whole.mask = question & ~inserted
        with torch.no_grad(), intervened(model, activations=whole):
            model(input_ids=ids, attention_mask=mask, position_ids=positions)
    pd.testing.assert_frame_equal(table, whole.table())
    pd.testing.assert_frame_equal(histogram, whole.histogram())
    assert histogram["count"].sum() == (5 + 5 + 3) * 48  # question tokens less the inserted ones
