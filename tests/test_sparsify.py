"""Sparse post-training on a tiny model (docs/sparsify.md): what a run writes, reloading, resuming,
the gate-bias calibration (global and per layer). The tiny model and its trained copy are the
session's fixtures (tests/sparse_tiny.py, conftest.py)."""

import json
import math
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from attnlab import interventions, sparsify
from attnlab.attention import sparse
from attnlab.extraction.extract import extract
from attnlab.interventions import intervened
from test_attention import _prompts, _reference
from sparse_tiny import PER_LAYER_OFF, post_train_tiny, tiny_settings


def test_checkpoint_fingerprint_covers_exactly_the_fields_that_shape_training(tmp_path):
    import dataclasses
    import hashlib

    config = tiny_settings(tmp_path / "corpus.jsonl")
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
    # an attention named here: the copy's config names one plain transformers refuses (issue 67)
    plain = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32, attn_implementation="eager").eval()
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
        post_train_tiny(base, tiny_settings(corpus), tmp_path, on_step=kill_after_step_3)
    assert (tmp_path / "ckpt.pt").is_file() and not (tmp_path / "model").exists()
    post_train_tiny(base, tiny_settings(corpus), tmp_path)
    resumed = load_file(tmp_path / "model" / "model.safetensors")
    uninterrupted = load_file(folder / "model" / "model.safetensors")
    assert resumed.keys() == uninterrupted.keys()
    for name in resumed:
        assert torch.equal(resumed[name], uninterrupted[name]), name
    assert pd.read_csv(tmp_path / "steps.csv").equals(pd.read_csv(folder / "steps.csv"))


class _RunsCodeOnLoad:
    """Unpickled, it writes ``marker``: what a planted checkpoint could do to the job that resumes."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_a_checkpoint_that_would_run_code_is_refused_naming_its_file_and_nothing_runs(tmp_path):
    from attnlab.sparsify.errors import SparsifyError
    from attnlab.sparsify.train import read_checkpoint

    marker, planted = tmp_path / "ran.txt", tmp_path / "ckpt.pt"
    torch.save({"fingerprint": "x", "state": {}, "student": {}, "optimizer": {}, "generator": torch.zeros(3),
                "extra": _RunsCodeOnLoad(marker)}, planted)
    with pytest.raises(SparsifyError, match=rf"{planted} is not a post-training checkpoint attnlab wrote") as refused:
        read_checkpoint(planted)
    assert not marker.exists()
    assert "Unsupported global: GLOBAL exec" in str(refused.value) and "\x1b" not in str(refused.value)
    torch.load(planted, weights_only=False)  # the control: unpickled in full, the file runs its code
    assert marker.read_text() == "ran"
    foreign = tmp_path / "other.pt"
    torch.save({"model": torch.zeros(2)}, foreign)  # tensors alone, but not our checkpoint's keys
    with pytest.raises(SparsifyError, match=rf"{foreign} .* holds \['model'\], not \['fingerprint'"):
        read_checkpoint(foreign)


def test_calibration_keeps_the_lowest_gate_bias_within_the_kl_limit(trained, tiny_base, tmp_path):
    base, corpus = tiny_base
    folder, summary = trained
    shutil.copy(folder / "ckpt.pt", tmp_path / "ckpt.pt")  # calibration does not retrain
    wide = {"enabled": True, "max_kl": 2.0, "step": 0.5, "lowest": -1.0, "sequences": 32,
            "per_layer": PER_LAYER_OFF}
    first = post_train_tiny(base, tiny_settings(corpus, calibrate_gate_bias=wide), tmp_path)
    grid = first["calibration"]["grid"]
    assert [row["gate_bias"] for row in grid] == [1.0, 0.5, 0.0, -0.5, -1.0]
    assert grid[0]["density"] > grid[-1]["density"]
    limit = (grid[0]["kl"] + max(row["kl"] for row in grid)) / 2  # b = 1 within, some b' over it
    over = next(k for k, row in enumerate(grid) if row["kl"] > limit)
    chosen = grid[over - 1]["gate_bias"]  # the last b' before the first one over the limit
    calibrated = post_train_tiny(base, tiny_settings(corpus, calibrate_gate_bias={**wide, "max_kl": limit}), tmp_path)
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
    from attnlab.plots.sparsify import plot_sparse_training

    base, corpus = tiny_base
    folder, summary = trained
    shutil.copy(folder / "ckpt.pt", tmp_path / "ckpt.pt")
    tight = {"enabled": True, "max_kl": 1e-9, "step": 0.5, "lowest": -1.0, "sequences": 32,
             "per_layer": PER_LAYER_OFF}
    with caplog.at_level("WARNING"):
        over = post_train_tiny(base, tiny_settings(corpus, calibrate_gate_bias=tight), tmp_path)
    assert over["over_budget"] is True and over["inference_gate_bias"] == 1.0
    assert "over max_kl" in caplog.text and "saved over its KL budget" in caplog.text
    from attnlab.plots import sparsify as plots_circuits

    drawn, original = {}, plots_circuits._save

    def save(fig, out_path, dpi):  # keep the figure to read it; still saved through the strict text check
        drawn.update(fig=fig)
        original(fig, out_path, dpi)
    monkeypatch.setattr(plots_circuits, "_save", save)
    plot_sparse_training(pd.read_csv(tmp_path / "steps.csv"), pd.read_csv(tmp_path / "eval.csv"), over,
                         "copy", tmp_path / "training.png")
    assert "OVER BUDGET" in drawn["fig"]._suptitle.get_text()


def test_per_layer_calibration_saves_one_bias_per_layer(trained, tiny_base, tmp_path):
    base, corpus = tiny_base
    folder, _ = trained
    shutil.copy(folder / "ckpt.pt", tmp_path / "ckpt.pt")  # calibration does not retrain
    per_layer = {"enabled": True, "step": 0.5, "rounds": 2, "sensitivity_sequences": 2}
    # a global step of 5 keeps b' = 1 globally; no KL over 2 nats: the layers that close edges go lower
    options = {"enabled": True, "max_kl": 2.0, "step": 5.0, "lowest": -1.5, "sequences": 32, "per_layer": per_layer}
    summary = post_train_tiny(base, tiny_settings(corpus, calibrate_gate_bias=options), tmp_path)
    biases = summary["inference_gate_bias"]
    assert [row["gate_bias"] for row in summary["calibration"]["grid"]] == [1.0]
    assert biases == summary["calibration"]["per_layer"]["gate_bias"] and min(biases) == 0.0
    # the saved copy carries one bias per layer; reloaded, its gates reproduce the held-out density
    config = json.loads((tmp_path / "model" / "config.json").read_text())[sparse.CONFIG_KEY]
    assert config["gate_bias"] == biases and config["training_gate_bias"] == 1.0
    from attnlab.models import load_model
    from attnlab.tokenization import load_tokenizer

    model = load_model(str(tmp_path / "model"), torch.device("cpu"), torch.float32)
    heldout = sparsify.build_corpus(load_tokenizer(str(base)), tiny_settings(corpus)["corpus"], 16, 4, 2, 0).heldout
    tracker = sparse.GateTracker()
    with torch.no_grad(), intervened(model, gates=tracker):
        model(input_ids=heldout, use_cache=False)
    assert tracker.inference_density() == pytest.approx(summary["heldout_density"])
    evals = pd.read_csv(tmp_path / "eval.csv")
    assert math.isnan(evals["gate_bias"].iloc[-1])
    assert evals["gate_bias_per_layer"].iloc[-1] == " ".join(f"{b:g}" for b in biases)
    from attnlab.plots import sparsify as plots  # the figures name a per-layer bias

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
