from types import SimpleNamespace

import numpy as np
import pytest
import torch

from attnlab.circuits.curves import heads_to_reach, k_grid
from attnlab.circuits.sweeps import sweep as swept_metric
from attnlab.interventions import intervened
from attnlab.patching.heads import HeadGates, Patcher, build_batch, template_means
from attnlab.patching.tasks import TaskError, TaskPrompts, generate_task, single_tokens, subset, year_formulation
from test_attention import TINY


class WordTokenizer:
    """A stand-in tokenizer: one token per space-separated word, ids by a fixed table."""

    name_or_path = "word-tokenizer"
    pad_token_id = 0

    def __init__(self):
        self.vocab = {"<pad>": 0}

    def __call__(self, text, add_special_tokens=True):
        ids = [self.vocab.setdefault(word, len(self.vocab) % 100 + 1) for word in text.split()]
        return type("Encoding", (), {"input_ids": ids})()


def _toy_batch(n=6, length=7, vocab=101, seed=0):
    rng = np.random.default_rng(seed)
    clean = [" ".join(f"w{x}" for x in rng.integers(0, 50, length)) for _ in range(n)]
    corrupted = [" ".join(f"w{x}" for x in rng.integers(0, 50, length)) for _ in range(n)]
    prompts = TaskPrompts("ioi", clean, corrupted, [0] * n, answers=list(rng.integers(1, vocab, n)),
                          distractors=[[int(x)] for x in rng.integers(1, vocab, n)])
    return build_batch(prompts, WordTokenizer())


def test_ablating_a_head_changes_only_its_slice():
    model = TINY["llama-gqa"]()
    gates = HeadGates(model)
    seen = {}
    ids = torch.randint(3, 100, (2, 9))
    gates.reference = [torch.full((2, 9, 64), 7.0) for _ in range(3)]
    with torch.no_grad(), intervened(model, head_gates=gates):
        after_gates = model.model.layers[1].self_attn.o_proj.register_forward_pre_hook(
            lambda module, args: seen.__setitem__("z", args[0].detach().clone()))
        model(ids)
        kept = seen["z"].view(2, 9, 4, 16)
        gates.gates[1, 2] = 0  # ablate layer 1, head 2 (query heads share KV heads: GQA)
        model(ids)
        ablated = seen["z"].view(2, 9, 4, 16)
        after_gates.remove()
    assert torch.equal(ablated[:, :, [0, 1, 3]], kept[:, :, [0, 1, 3]])
    assert torch.all(ablated[:, :, 2] == 7.0) and not torch.equal(kept[:, :, 2], ablated[:, :, 2])


def _out_projection(model, layer: int):
    """The attention's output projection of a block, found here by hand (GPT-2: c_proj)."""
    if model.config.model_type == "gpt2":
        return model.transformer.h[layer].attn.c_proj
    if model.config.model_type == "gpt_neox":
        return model.gpt_neox.layers[layer].attention.dense
    return model.model.layers[layer].self_attn.o_proj


def _metric_by_hand(model, batch, layers_patched: dict | None) -> float:
    """Mean logit difference, each prompt alone, with every head of each layer in
    ``layers_patched`` given that layer's reference (per prompt) by a hook written here."""
    values = []
    for row in range(len(batch.clean)):
        handles = []
        for layer, reference in (layers_patched or {}).items():
            def replace(module, args, reference=reference[row]):
                return (reference[None].expand_as(args[0]).clone(),)
            handles.append(_out_projection(model, layer).register_forward_pre_hook(replace))
        with torch.no_grad():
            last = model(batch.clean[row:row + 1]).logits[0, -1]
        for handle in handles:
            handle.remove()
        values.append(float(batch.metric(last[None, None], slice(row, row + 1))[0]))
    return float(np.mean(values))


def _references_by_hand(model, batch, ablation: str) -> dict:
    """Each layer's o_proj input of the corrupted prompts, its mean over the (single-template)
    clean prompts, or zeros: [prompts, tokens, width] per layer, from one prompt at a time."""
    captured = {}

    def capture(layer):
        def hook(module, args):
            captured.setdefault(layer, []).append(args[0][0].detach().clone())
        return hook
    handles = [_out_projection(model, l).register_forward_pre_hook(capture(l)) for l in range(3)]
    source = batch.corrupted if ablation == "corrupted" else batch.clean
    with torch.no_grad():
        for row in range(len(source)):
            model(source[row:row + 1])
    for handle in handles:
        handle.remove()
    stacked = {layer: torch.stack(values) for layer, values in captured.items()}
    if ablation == "mean":
        return {layer: z.mean(0, keepdim=True).expand_as(z) for layer, z in stacked.items()}
    if ablation == "zero":
        return {layer: torch.zeros_like(z) for layer, z in stacked.items()}
    return stacked


@pytest.mark.parametrize("arch", ["qwen2", "gpt2", "olmo2", "gpt_neox", "gemma2-softcap"])
@pytest.mark.parametrize("ablation", ["corrupted", "mean", "zero"])
def test_the_sweeps_ends_are_the_model_with_every_head_and_with_none(arch, ablation):
    """m(all) is the unpatched model's metric and m(0) the metric with every head's o_proj input
    replaced by the reference, each computed here one prompt at a time with hooks of its own (the
    template mean taken by hand); in between, each prompt's metric averages to the curve's."""
    model = TINY[arch]()
    batch = _toy_batch()  # one template, equal lengths: no padding
    patcher = Patcher(model, batch, ablation, batch_size=4)
    heads = [(l, h) for l in range(3) for h in range(4)]
    sweep, per_prompt = swept_metric(patcher, heads, k_grid(len(heads)))
    assert sweep["metric"].iloc[-1] == pytest.approx(_metric_by_hand(model, batch, None), abs=1e-5)
    none_kept = _metric_by_hand(model, batch, _references_by_hand(model, batch, ablation))
    assert sweep["metric"].iloc[0] == pytest.approx(none_kept, abs=1e-5)
    assert abs(sweep["metric"].iloc[-1] - sweep["metric"].iloc[0]) > 1e-2  # the ends differ: a real check
    assert sorted(per_prompt) == list(range(13)) and all(len(v) == 6 for v in per_prompt.values())
    np.testing.assert_allclose([per_prompt[k].mean() for k in range(13)], sweep["metric"], atol=1e-6)


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_mean_ablation_takes_each_templates_mean_over_every_prompt_given(arch):
    """A split that holds one prompt of each template (each its own mean within the split) ablated
    to the template means of all 7 prompts (two templates of 7 and 5 tokens, left padded): every
    head replaced equals, prompt by prompt and without padding, each layer's o_proj input set by a
    hook written here to the mean of its template's prompts computed one at a time."""
    model, tokenizer, rng = TINY[arch](), WordTokenizer(), np.random.default_rng(1)
    lengths, templates = [7, 7, 7, 7, 5, 5, 5], [0, 0, 0, 0, 1, 1, 1]
    clean = [" ".join(f"w{x}" for x in rng.integers(0, 50, n)) for n in lengths]
    corrupted = [" ".join(f"w{x}" for x in rng.integers(0, 50, n)) for n in lengths]
    prompts = TaskPrompts("ioi", clean, corrupted, templates, answers=list(rng.integers(1, 101, 7)),
                          distractors=[[int(x)] for x in rng.integers(1, 101, 7)])
    split = [1, 5]
    few = build_batch(subset(prompts, split), tokenizer)
    patcher = Patcher(model, few, "mean", batch_size=4, means=template_means(model, build_batch(prompts, tokenizer), 3))
    alone = [torch.tensor([tokenizer(text).input_ids]) for text in clean]
    inputs = [_references_by_hand(model, SimpleNamespace(clean=ids), "clean") for ids in alone]
    by_template = {t: {layer: torch.stack([inputs[i][layer][0] for i in range(7) if templates[i] == t]).mean(0)
                       for layer in range(3)} for t in (0, 1)}
    expected, unpatched = [], []
    for i, prompt in enumerate(split):
        one = SimpleNamespace(clean=alone[prompt], metric=lambda logits, rows, i=i: few.metric(logits, slice(i, i + 1)))
        mean = {layer: z[None] for layer, z in by_template[templates[prompt]].items()}
        expected.append(_metric_by_hand(model, one, mean))
        unpatched.append(_metric_by_hand(model, one, None))
    assert patcher.metric(torch.zeros(3, 4)) == pytest.approx(np.mean(expected), abs=1e-5)
    assert patcher.metric(None) == pytest.approx(np.mean(unpatched), abs=1e-5)
    assert abs(np.mean(expected) - np.mean(unpatched)) > 1e-2  # the split's own mean would change nothing
    with pytest.raises(ValueError, match="template 1 of row 1 has no mean"):
        Patcher(model, few, "mean", batch_size=4, means={0: [by_template[0][layer] for layer in range(3)]})


@pytest.mark.parametrize("arch", list(TINY))
def test_attribution_is_the_gradient_of_the_gates(arch):
    model = TINY[arch]()
    patcher = Patcher(model, _toy_batch(), "corrupted", batch_size=4)
    attribution = patcher.attribution()
    assert attribution.shape == (3, 4)
    # A finite difference of one gate agrees with its gradient. Central, at a step of 1e-2: float32
    # metrics (ulp ~1e-7) leave ~1e-5 of noise and O(step²) ~5e-6 (seen: ≤ 3.2e-6); a one-sided step
    # of 1e-3 had 1 ulp / 1e-3 ~ 3e-5 of noise against these 1e-4
    eps = 1e-2
    up, down = torch.ones(3, 4), torch.ones(3, 4)
    up[2, 1], down[2, 1] = 1 + eps, 1 - eps
    slope = (patcher.metric(up) - patcher.metric(down)) / (2 * eps)
    assert attribution[2, 1].item() == pytest.approx(slope, rel=1e-2, abs=1e-4)


def test_k_grid_and_threshold():
    assert k_grid(5) == [0, 1, 2, 3, 4, 5]
    grid = k_grid(1024, max_all=300, points=20)
    assert grid[0] == 0 and grid[-1] == 1024 and len(grid) <= 21 and grid == sorted(set(grid))
    import pandas as pd
    sweep = pd.DataFrame({"heads_kept": [0, 1, 2, 3], "explained_effect": [0, 0.95, 0.85, 1.0]})
    assert heads_to_reach(sweep, 0.9) == 1
    assert heads_to_reach(sweep, 1.01) is None


@pytest.mark.parametrize("task", ["ioi", "ioi_long", "greater_than", "docstring"])
def test_tasks_on_smollm2_have_aligned_pairs(smollm2_tokenizer, task):
    prompts = generate_task(task, smollm2_tokenizer, 24, seed=1)
    assert len(prompts.clean) == len(prompts.corrupted) == 24
    assert prompts.clean != prompts.corrupted
    again = generate_task(task, smollm2_tokenizer, 24, seed=1)
    assert again.clean == prompts.clean  # seeded
    batch = build_batch(prompts, smollm2_tokenizer)
    assert batch.clean.shape == batch.corrupted.shape


def test_greater_than_uses_digits_on_smollm2(smollm2_tokenizer):
    assert year_formulation(smollm2_tokenizer) == "digits"
    prompts = generate_task("greater_than", smollm2_tokenizer, 4, seed=0)
    assert prompts.info["formulation"] == "digits"
    assert prompts.clean[0].startswith("The ") and prompts.corrupted[0].endswith(prompts.clean[0][-2:])
    assert build_batch(prompts, smollm2_tokenizer).rows_per_prompt == 10


def test_zero_survivors_name_the_tokenizer_and_list(smollm2_tokenizer):
    with pytest.raises(TaskError, match=r"no IOI names is a single token under .*candidates were \['Bartholomew"):
        single_tokens(smollm2_tokenizer, ["Bartholomew", "Maximiliano"], "IOI names")


@pytest.mark.slow
def test_gemma3_does_ioi(gemma3_dir):
    """Gemma-3-270M prefers the indirect object: positive logit difference, lost when corrupted."""
    from attnlab.models import load_model
    from attnlab.tokenization import load_tokenizer

    tokenizer = load_tokenizer(gemma3_dir)
    model = load_model(gemma3_dir, torch.device("cpu"), torch.float32)
    prompts = generate_task("ioi", tokenizer, 30, seed=0)
    patcher = Patcher(model, build_batch(prompts, tokenizer), "corrupted", batch_size=32)
    clean, corrupted = patcher.metric(), patcher.corrupted_metric()
    assert clean > 1.0
    assert abs(corrupted) < clean / 2
    n_heads = 18 * 4
    sweep, _ = swept_metric(patcher, [(l, h) for l in range(18) for h in range(4)], [0, n_heads])
    assert sweep["explained_effect"].tolist() == [0.0, 1.0]


def test_sweep_is_refined_around_the_first_crossing():
    """The grid's crossing of 0.9 lies between grid points 20 and 40: every k in between is
    measured, so the count is 27 and not the grid's 40; a later dip is reported. With k below
    it unmeasured, 27 is an upper bound, said so; a complete sweep's count is exact."""
    from attnlab.circuits.curves import crossing, refined_sweep

    def effect(k):  # explained effect of keeping k of 100 heads; dips below 0.9 at k = 70
        return 0.8 if k == 70 else min(1.0, k / 30)
    calls = []

    def metric_at(k):
        calls.append(k)
        return 2.0 + 3.0 * effect(k)  # m(0) = 2, m(all) = 5
    grid = [0, 10, 20, 40, 70, 100]
    sweep = refined_sweep(metric_at, 100, grid, threshold=0.9)
    assert sweep["heads_kept"].tolist() == sorted(grid + list(range(21, 40)))
    assert sorted(calls) == sweep["heads_kept"].tolist()  # each k measured once
    assert sweep.loc[sweep["refined"], "heads_kept"].tolist() == list(range(21, 40))
    np.testing.assert_allclose(sweep["explained_effect"], [effect(k) for k in sweep["heads_kept"]])
    # 0, 10, 20 and 21-26 measured below 27: 18 k unmeasured
    assert crossing(sweep, 0.9) == {"heads_to_reach_threshold": 27, "heads_to_reach_exact": False,
                                    "unmeasured_below": 18, "crosses_back_below": True}
    # Without refinement the grid overestimates the number more.
    coarse = refined_sweep(metric_at, 100, grid)
    assert crossing(coarse, 0.9) == {"heads_to_reach_threshold": 40, "heads_to_reach_exact": False,
                                     "unmeasured_below": 37, "crosses_back_below": True}
    assert crossing(refined_sweep(metric_at, 100, [0, 20, 40, 100], 0.9), 0.9)["crosses_back_below"] is False
    assert crossing(sweep, 1.5)["heads_to_reach_threshold"] is None
    complete = refined_sweep(metric_at, 100, list(range(101)), threshold=0.9)
    assert crossing(complete, 0.9)["heads_to_reach_exact"] and crossing(complete, 0.9)["unmeasured_below"] == 0


def test_a_grid_count_is_an_upper_bound_on_a_curve_that_is_not_monotonic():
    """A spike to the threshold between grid points (k = 15) is not seen: the grid's count
    (27) is larger than the fewest heads (15), and is reported as not exact."""
    from attnlab.circuits.curves import count_text, crossing, refined_sweep

    def metric_at(k):
        return 0.95 if k == 15 else min(1.0, k / 30)
    on_grid = crossing(refined_sweep(metric_at, 100, [0, 10, 20, 40, 70, 100], 0.9), 0.9)
    every_k = crossing(refined_sweep(metric_at, 100, list(range(101)), 0.9), 0.9)
    assert (on_grid["heads_to_reach_threshold"], on_grid["heads_to_reach_exact"]) == (27, False)
    assert (every_k["heads_to_reach_threshold"], every_k["heads_to_reach_exact"]) == (15, True)
    assert count_text(27, False) == "≤27" and count_text(15, True) == "15" and count_text(None, True) == "never"


def test_patcher_sweep_refines_between_grid_points():
    model = TINY["qwen2"]()
    patcher = Patcher(model, _toy_batch(), "corrupted", batch_size=4)
    heads = [(l, h) for l in range(3) for h in range(4)]
    full, _ = swept_metric(patcher, heads, k_grid(len(heads)))
    threshold = float(full["explained_effect"].iloc[5:8].mean())  # a crossing inside (0, 12)
    refined, _ = swept_metric(patcher, heads, [0, 12], threshold)
    needed = heads_to_reach(full, threshold)
    assert heads_to_reach(refined, threshold) == needed
    assert refined["heads_kept"].tolist() == list(range(13))
    np.testing.assert_allclose(refined["explained_effect"], full["explained_effect"], atol=1e-6)


# ---- fragile counts: a late jump, an overshoot, a fall back below the threshold ----


def _curve(effects):
    import pandas as pd

    return pd.DataFrame({"heads_kept": np.arange(len(effects)), "explained_effect": effects})


def _late_jump_curve():
    """270 heads: 0.6 from 3 heads to 214, then a climb to 1.3 by 221 heads, 1.0 with all kept
    (the shape of the default IOI figure's SmolLM2 curve)."""
    k = np.arange(271)
    effect = np.where(k < 3, k * 0.2, 0.6 + 0.0002 * (k - 3))
    effect = np.where(k >= 215, np.minimum(0.6 + (k - 214) * 0.1, 1.3), effect)
    effect[-1] = 1.0
    return _curve(effect)


def test_late_jump_and_overshoot_are_flagged_with_their_sizes():
    from attnlab.circuits.curves import fragility

    flags = fragility(_late_jump_curve(), 0.9)
    assert flags["fragile"] and flags["late_jump"] and flags["overshoots"]
    # The foot is 214 heads (0.643, the last point >= 0.25 below 0.9); the crossing 217.
    assert (flags["jump_from_heads"], flags["jump_width_heads"]) == (214, 3)
    assert flags["jump_rise"] == pytest.approx(0.9 - 0.6422)
    assert flags["plateau_heads"] == 211 and flags["plateau_level"] == pytest.approx(0.6422)
    assert flags["overshoot"] == pytest.approx(0.3) and flags["overshoot_at_heads"] == 221
    assert flags["fragile_reasons"] == ["late jump of 0.26 over 3 heads at 217 heads",
                                        "overshoot of 0.30 at 221 heads"]
    assert flags["cross_back_at_heads"] is None


def test_smooth_curve_is_not_fragile():
    """A steady rise to 1 (early steep part included): nothing flagged, its climb still measured."""
    from attnlab.circuits.curves import fragility

    effect = 1 - np.exp(-np.arange(101) / 12.0)
    effect[-1] = 1.0
    flags = fragility(_curve(effect), 0.9)
    assert not flags["fragile"] and flags["fragile_reasons"] == []
    assert not flags["late_jump"] and not flags["overshoots"] and flags["cross_back_min"] is None
    assert flags["jump_width_heads"] > 0 and flags["plateau_heads"] < 0.25 * 100
    # A small overshoot, within the tolerance, is not flagged either.
    assert not fragility(_curve(np.r_[effect[:-1] * 1.05, 1.0]), 0.9)["fragile"]


def test_fall_back_below_the_threshold_is_flagged():
    from attnlab.circuits.curves import fragility

    effect = np.r_[np.linspace(0, 0.95, 11), [0.8, 0.85, 1.0]]
    flags = fragility(_curve(effect), 0.9)
    assert flags["fragile_reasons"] == ["falls back to 0.80 at 11 heads"]
    assert (flags["cross_back_min"], flags["cross_back_at_heads"]) == (pytest.approx(0.8), 11)


def test_pruning_figure_says_fragile_beside_the_ratio(tmp_path, monkeypatch):
    """The N× label names the fragile count and why; the legend and the curve are marked."""
    from attnlab.plots import circuits as plots

    drawn, original = {}, plots._save

    def save(fig, out_path, dpi):  # keep the figure to read it; still saved through the strict text check
        drawn.update(fig=fig)
        original(fig, out_path, dpi)
    monkeypatch.setattr(plots, "_save", save)
    smooth = 1 - np.exp(-np.arange(271) / 8.0)
    smooth[-1] = 1.0
    plots.plot_pruning({"dense": _late_jump_curve(), "sparse": _curve(smooth)}, "ioi", ["dense", "sparse"],
                       0.9, "corrupted", "attribution", tmp_path / "p.png")
    ax = drawn["fig"].axes[0]
    texts = [t.get_text() for t in ax.texts + drawn["fig"].texts]
    assert any(t.replace("\n     ", " ").startswith("11.4× fewer heads for sparse than dense at 0.9\n    (fragile: dense: late jump "
                            "of 0.26 over 3 heads at 217 heads, overshoot of 0.30 at 221 heads)")
               for t in texts), texts
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["dense (217 heads to 0.9; fragile)", "sparse (19 heads to 0.9)"]
    assert any("late jump" in t for t in texts) and any("overshoot +0.30" in t for t in texts)
    assert any("fragile count: late jump" in t.get_text() for t in drawn["fig"].texts)

    # The copy swept on a grid: its count is an upper bound, and the figure says so.
    on_grid = _curve(smooth)
    on_grid = on_grid[on_grid["heads_kept"].isin([0, 5, 10, 15, 16, 17, 18, 19, 20, 40, 270])]
    plots.plot_pruning({"dense": _late_jump_curve(), "sparse": on_grid}, "ioi", ["dense", "sparse"],
                       0.9, "corrupted", "attribution", tmp_path / "p.png")
    ax = drawn["fig"].axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()][1] == "sparse (≤19 heads to 0.9)"
    assert any("≤N: first crossing among the n measured (a log grid refined around it, or a bisection "
               "search) with smaller n unmeasured, an upper bound (sparse)" in " ".join(t.split())
               for t in (t.get_text() for t in drawn["fig"].texts))


def test_heads_vs_density_rows_say_when_their_ratio_is_fragile():
    import pandas as pd

    from attnlab.circuits.curves import flag_fragile_counts, fragility

    table = pd.DataFrame({"label": ["d", "d-sparse"], "base": ["d", "d"], "task": ["ioi", "ioi"],
                          "ablation": ["corrupted", "corrupted"], "heads_to_reach_threshold": [217, 19]})
    smooth = 1 - np.exp(-np.arange(271) / 8.0)
    smooth[-1] = 1.0
    flags = {("d", "ioi", "corrupted"): fragility(_late_jump_curve(), 0.9),
             ("d-sparse", "ioi", "corrupted"): fragility(_curve(smooth), 0.9)}
    out = flag_fragile_counts(table, flags)
    assert out["fragile"].tolist() == [True, False]
    assert out["heads_fewer_fragile"].tolist() == [True, True]  # the copy's N× rests on the base's count
    assert out.loc[0, "fragile_reasons"].startswith("late jump of 0.26") and out.loc[1, "fragile_reasons"] == ""
    assert out.loc[0, "jump_width_heads"] == 3 and out.loc[0, "overshoot"] == pytest.approx(0.3)
