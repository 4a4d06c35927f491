"""Mediation between two prompt conditions (attnlab.mechanism.mediation) against computations written here:
the token map against the prompts' own text, the total effect against two plain forwards, every
head and MLP patched at once against the other run, one head's effect against a hook of its own."""

import numpy as np
import pytest
import torch

from attnlab.interventions.mlp import ArmSettings
from attnlab.mechanism.mediation import AlignmentError, Item, answer_continuation, mediate
from attnlab.reasoning.prompts import PLACEMENTS, build_prompt, insertion_text, random_position
from test_attention import TINY
from test_prompts import CONDITIONS, QUESTIONS, RAW, SYSTEM


def _items(seed: int = 0) -> list[Item]:
    """Three items of different lengths (left padding in a batch), the span inserted at the start,
    inside and near the end, continuations of 3 to 5 tokens."""
    generator = torch.Generator().manual_seed(seed)
    items = []
    for i, (n, inserted, at) in enumerate([(9, 4, 3), (12, 5, 6), (7, 3, 0)]):
        base = torch.randint(3, 101, (n,), generator=generator).tolist()
        span = torch.randint(3, 101, (inserted,), generator=generator).tolist()
        continuation = torch.randint(3, 101, (3 + i,), generator=generator).tolist()
        items.append(Item.of(f"i{i}", base, base[:at] + span + base[at:], (at, at + inserted), continuation))
    return items


def _continuation_logprob(model, prompt: list[int], continuation: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + continuation])).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    return float(sum(logp[len(prompt) - 1 + t, token] for t, token in enumerate(continuation)))


def test_an_item_refuses_a_treated_prompt_that_is_not_its_baseline_plus_the_span():
    with pytest.raises(AlignmentError, match="item x: the treated prompt without its recorded span 1..3"):
        Item.of("x", [5, 6, 7], [5, 9, 9, 6, 8], (1, 3), [4])
    item = Item.of("y", [5, 6, 7], [5, 9, 9, 6, 7], (1, 3), [4, 2])
    assert item.treated_position().tolist() == [0, 3, 4, 5, 6]  # prompt, then the continuation
    assert item.inserted().tolist() == [False, True, True, False, False, False, False]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("condition", ["mless", "mless_q"])
def test_the_token_map_pairs_each_baseline_token_with_its_twin(smollm2_tokenizer, placement, condition):
    """Real prompts (SmolLM2's tokenizer, its chat template) at every placement, with "/" and with
    "?", which the tokenizer merges into longer tokens: each baseline token maps to the same token
    id in the treated prompt, the map is increasing, and it skips exactly the cut span."""
    tok = smollm2_tokenizer
    inserted = insertion_text(tok, CONDITIONS[condition])
    for k, question in enumerate(QUESTIONS):
        position = random_position(question, f"q{k}", seed=0) if placement == "question_random" else None
        treated = build_prompt(tok, "chat", RAW, SYSTEM, inserted, question, placement, position)
        plain = build_prompt(tok, "chat", RAW, SYSTEM, "", question)
        item = Item.of(f"q{k}", plain.input_ids, treated.input_ids, treated.spans["cut"], [7])
        where = item.treated_position()[:len(plain.input_ids)]
        assert [treated.input_ids[q] for q in where] == plain.input_ids
        assert np.all(np.diff(where) > 0)
        skipped = sorted(set(range(len(treated.input_ids))) - set(where.tolist()))
        assert skipped == list(range(*treated.spans["cut"]))


def test_the_continuation_ends_with_the_answer():
    decode = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731 -- one token: one bracketed number
    tokens = [1, 2, 3, 4, 5]
    assert answer_continuation(tokens, decode(tokens), "<3>", decode) == [1, 2, 3]
    assert answer_continuation(tokens, decode(tokens), None, decode) == tokens
    assert answer_continuation(tokens, decode(tokens), "<9>", decode) == tokens


def test_the_continuation_ends_at_the_answers_last_occurrence():
    """An answer the response states twice ("7 ... so 7"): the continuation stops after the token
    that completes its second occurrence, found here by hand (character by character tokens,
    the last "7" at index 9 of "3+4=7 so 7 ."), not after the first."""
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731 -- one token: one character
    response = "3+4=7 so 7 ."
    tokens = [ord(c) for c in response]
    assert response.index("7") == 4 and response.rindex("7") == 9
    assert answer_continuation(tokens, response, "7", decode) == tokens[:10]
    bracketed = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731
    twice = [1, 3, 2, 3, 5]
    assert answer_continuation(twice, bracketed(twice), "<3>", bracketed) == [1, 3, 2, 3]


ARM = ArmSettings(layer=0, c=0.5)  # c 0.5: more units redrawn, so two seeds' effects differ clearly


@pytest.fixture(scope="module")
def llama_mediation():
    model, items = TINY["llama-gqa"](), _items()
    return model, items, mediate(model, items, batch_size=8, arm=ARM, arm_seeds=(0, 1))


def test_the_total_effect_is_the_difference_of_two_plain_forwards(llama_mediation):
    model, items, result = llama_mediation
    for item, row in zip(items, result["totals"].itertuples()):
        want = (_continuation_logprob(model, item.treated, item.continuation)
                - _continuation_logprob(model, item.baseline, item.continuation))
        assert row.total_effect == pytest.approx(want, abs=1e-5)
    assert result["totals"]["total_effect"].abs().max() > 1e-2  # the conditions differ: the check can fail


def test_each_arm_seeds_effect_is_a_forward_under_that_seeds_arm(llama_mediation):
    """ARM on the baseline over seeds 0 and 1: each seed's effect per item is the continuation's
    log-probability of the baseline prompt alone under ARM with that seed, minus without ARM,
    two plain forwards here; the seeds' effects differ, so one seed run twice cannot pass."""
    import dataclasses

    from attnlab.interventions import intervened

    model, items, result = llama_mediation
    arm = result["arm"]
    assert sorted(set(arm["seed"])) == [0, 1] and len(arm) == 2 * len(items)
    for seed in (0, 1):
        got = arm[arm["seed"] == seed].set_index("id")["effect"]
        for item in items:
            with intervened(model, arm=dataclasses.replace(ARM, seed=seed)):
                armed = _continuation_logprob(model, item.baseline, item.continuation)
            want = armed - _continuation_logprob(model, item.baseline, item.continuation)
            assert got[item.id] == pytest.approx(want, abs=1e-5), (seed, item.id)
    by_seed = arm.pivot(index="id", columns="seed", values="effect")
    assert (by_seed[0] - by_seed[1]).abs().max() > 1e-3


def _mixed_sign_effects() -> tuple:
    """(effects, totals) of five items whose total effects change sign (mean 0.262, mean |total|
    1.774); per direction two heads of layer 0, its MLP (random effects) and all_heads_mlps (the
    total itself)."""
    import pandas as pd

    ids = list("abcde")
    total = pd.Series([2.13, -3.31, 1.77, -0.47, 1.19], index=ids)  # no resample of these sums to 0
    rng, rows = np.random.default_rng(7), []
    for direction in ("denoising", "noising"):
        parts = [("L0.H0", "head", 0), ("L0.H1", "head", 1), ("L0.mlp", "mlp", -1)]
        for component, kind, head in parts:
            rows += [{"id": i, "direction": direction, "component": component, "kind": kind, "layer": 0,
                      "head": head, "method": "exact", "members": "", "effect": float(rng.normal())} for i in ids]
        rows += [{"id": i, "direction": direction, "component": "all_heads_mlps", "kind": "group", "layer": -1,
                  "head": -1, "method": "exact", "members": "", "effect": total[i]} for i in ids]
    return pd.DataFrame(rows), total


def test_a_share_is_the_mean_effect_over_the_signed_mean_total(llama_mediation):
    """Totals of mixed sign, so mean |total| is not mean total: each share (and layer 0's heads
    summed) is mean effect / mean total computed here, its interval the 2.5th and 97.5th
    percentiles of that ratio over resamples drawn here (seed 0, 2,000); all heads and MLPs
    together have share 1 in both directions, here and in the tiny Llama's mediation, whose
    totals also change sign."""
    from attnlab.mechanism.mediation.summary import shares

    effects, total = _mixed_sign_effects()
    got = shares(effects, total).set_index(["direction", "component"])
    draws = np.random.default_rng(0).integers(0, 5, size=(2000, 5))
    for (direction, component), frame in effects.groupby(["direction", "component"]):
        values = frame.set_index("id")["effect"][total.index].to_numpy()
        row = got.loc[(direction, component)]
        assert row["share"] == pytest.approx(values.mean() / total.mean(), rel=1e-12), (direction, component)
        ratios = values[draws].mean(1) / total.to_numpy()[draws].mean(1)
        assert [row["share_low"], row["share_high"]] == pytest.approx(np.percentile(ratios, [2.5, 97.5]))
        heads = effects[(effects["direction"] == direction) & (effects["kind"] == "head")]
        summed = heads.groupby("id")["effect"].sum()[total.index].mean() / total.mean()
        assert got.loc[(direction, "L0.heads"), "share"] == pytest.approx(summed, rel=1e-12)
        assert got.loc[(direction, "all_heads_mlps"), "share"] == pytest.approx(1.0, rel=1e-12)
    model_shares = llama_mediation[2]["shares"].set_index(["direction", "component"])["share"]
    totals = llama_mediation[2]["totals"]["total_effect"]
    assert totals.min() < 0 < totals.max()
    for direction in ("denoising", "noising"):
        assert model_shares[(direction, "all_heads_mlps")] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2"])
def test_every_head_and_mlp_at_once_carries_the_whole_effect_where_positions_are_rotary(arch, llama_mediation):
    """Every head's and every MLP's output moved in at every shared token rebuilds the other run's
    residual stream there, so the effect is the total effect, in both directions, to float
    rounding (Llama). GPT-2 adds learned positions to the token embeddings, which no component
    writes: the shared tokens sit at other positions in the two prompts, and that difference stays
    (the documented residual)."""
    model, items, result = llama_mediation if arch == "llama-gqa" else (None, _items(), None)
    if result is None:
        model = TINY["gpt2"]()
        result = mediate(model, items, batch_size=8)
    effects = result["effects"]
    total = result["totals"].set_index("id")["total_effect"]
    for direction in ("denoising", "noising"):
        rows = effects[(effects["direction"] == direction) & (effects["component"] == "all_heads_mlps")]
        gap = (rows.set_index("id")["effect"] - total).abs().max()
        if arch == "llama-gqa":
            assert gap < 1e-5, direction
        else:
            assert gap > 1e-4, direction  # the position embeddings' share, not carried by any component


def _input_of(module, run) -> torch.Tensor:
    """What ``module`` reads (its first argument) while ``run()`` runs: a hook written here."""
    seen = {}
    handle = module.register_forward_pre_hook(lambda m, a: seen.__setitem__("z", a[0].detach().clone()))
    try:
        run()
    finally:
        handle.remove()
    return seen["z"]


def _with_input(module, patch, run):
    """``run()`` with ``module``'s input rewritten in place by ``patch(z)`` (on a copy)."""
    def rewrite(m, args):
        z = args[0].clone()
        patch(z)
        return (z,)
    handle = module.register_forward_pre_hook(rewrite)
    try:
        return run()
    finally:
        handle.remove()


def test_one_heads_effect_equals_a_patch_written_here(llama_mediation):
    """Denoising, layer 1's head 2: each baseline prompt alone, that head's slice of o_proj's input
    replaced at every token by the treated run's at its twin, by hooks written here."""
    model, items, result = llama_mediation
    layer, head, e = 1, 2, model.config.head_dim
    cut = slice(head * e, (head + 1) * e)
    projection = model.model.layers[layer].self_attn.o_proj
    effects = result["effects"]
    got = effects[(effects["direction"] == "denoising") & (effects["component"] == f"L{layer}.H{head}")]
    for item, effect in zip(items, got["effect"]):
        treated = _input_of(projection, lambda: _continuation_logprob(model, item.treated, item.continuation))
        twin = torch.from_numpy(item.treated_position())

        def patch(z):
            z[0, :, cut] = treated[0, twin, cut]
        patched = _with_input(projection, patch, lambda: _continuation_logprob(model, item.baseline, item.continuation))
        want = patched - _continuation_logprob(model, item.baseline, item.continuation)
        assert effect == pytest.approx(want, abs=1e-5)
    assert got["effect"].abs().max() > 1e-4  # the head matters: the comparison can fail


def test_one_heads_noising_effect_equals_a_patch_written_here(llama_mediation):
    """Noising, layer 1's head 2: each treated prompt alone, that head's slice of o_proj's input
    replaced at every token with a twin (all but the inserted span) by the baseline run's at that
    twin, by hooks written here; the effect, signed treated − baseline, is M(treated) − M(patched)."""
    model, items, result = llama_mediation
    layer, head, e = 1, 2, model.config.head_dim
    cut = slice(head * e, (head + 1) * e)
    projection = model.model.layers[layer].self_attn.o_proj
    effects = result["effects"]
    got = effects[(effects["direction"] == "noising") & (effects["component"] == f"L{layer}.H{head}")]
    for item, effect in zip(items, got["effect"]):
        baseline = _input_of(projection, lambda: _continuation_logprob(model, item.baseline, item.continuation))
        twin = torch.from_numpy(item.treated_position())  # baseline token p is treated token twin[p]

        def patch(z):
            z[0, twin, cut] = baseline[0, :, cut]
        patched = _with_input(projection, patch, lambda: _continuation_logprob(model, item.treated, item.continuation))
        want = _continuation_logprob(model, item.treated, item.continuation) - patched
        assert effect == pytest.approx(want, abs=1e-5)
    assert got["effect"].abs().max() > 1e-4  # the head matters: a flipped sign cannot pass


def _gated_logprob(model, item: Item, heads: list[tuple[int, int]], gate: torch.Tensor) -> torch.Tensor:
    """The baseline sequence's continuation log-probability, the slices of ``heads`` (layer, head)
    of o_proj's input set to twin + gate · (own − twin), twin: the treated run's at the same token
    (gate 0: patched, 1: untouched), by hooks written here."""
    e = model.config.head_dim
    layers = sorted({layer for layer, _ in heads})
    seen, handles = {}, []
    for layer in layers:
        projection = model.model.layers[layer].self_attn.o_proj
        handles.append(projection.register_forward_pre_hook(
            lambda m, a, layer=layer: seen.__setitem__(layer, a[0].detach().clone())))
    _continuation_logprob(model, item.treated, item.continuation)
    for handle in handles:
        handle.remove()
    twin = torch.from_numpy(item.treated_position())[:len(item.baseline) + len(item.continuation)]

    def patch(layer):
        def hook(module, args):
            z = args[0].clone()
            for at, head in heads:
                if at == layer:
                    cut = slice(head * e, (head + 1) * e)
                    source = seen[layer][0, twin, cut]
                    z[0, :, cut] = (source + gate.to(z.dtype) * (args[0][0, :, cut] - source))
            return (z,)
        return hook
    handles = [model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(patch(layer)) for layer in layers]
    logits = model(torch.tensor([item.baseline + item.continuation])).logits[0].double()
    for handle in handles:
        handle.remove()
    logp = torch.log_softmax(logits, -1)
    n = len(item.baseline)
    return sum(logp[n - 1 + t, token] for t, token in enumerate(item.continuation))


@pytest.fixture(scope="module")
def llama_attribution():
    model, items = TINY["llama-gqa"](), _items()
    return model, items, mediate(model, items, batch_size=8, heads_method="attribution", layers=[1])


def test_attributed_head_effects_are_each_items_gradient_times_the_patch(llama_attribution):
    """Denoising, layer 1's head 2, by attribution: −d M / d gate at gate 1 per item (the patch
    moves the gate from 1 to 0), the gradient taken here through hooks of this test."""
    model, items, result = llama_attribution
    effects = result["effects"]
    got = effects[(effects["direction"] == "denoising") & (effects["component"] == "L1.H2")]
    assert set(got["method"]) == {"attribution"}
    for item, effect in zip(items, got["effect"]):
        gate = torch.ones((), dtype=torch.float64, requires_grad=True)
        _gated_logprob(model, item, [(1, 2)], gate).backward()
        assert effect == pytest.approx(-float(gate.grad), abs=1e-6)
    assert got["effect"].abs().max() > 1e-4


def test_the_top_heads_are_patched_together_exactly(llama_attribution):
    """The group ``top10_heads``: its heads are the 10 of largest mean effect in the total
    effect's direction, and its effect is their joint patch written here (not a sum of single-head
    effects); only the layers asked for (and layer 0) have their MLP and residual stream patched;
    the total effect's interval holds its mean."""
    model, items, result = llama_attribution
    effects = result["effects"]
    denoising = effects[effects["direction"] == "denoising"]
    sign = np.sign(result["totals"]["total_effect"].mean())
    means = denoising[denoising["kind"] == "head"].groupby("component")["effect"].mean() * sign
    group = denoising[denoising["component"] == "top10_heads"]
    members = group["members"].iloc[0].split(",")
    assert set(members) == set(means.sort_values(ascending=False).index[:10])
    heads = [(int(m[1:].split(".H")[0]), int(m.split(".H")[1])) for m in members]
    with torch.no_grad():
        for item, effect in zip(items, group["effect"]):
            want = (_gated_logprob(model, item, heads, torch.zeros((), dtype=torch.float64))
                    - _continuation_logprob(model, item.baseline, item.continuation))
            assert effect == pytest.approx(float(want), abs=1e-5)
    assert set(effects.loc[effects["kind"].isin(["mlp", "residual"]), "layer"]) == {0, 1}
    top = result["top_heads"]
    assert set(top["direction"]) == {"denoising", "noising"} and top["heads"].iloc[0] == group["members"].iloc[0]
    low, high = result["total_interval"]
    assert low < result["totals"]["total_effect"].mean() < high


def test_max_items_takes_items_evenly_spaced_over_the_file():
    """Generated datasets are ordered by their operands: a cap takes items from all of it."""
    import pandas as pd
    from attnlab.mechanism.mediation import items_from_tables
    ids = [f"q{i}" for i in range(10)]
    baseline = pd.DataFrame({"id": ids, "input_ids": [[1, 2, 3]] * 10})
    treated = pd.DataFrame({"id": ids, "input_ids": [[1, 9, 2, 3]] * 10, "cut_start": 1, "cut_end": 2})
    generations = pd.DataFrame({"id": ids, "new_token_ids": [[5, 6]] * 10, "response": ["56"] * 10})
    grades = pd.DataFrame({"id": ids, "pred": ["56"] * 10})
    decode = lambda tokens: "".join(str(t) for t in tokens)  # noqa: E731
    picked = items_from_tables(baseline, treated, generations, grades, decode, max_items=4)
    assert [item.id for item in picked] == ["q0", "q3", "q6", "q9"]
    assert len(items_from_tables(baseline, treated, generations, grades, decode)) == 10


def test_a_second_configs_mediation_table_names_its_config_and_logs_the_rows_it_drops(tmp_path, caplog):
    """As the accuracy table: each row says which config it holds, and a second config's run names
    in its log every row of the first's it no longer holds."""
    import logging

    import pandas as pd

    from attnlab import io, steps

    def summary(condition):
        shares = [{"direction": d, "component": c, "share": 0.5, "share_low": 0.1, "share_high": 0.9}
                  for d in ("denoising", "noising") for c in ("L0.attention", "L0.mlp", "all_heads_mlps")]
        top = [{"direction": d, "heads": "L0.H0", "share": 0.5, "share_low": 0.1, "share_high": 0.9}
               for d in ("denoising", "noising")]
        path = tmp_path / f"{condition}.json"
        io.write_json({"model": "m", "dataset": "d", "condition": condition, "baseline": "none", "items": 4,
                       "total_effect_mean": 1.0, "total_effect_low": 0.5, "total_effect_high": 1.5,
                       "heads_method": "attribution", "shares": shares, "top_heads": top, "arm": {}}, path)
        return str(path)
    table = tmp_path / "mediation.csv"
    steps.mediation_table([summary("mless"), summary("mless_q")], str(table), config="mechanism")
    with caplog.at_level(logging.WARNING, logger="attnlab"):
        steps.mediation_table([summary("mless")], str(table), config="other")
    rows = pd.read_csv(table)
    assert set(rows["config"]) == {"other"} and len(rows) == 2  # one condition, two directions
    assert "no longer holds the row {'model': 'm', 'dataset': 'd', 'condition': 'mless_q', 'direction': 'denoising'}" in caplog.text
    assert "(config mechanism)" in caplog.text
