"""post_train: corpus, training, snapshots and calibration, then every output of the copy."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch

from attnlab import io
from attnlab.attention import sparse
from attnlab.sparsify import folder as sparse_folder
from attnlab.sparsify.calibrate import bias_columns, calibrate_gate_bias
from attnlab.sparsify.corpus import Corpus, build_corpus, report_corpus
from attnlab.sparsify.errors import SparsifyError
from attnlab.sparsify.settings import SparsifySettings
from attnlab.sparsify.train import Trainer, TrainState, _describe, _finite, _logits_fit, _stop_on_nan
from attnlab.tokenization import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class Outputs:
    """The rule's outputs (the checkpoint is not one: a killed job leaves it)."""
    model_dir: str
    steps: str
    evals: str
    density: str
    summary: str


@dataclass
class PostTrained:
    """What post-training made: its tables, its summary and the copy at its inference gate bias."""
    steps: pd.DataFrame  # one row per training step
    evals: pd.DataFrame  # held-out evaluations (and one more at a calibrated b')
    density: pd.DataFrame  # per layer x head, at the inference gate bias
    summary: dict
    model: object  # the student, LoRA merged, gated at ``gate_bias``
    tokenizer: object
    gate_bias: sparse.GateBias


@dataclass
class _Run:
    """What the training loop works with."""
    trainer: Trainer
    corpus: Corpus
    references: list | None  # the dense model's held-out logits, when they fit
    tokenizer: object
    checkpoint: Path
    key: str  # the checkpoint's fingerprint


def post_train(base_dir: str, name: str, settings: SparsifySettings | dict, checkpoint: str, device: torch.device,
               on_step: Callable[[int], None] | None = None) -> PostTrained:
    """Post-train the sparse copy of ``base_dir``, resuming from ``checkpoint`` when it is there
    (and writing it every ``checkpoint_every`` steps, snapshots beside it); the caller writes
    what it returns (write_outputs). ``on_step(step)`` runs after each step, e.g. for progress."""
    started = time.perf_counter()
    settings = SparsifySettings.of(settings)
    if settings.snapshot_steps and settings.train == "lora":
        raise SparsifyError("snapshot_steps needs train: all, attention or qk (LoRA adapters are merged "
                            "into the weights only at the end): remove snapshot_steps or change train")
    run = _prepare(base_dir, settings, device, Path(checkpoint))
    state = _resumed_or_new(run, settings)
    final, per_head = _train(run, state, name, settings, on_step)
    evals = [{**row, "gate_bias": settings.gate_bias} for row in state.evals]
    bias, calibration = settings.gate_bias, None
    if settings.calibrate_gate_bias.enabled:
        # calibration text: documents held out of training like the held-out ones
        bias, calibration = calibrate_gate_bias(run.trainer, run.corpus.calibration, settings)
        calibration["at_training_bias"] = {k: final[k] for k in ("ce_sparse", "kl", "density")}
        if bias != settings.gate_bias:  # every held-out number of the copy is at its saved b'
            final, per_head = run.trainer.evaluate(run.corpus.heldout, run.references)
            evals.append({**evals[-1], **final, **bias_columns(bias)})
            log.info("held-out at the calibrated gate bias %s: %s", bias, _describe(final))
    summary = _summary(settings, state, final, run.corpus, device, time.perf_counter() - started,
                       bias, calibration)
    return PostTrained(pd.DataFrame(state.steps), pd.DataFrame(evals), per_head, summary,
                       run.trainer.merged_student(), run.tokenizer, bias)


def write_outputs(result: PostTrained, name: str, settings: SparsifySettings | dict, outputs: Outputs) -> None:
    """The tables, the summary and the copy (the model last: it marks a finished job)."""
    settings = SparsifySettings.of(settings)
    io.write_csv(result.steps, outputs.steps)
    io.write_csv(result.evals, outputs.evals)
    io.write_csv(result.density, outputs.density)
    io.write_json(result.summary, outputs.summary)
    _write_model(result.model, result.tokenizer, name, settings, result.gate_bias, result.summary,
                 outputs.model_dir)


def _prepare(base_dir: str, settings: SparsifySettings, device: torch.device, checkpoint: Path) -> _Run:
    tokenizer = load_tokenizer(base_dir)
    # Calibration documents are held out whether or not calibration runs: the training text is
    # then the same either way (a checkpoint resumes, an uncalibrated copy compares).
    corpus = build_corpus(tokenizer, settings.corpus, settings.seq_len, settings.heldout_sequences,
                          settings.batch_size, settings.seed, settings.calibrate_gate_bias.sequences)
    report_corpus(corpus, settings.steps, settings.batch_size, settings.seq_len)
    trainer = Trainer(base_dir, settings, device)
    # The frozen dense model's held-out logits once for every evaluation, when they fit
    references = trainer.reference_logits(corpus.heldout) if _logits_fit(trainer, corpus.heldout) else None
    return _Run(trainer, corpus, references, tokenizer, checkpoint, settings.fingerprint())


def _resumed_or_new(run: _Run, settings: SparsifySettings) -> TrainState:
    state = run.trainer.load_checkpoint(run.checkpoint, run.key)
    if state is not None:
        log.info("resuming from %s at step %d", run.checkpoint, state.step)
        return state
    state = TrainState(lam=settings.multiplier.init)
    first, _ = run.trainer.evaluate(run.corpus.heldout, run.references)
    state.evals.append({"step": 0, "tokens": 0, **first})
    log.info("before training: %s", _describe(first))
    return state


def _train(run: _Run, state: TrainState, name: str, settings: SparsifySettings, on_step) -> tuple[dict, pd.DataFrame]:
    """The training loop from ``state`` to the last step; the held-out evaluation at the last step."""
    steps, trainer, corpus = settings.steps, run.trainer, run.corpus
    order = np.random.default_rng(settings.seed + 1).permutation(len(corpus.train))
    clock = time.perf_counter()
    final = per_head = None
    while state.step < steps:
        rows = [order[(state.position + i) % len(order)] for i in range(settings.batch_size)]
        row = trainer.step(corpus.train[rows], state)
        if not _finite(row):
            _stop_on_nan(row, state, run.checkpoint)
        state.steps.append(row)
        state.step += 1
        state.position += len(rows)
        if state.step % settings.log_every == 0:
            log.info("step %d: %s", state.step, ", ".join(f"{k} {v:.4g}" for k, v in row.items()
                                                              if k not in ("step",)))
        if state.step % settings.eval_every == 0 or state.step == steps:
            final, per_head = trainer.evaluate(corpus.heldout, run.references)
            state.evals.append({"step": state.step, "tokens": row["tokens"], **final})
            log.info("held-out at step %d: %s", state.step, _describe(final))
        if state.step % settings.checkpoint_every == 0 or state.step == steps:
            state.elapsed_s += time.perf_counter() - clock
            clock = time.perf_counter()
            trainer.save_checkpoint(run.checkpoint, state, run.key)
        if state.step in settings.snapshot_steps:
            _write_snapshot(run, name, settings, state, run.checkpoint.parent / "snapshots" / f"step_{state.step}")
        if on_step:
            on_step(state.step)
    state.elapsed_s += time.perf_counter() - clock
    if final is None:  # resumed after the last step: its evaluation was not kept
        final, per_head = trainer.evaluate(corpus.heldout, run.references)
    return final, per_head


def _write_snapshot(run: _Run, name: str, settings: SparsifySettings, state: TrainState, out_dir: Path) -> None:
    """The copy as it is after ``state.step`` steps, at the training gate bias, with its held-out
    numbers in attnlab_source.json: copies at several densities from one run (for the heads
    needed against density). Not for LoRA (its adapters are merged only at the end)."""
    trainer, corpus = run.trainer, run.corpus
    if not (state.evals and state.evals[-1]["step"] == state.step):
        measured, _ = trainer.evaluate(corpus.heldout, run.references)
        state.evals.append({"step": state.step, "tokens": state.position * settings.seq_len, **measured})
    measured = state.evals[-1]
    summary = {"snapshot_step": state.step, "tokens": measured["tokens"],
               "epochs": corpus.epochs(state.position), "heldout_density": measured["density"],
               "heldout_kl": measured["kl"], "heldout_ce_sparse": measured["ce_sparse"],
               "heldout_ce_dense": measured["ce_dense"], "inference_gate_bias": settings.gate_bias}
    _write_model(trainer.student, run.tokenizer, f"{name}@step{state.step}", settings, settings.gate_bias,
                 summary, str(out_dir))
    log.info("snapshot at step %d: held-out density %.4f, KL %.4f -> %s", state.step, measured["density"],
             measured["kl"], out_dir)


def _summary(settings, state, final, corpus, device, wall, bias, calibration) -> dict:
    return {
        "base": settings.base, "gate_bias": settings.gate_bias, "inference_gate_bias": bias,
        **({"calibration": calibration, "over_budget": calibration["over_budget"]} if calibration else {}),
        "train": settings.train,
        "constraint": dataclasses.asdict(settings.constraint), "steps": state.step,
        "tokens": state.step * settings.batch_size * settings.seq_len,
        "heldout_tokens": int(corpus.heldout.numel()), "corpus": corpus.description,
        "train_sequences": len(corpus.train), "epochs": corpus.epochs(state.position),
        "calibration_tokens": int(corpus.calibration.numel()),
        "heldout_ce_dense": final["ce_dense"], "heldout_ce_sparse": final["ce_sparse"],
        "heldout_kl": final["kl"], "heldout_density": final["density"],
        **({"heldout_ce_control": final["ce_control"]} if "ce_control" in final else {}),
        "final_multiplier": state.lam, "train_s": state.elapsed_s, "wall_s": wall, "device": str(device),
        "tokens_per_s": state.step * settings.batch_size * settings.seq_len / max(state.elapsed_s, 1e-9),
        "definitions": {
            "density": "share of causal (and in-window) query-key edges whose gate is open at inference, "
                       "1[s_ij + b' > 0] with b' the inference gate bias (the training's gate_bias unless "
                       "calibrated; one per layer when calibrated per layer), over every layer and head, on the held-out sequences",
            "kl": "KL(dense || sparse) of the next-token distribution, nats per token, held-out",
            "ce": "next-token cross-entropy, nats per token, held-out",
        },
    }


def _write_model(model, tokenizer, name: str, settings: SparsifySettings, bias: sparse.GateBias, summary: dict,
                 out_dir: str) -> None:
    sparse.make_sparse(model, bias, base=settings.base, training_gate_bias=settings.gate_bias)
    with io.atomic_path(out_dir, directory=True) as tmp:
        model.save_pretrained(tmp)
        sparse_folder.mark(tmp, type(model).__name__)  # plain transformers: gated, or a loud failure
        tokenizer.save_pretrained(tmp)
        provenance = {"name": name, "source": {"sparsify": settings.as_config()}, "summary": summary,
                      "torch": torch.__version__, "transformers": __import__("transformers").__version__}
        (tmp / "attnlab_source.json").write_text(json.dumps(provenance, indent=2, default=str))
    log.info("wrote the sparse model %s to %s", name, out_dir)
