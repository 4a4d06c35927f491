"""post_train: corpus, training, snapshots and calibration, then every output of the copy."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd
import torch

from attnlab import io
from attnlab.attention import sparse
from attnlab.attention import saved_copy
from attnlab.sparsify.calibrate import bias_columns, calibrate_gate_bias
from attnlab.sparsify.corpus import Corpus, build_corpus, report_corpus
from attnlab.sparsify.errors import SparsifyError
from attnlab.sparsify.heldout import Evaluation, HeldOut, ce_bound
from attnlab.sparsify.settings import SparsifySettings
from attnlab.sparsify.train import Trainer, TrainState, all_finite, describe_numbers, stop_on_nan
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
    control: object | None = None  # constraint ce_control: the dense control, fine-tuned alike (LoRA merged)


@dataclass
class _Run:
    """What the training loop works with."""
    trainer: Trainer
    corpus: Corpus
    heldout: HeldOut  # each source's held-out sequences (and the dense model's logits on them)
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
    final = _train(run, state, name, settings, on_step)
    evals = [{**row, "gate_bias": settings.gate_bias} for row in state.evals]
    bias, calibration = settings.gate_bias, None
    if settings.calibrate_gate_bias.enabled:
        # calibration text: documents held out of training like the held-out ones
        bias, calibration = calibrate_gate_bias(run.trainer, run.corpus.calibration, settings)
        # on the held-out text, its KL from what the calibration's is from (the control under ce_control)
        kl = "kl_vs_control" if "kl_vs_control" in final.overall else "kl"
        calibration["at_training_bias"] = {"ce_sparse": final.overall["ce_sparse"], "kl": final.overall[kl],
                                           "kl_from": calibration["kl_from"], "density": final.overall["density"],
                                           "text": "held-out"}
        if bias != settings.gate_bias:  # every held-out number of the copy is at its saved b'
            final = run.heldout.measure()
            evals.append({**evals[-1], **final.row(), **bias_columns(bias)})
            log.info("held-out at the calibrated gate bias %s: %s", bias, describe_numbers(final.overall))
    summary = _summary(settings, state, final, run.corpus, device, time.perf_counter() - started,
                       bias, calibration)
    return PostTrained(pd.DataFrame(state.steps), pd.DataFrame(evals), final.per_head, summary,
                       run.trainer.merged_student(), run.tokenizer, bias, run.trainer.merged_control())


def write_outputs(result: PostTrained, name: str, settings: SparsifySettings | dict, outputs: Outputs) -> None:
    """The tables, the summary and the copy (the model last: it marks a finished job)."""
    settings = SparsifySettings.of(settings)
    io.write_csv(result.steps, outputs.steps)
    io.write_csv(result.evals, outputs.evals)
    io.write_csv(result.density, outputs.density)
    io.write_json(result.summary, outputs.summary)
    _write_model(result.model, result.tokenizer, name, settings, result.gate_bias, result.summary,
                 outputs.model_dir)


def write_control(result: PostTrained, name: str, out_dir: str) -> bool:
    """The dense control of a ce_control run (fine-tuned on the copy's batches, no gates) as a plain
    model folder: the model to compare the copy's circuits with, when the fine-tuning itself moved
    the model away from its base (its held-out KL from the base: summary.json). False when the run
    has no control."""
    if result.control is None:
        return False
    with io.atomic_path(out_dir, directory=True) as tmp:
        result.control.save_pretrained(tmp)
        result.tokenizer.save_pretrained(tmp)
        provenance = {"name": f"{name} control", "dense_control_of": name,
                      "what": "the base fine-tuned densely on the sparse copy's batches with its optimiser and budget "
                              "(constraint ce_control); no gates",
                      "heldout_ce_control": result.summary.get("heldout_ce_control"),
                      "heldout_kl_control": result.summary.get("heldout_kl_control"),
                      "torch": torch.__version__, "transformers": __import__("transformers").__version__}
        (tmp / "attnlab_source.json").write_text(json.dumps(provenance, indent=2, default=str))
    log.info("wrote the dense control of %s to %s", name, out_dir)
    return True


def _prepare(base_dir: str, settings: SparsifySettings, device: torch.device, checkpoint: Path) -> _Run:
    tokenizer = load_tokenizer(base_dir)
    # Calibration documents are held out whether or not calibration runs: the training text is
    # then the same either way (a checkpoint resumes, an uncalibrated copy compares).
    corpus = build_corpus(tokenizer, settings.corpus, settings.seq_len, settings.heldout_sequences,
                          settings.batch_size, settings.seed, settings.calibrate_gate_bias.sequences)
    report_corpus(corpus, settings.steps, settings.batch_size, settings.seq_len)
    trainer = Trainer(base_dir, settings, device)
    return _Run(trainer, corpus, HeldOut(trainer, corpus), tokenizer, checkpoint, _resume_key(settings, corpus))


def _resume_key(settings: SparsifySettings, corpus) -> str:
    """The settings' fingerprint and what identifies the text each source read (file digests, the
    Python version of a standard-library source): a checkpoint made on other text never resumes."""
    def digests(value):  # where a file lies (another clone, another venv) changes no text: its digest counts
        if not isinstance(value, dict):
            return value
        return {k: digests(v) for k, v in value.items() if k not in ("file", "stdlib")}
    read = json.dumps([digests(source.provenance) for source in corpus.sources], sort_keys=True, default=str)
    return f"{settings.fingerprint()}-{hashlib.sha256(read.encode()).hexdigest()[:16]}"


def _resumed_or_new(run: _Run, settings: SparsifySettings) -> TrainState:
    state = run.trainer.load_checkpoint(run.checkpoint, run.key)
    if state is not None:
        log.info("resuming from %s at step %d", run.checkpoint, state.step)
        return state
    state = TrainState(lam=settings.multiplier.init)
    first = run.heldout.measure()
    state.evals.append({"step": 0, "tokens": 0, **first.row()})
    # the base's held-out CE on each kind of text: what a ce constraint holds the copy to
    state.base_ce = {name: measured["ce_dense"] for name, measured in first.by_source.items()}
    log.info("before training: %s", describe_numbers(first.overall))
    return state


def _train(run: _Run, state: TrainState, name: str, settings: SparsifySettings, on_step) -> Evaluation:
    """The training loop from ``state`` to the last step; the held-out evaluation at the last step."""
    steps, trainer, corpus = settings.steps, run.trainer, run.corpus
    names = [source.name for source in corpus.sources]
    clock = time.perf_counter()
    final = None
    while state.step < steps:
        ids, sources = corpus.training_batch(state.position, settings.batch_size)
        bound = (ce_bound(state.base_ce, names, sources, settings.constraint.slack)
                 if settings.constraint.type == "ce" else None)
        row = trainer.step(ids, state, bound)
        if not all_finite(row):
            stop_on_nan(row, state, run.checkpoint)
        state.steps.append(row)
        state.step += 1
        state.position += len(ids)
        if state.step % settings.log_every == 0:
            log.info("step %d: %s", state.step, ", ".join(f"{k} {v:.4g}" for k, v in row.items()
                                                              if k not in ("step",)))
        if state.step % settings.eval_every == 0 or state.step == steps:
            final = run.heldout.measure()
            state.evals.append({"step": state.step, "tokens": row["tokens"], **final.row()})
            log.info("held-out at step %d: %s", state.step, describe_numbers(final.overall))
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
        final = run.heldout.measure()
    return final


def _write_snapshot(run: _Run, name: str, settings: SparsifySettings, state: TrainState, out_dir: Path) -> None:
    """The copy as it is after ``state.step`` steps, at the training gate bias, with its held-out
    numbers in attnlab_source.json: copies at several densities from one run (for the heads
    needed against density). Not for LoRA (its adapters are merged only at the end)."""
    trainer, corpus = run.trainer, run.corpus
    if not (state.evals and state.evals[-1]["step"] == state.step):
        state.evals.append({"step": state.step, "tokens": state.position * settings.seq_len,
                            **run.heldout.measure().row()})
    measured = state.evals[-1]
    summary = {"snapshot_step": state.step, "tokens": measured["tokens"],
               "epochs": corpus.epochs(state.position), "heldout_density": measured["density"],
               "heldout_kl": measured["kl"], "heldout_ce_sparse": measured["ce_sparse"],
               "heldout_ce_dense": measured["ce_dense"], "inference_gate_bias": settings.gate_bias}
    _write_model(trainer.student, run.tokenizer, f"{name}@step{state.step}", settings, settings.gate_bias,
                 summary, str(out_dir))
    log.info("snapshot at step %d: held-out density %.4f, KL %.4f -> %s", state.step, measured["density"],
             measured["kl"], out_dir)


def _summary(settings, state, final: Evaluation, corpus: Corpus, device, wall, bias, calibration) -> dict:
    overall = final.overall
    return {
        "base": settings.base, "gate_bias": settings.gate_bias, "inference_gate_bias": bias,
        **({"calibration": calibration, "over_budget": calibration["over_budget"]} if calibration else {}),
        "train": settings.train, "gate_gradient": settings.gate_gradient,
        "constraint": dataclasses.asdict(settings.constraint), "steps": state.step,
        **({"ce_bound_by_source": {name: ce + settings.constraint.slack for name, ce in state.base_ce.items()}}
           if settings.constraint.type == "ce" and state.base_ce else {}),
        "tokens": state.step * settings.batch_size * settings.seq_len,
        "heldout_tokens": int(corpus.heldout.numel()), "corpus": corpus.description,
        "train_sequences": len(corpus.train), "epochs": corpus.epochs(state.position),
        "calibration_tokens": int(corpus.calibration.numel()),
        "heldout_ce_dense": overall["ce_dense"], "heldout_ce_sparse": overall["ce_sparse"],
        "heldout_kl": overall["kl"], "heldout_density": overall["density"],
        **({"heldout_ce_control": overall["ce_control"], "heldout_kl_control": overall["kl_control"]}
           if "ce_control" in overall else {}),
        "heldout_by_source": _by_source(final, corpus, state),
        "final_multiplier": state.lam, "train_s": state.elapsed_s, "wall_s": wall, "device": str(device),
        "tokens_per_s": state.step * settings.batch_size * settings.seq_len / max(state.elapsed_s, 1e-9),
        "definitions": {
            "density": "share of causal (and in-window) query-key edges whose gate is open at inference, "
                       "1[s_ij + b' > 0] with b' the inference gate bias (the training's gate_bias unless "
                       "calibrated; one per layer when calibrated per layer), over every layer and head, on the "
                       "held-out sequences of each source; the mixture's is the sources' weighted by their weights",
            "kl": "KL(dense || sparse) of the next-token distribution, nats per token, held-out; the mixture's "
                  "weighted by the sources' weights",
            "ce": "next-token cross-entropy, nats per token, held-out; the mixture's weighted likewise",
            "kl_control": "constraint ce_control: KL(dense || control), the dense control fine-tuned on the same "
                          "batches: what the fine-tuning alone moves the model from its base",
            "ce_bound": "constraint ce: a training batch's CE is held to the mean over its sequences of the "
                        "base model's held-out CE on that sequence's source, plus the slack",
        },
    }


def _by_source(final: Evaluation, corpus: Corpus, state: TrainState) -> dict:
    """Each source's held-out numbers, weight, sequences, epochs and what identifies its text."""
    epochs = corpus.epochs_by_source(state.position)
    return {source.name: {**final.by_source[source.name], "weight": source.weight,
                          "heldout_sequences": len(source.heldout), "calibration_sequences": len(source.calibration),
                          "train_sequences": len(source.train), "epochs": epochs[source.name],
                          "description": source.description, "provenance": source.provenance}
            for source in corpus.sources}


def _write_model(model, tokenizer, name: str, settings: SparsifySettings, bias: sparse.GateBias, summary: dict,
                 out_dir: str) -> None:
    sparse.make_sparse(model, bias, base=settings.base, training_gate_bias=settings.gate_bias)
    with io.atomic_path(out_dir, directory=True) as tmp:
        model.save_pretrained(tmp)
        saved_copy.mark(tmp, type(model).__name__)  # plain transformers refuses it, saying how to open it
        saved_copy.write_card(tmp, name, {"base": settings.base, **summary})
        tokenizer.save_pretrained(tmp)
        provenance = {"name": name, "source": {"sparsify": settings.as_config()}, "summary": summary,
                      "torch": torch.__version__, "transformers": __import__("transformers").__version__}
        (tmp / "attnlab_source.json").write_text(json.dumps(provenance, indent=2, default=str))
    log.info("wrote the sparse model %s to %s", name, out_dir)
