"""The trainer: the gated student, its frozen dense reference (and dense control), the
optimiser, the GECO multiplier and checkpoints (held-out evaluation: ``heldout``; docs/sparsify.md)."""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from attnlab import anatomy, interventions, io
from attnlab.attention import sparse
from attnlab.interventions import intervened
from attnlab.models import enable_activation_checkpointing, load_model
from attnlab.sparsify import losses
from attnlab.sparsify.errors import SparsifyError
from attnlab.sparsify.settings import SparsifySettings

log = logging.getLogger(__name__)

# the attention projections each ``train`` setting trains (anatomy parts: a family's own modules)
TRAINED_PARTS = {"qk": ("q", "k"), "attention": ("q", "k", "v", "o")}


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
    """Names of the parameters that train: all, attention q/k only, or attention projections
    (their modules from the model's anatomy; GPT-2's q, k and v share one c_attn, so ``qk``
    cannot train q and k alone there)."""
    parts = anatomy.of(model, stages=("sparse post-training",))
    if train == "all":
        chosen = None
    else:
        wanted = TRAINED_PARTS[train]
        if parts.family.fused_qkv and train == "qk":
            raise SparsifyError(f"train: qk trains the query and key projections alone, but {parts.family.name}'s "
                                "query, key and value share one projection (c_attn): set train to attention, all "
                                "or lora")
        which = [w for w in parts.family.projections if w in wanted or w == "qkv"]  # qk with a fused qkv: refused
        chosen = {id(p) for layer in range(parts.n_layers) for w in which
                  for p in parts.projection(layer, w).parameters()}
    names = []
    for name, parameter in model.named_parameters():
        keep = chosen is None or id(parameter) in chosen
        parameter.requires_grad_(keep)
        if keep:
            names.append(name)
    if not names:
        raise SparsifyError(f"train: '{train}' selects no parameter of this model")
    return names


def lora_targets(model, modules) -> list[str]:
    """peft target modules: each of ``modules`` that names an attention part (q, k, v, o) as the
    family's own module (GPT-2: attn.c_attn for q, k and v, attn.c_proj for o); other names as
    they are (peft matches them against module names' ends)."""
    parts = anatomy.of(model, stages=("sparse post-training",))
    targets = []
    for name in modules:
        if name in ("q", "k", "v", "o"):
            which = "qkv" if parts.family.fused_qkv and name != "o" else name
            name = parts.module_names((which,))[0]
        if name not in targets:
            targets.append(name)
    return targets


def with_lora(model, lora: dict):
    """Wrap ``model`` with LoRA adapters (peft) on the configured modules."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,
                        target_modules=lora_targets(model, lora.modules), bias="none")
    return get_peft_model(model, config)


@dataclass
class TrainState:
    step: int = 0
    position: int = 0  # training sequences consumed
    lam: float = 1.0
    c_ema: float | None = None
    steps: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    elapsed_s: float = 0.0
    base_ce: dict | None = None  # the base's held-out CE per corpus source, before training (the ce bound)


def update_multiplier(state: TrainState, constraint: float, slack: float, multiplier: dict) -> None:
    """GECO step: C_ema <- a C_ema + (1 - a) C; lambda <- clip(lambda exp(lr clip(C_ema / slack, -1, 1)))."""
    alpha = multiplier.ema
    state.c_ema = constraint if state.c_ema is None else alpha * state.c_ema + (1 - alpha) * constraint
    # The violation relative to the slack, clipped to +-1: a step moves lambda by at most a
    # factor exp(lr) either way. With the raw C, a violation of several slacks raised lambda
    # far faster than a met constraint (C >= -slack) could ever lower it.
    relative = max(-1.0, min(1.0, state.c_ema / slack))
    lam = state.lam * math.exp(multiplier.lr * relative)
    state.lam = float(min(max(lam, multiplier.min), multiplier.max))


def learning_rate(settings: SparsifySettings, step: int) -> float:
    """The learning rate of optimiser step ``step`` (0-based): linear warm-up, then constant or
    a cosine decay that reaches 0 after the last step. Adam moves every weight by about the
    learning rate per step, whatever the size of its gradient, so at a constant rate the
    weights keep drifting (and costing KL) however well the constraint holds; the decay
    lets the last steps settle."""
    warmup, steps = settings.warmup_steps, settings.steps
    rate = settings.lr * min(1.0, (step + 1) / max(1, warmup))
    if settings.lr_schedule == "cosine" and step >= warmup:
        rate *= 0.5 * (1 + math.cos(math.pi * (step - warmup + 1) / (steps - warmup + 1)))
    return rate


def _trainable_copy(base_dir: str, dtype: torch.dtype, device: torch.device):
    """The base model as a copy to train, built with its family's dropout fields at 0 (the log says
    which fields, and what they were)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_dir)
    before = anatomy.families.dropout_off(config)
    log.info("dropout off for training, through the family's config fields: %s",
             ", ".join(f"{name} {value:g} -> 0" for name, value in before.items()))
    return AutoModelForCausalLM.from_pretrained(base_dir, config=config, dtype=dtype).to(device)


def autocast_for(device: torch.device, dtype: str, training: bool = True):
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

    def __init__(self, base_dir: str, settings: SparsifySettings, device: torch.device):
        settings = self.settings = SparsifySettings.of(settings)
        self.device = device
        torch.manual_seed(settings.seed)
        # Frozen weights (the KL reference; the base under LoRA) in bfloat16 on GPUs: a 7B
        # model then fits twice; weights that train stay float32.
        frozen = torch.bfloat16 if device.type == "cuda" else torch.float32
        lora = settings.train == "lora"
        self.dense = load_model(base_dir, device, frozen).requires_grad_(False)
        if sparse.is_sparse(self.dense):
            raise SparsifyError(f"base model {base_dir} is itself sparse: sparsify a dense model")
        student = _trainable_copy(base_dir, frozen if lora else torch.float32, device)
        sparse.make_sparse(student, settings.gate_bias, base=settings.base)
        if settings.gradient_checkpointing:
            # the recomputation in the backward pass replays the forward's gates (intervened)
            enable_activation_checkpointing(student, {"use_reentrant": False,
                                                      "context_fn": interventions.recompute_context})
            student.config.use_cache = False
        self.student = self._trainable(student).train()
        self.optimizer = self._optimizer(self.student)
        self.control = self.control_optimizer = None
        if settings.constraint.type == "ce_control":
            # The dense control trains the same weights (or adapters) on the same batches.
            control = _trainable_copy(base_dir, frozen if lora else torch.float32, device)
            self.control = self._trainable(control).train()
            self.control_optimizer = self._optimizer(self.control)
        self.generator = torch.Generator(device=device).manual_seed(settings.seed)
        # the fused kernels' per-layer seeds come from a host generator: a draw from a CUDA one
        # waits for every queued kernel (sparse.GateTracker.layer_seed)
        self.seed_generator = torch.Generator().manual_seed(settings.seed)

    def _trainable(self, model):
        """The model with only the configured weights trainable (LoRA: wrapped with adapters)."""
        if self.settings.train == "lora":
            model.requires_grad_(False)
            return with_lora(model, self.settings.lora)
        trainable_parameters(model, self.settings.train)
        return model

    def _optimizer(self, model):
        parameters = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(parameters, lr=self.settings.lr,
                                 weight_decay=self.settings.weight_decay)

    def step(self, ids: torch.Tensor, state: TrainState, ce_bound: float | None = None) -> dict:
        """One optimiser step on ``ids``. ``ce_bound``: what the batch's CE is held to under a ``ce``
        constraint (the base's held-out CE on the batch's kinds of text plus the slack,
        heldout.ce_bound). Only the KL constraint needs the frozen base's forward on the batch."""
        settings, ids = self.settings, ids.to(self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(settings, state.step)
        reference = target = None
        if settings.constraint.type == "kl":
            with torch.no_grad(), autocast_for(self.device, settings.dtype):
                reference = self.dense(input_ids=ids, use_cache=False).logits
        elif settings.constraint.type == "ce_control":
            target = self._control_step(ids, state.step) + settings.constraint.slack
        else:
            if ce_bound is None:
                raise ValueError("a ce constraint needs the batch's CE bound (heldout.ce_bound)")
            target = ce_bound
        tracker = sparse.GateTracker(training=True, generator=self.generator, gradient=settings.gate_gradient,
                                     seed_generator=self.seed_generator)
        with intervened(self.student, gates=tracker):  # also around backward: checkpointed layers replay their gates
            with autocast_for(self.device, settings.dtype):
                logits = self.student(input_ids=ids, use_cache=False).logits
            return self._update(logits, ids, reference, target, tracker, state)

    def _update(self, logits, ids, reference, target, tracker, state) -> dict:
        """The backward pass, then one read of every number the row reports (a GPU waits for the
        host once a step, after its backward pass, not between forward and backward), then the
        step unless a number is not finite."""
        settings = self.settings
        ce, kl = losses.loss_terms(logits, ids, reference)
        density = tracker.expected_density()
        measured = kl if target is None else ce
        loss = (density + state.lam * measured) / (1 + state.lam)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        values = _read_once(loss, ce, density, tracker.sampled_open, tracker.edges, *([kl] if kl is not None else []))
        loss_, ce_, density_, opened, edges = values[:5]
        # C: the constrained quantity minus what it is held to (KL: the slack; CE: the control's CE
        # or the base's held-out CE, each plus the slack)
        constraint = values[5] - settings.constraint.slack if target is None else ce_ - target
        row = {"step": state.step + 1, "tokens": (state.position + len(ids)) * ids.shape[1],
               "loss": loss_, "ce": ce_, "expected_density": density_,
               "training_density": opened / edges, "constraint": constraint,
               "multiplier": state.lam, "lr": learning_rate(settings, state.step)}
        if kl is not None:
            row["kl"] = values[5]
        if settings.constraint.type == "ce_control":
            row["control_ce"] = target - settings.constraint.slack
        elif target is not None:
            row["ce_bound"] = target
        if not all_finite(row):
            self.optimizer.zero_grad(set_to_none=True)
            return row  # no update: post_train stops with the last finite values
        torch.nn.utils.clip_grad_norm_([p for p in self.student.parameters() if p.requires_grad],
                                       settings.grad_clip)
        self.optimizer.step()
        update_multiplier(state, constraint, settings.constraint.slack, settings.multiplier)
        return row

    def _control_step(self, ids: torch.Tensor, step: int) -> float:
        for group in self.control_optimizer.param_groups:
            group["lr"] = learning_rate(self.settings, step)
        with autocast_for(self.device, self.settings.dtype):
            logits = self.control(input_ids=ids, use_cache=False).logits
        ce, _ = losses.loss_terms(logits, ids, None)
        self.control_optimizer.zero_grad(set_to_none=True)
        ce.backward()
        torch.nn.utils.clip_grad_norm_([p for p in self.control.parameters() if p.requires_grad],
                                       self.settings.grad_clip)
        self.control_optimizer.step()
        return ce.item()

    # ---- checkpoints

    def save_checkpoint(self, path: Path, state: TrainState, fingerprint_: str) -> None:
        trainable = {n: p.detach().cpu() for n, p in self.student.named_parameters() if p.requires_grad}
        payload = {"fingerprint": fingerprint_, "state": state.__dict__, "student": trainable,
                   "optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state(),
                   "seed_generator": self.seed_generator.get_state()}
        if self.control is not None:
            payload["control"] = {n: p.detach().cpu() for n, p in self.control.named_parameters()
                                  if p.requires_grad}
            payload["control_optimizer"] = self.control_optimizer.state_dict()
        with io.atomic_path(path) as tmp:
            torch.save(payload, tmp)

    def load_checkpoint(self, path: Path, fingerprint_: str) -> TrainState | None:
        if not path.is_file():
            return None
        payload = read_checkpoint(path)
        if payload["fingerprint"] != fingerprint_:
            log.warning("checkpoint %s was made with other settings: starting over", path)
            return None
        _load_parameters(self.student, payload["student"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.generator.set_state(payload["generator"])
        if "seed_generator" in payload:  # checkpoints from before it drew the kernels' seeds
            self.seed_generator.set_state(payload["seed_generator"])
        if self.control is not None:
            _load_parameters(self.control, payload["control"])
            self.control_optimizer.load_state_dict(payload["control_optimizer"])
        return TrainState(**payload["state"])

    def merged_student(self):
        """The student as a plain model (LoRA adapters merged into the weights)."""
        return self._merged(self.student)

    def merged_control(self):
        """The dense control (constraint ce_control) as a plain model, else None."""
        return None if self.control is None else self._merged(self.control)

    def _merged(self, model):
        if self.settings.train == "lora":
            model = model.merge_and_unload()
        return model.eval()


CHECKPOINT_KEYS = frozenset({"fingerprint", "state", "student", "optimizer", "generator"})


def read_checkpoint(path: Path) -> dict:
    """A resume checkpoint's payload, unpickled with ``weights_only`` (tensors, numbers, strings and
    containers alone: what ``save_checkpoint`` writes). Anything else is refused, naming the file,
    and nothing in it runs: a results folder others can write must not run code in the next job."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 -- foreign objects (UnpicklingError), or a damaged archive
        raise SparsifyError(f"{path} is not a post-training checkpoint attnlab wrote, or it is damaged; it was "
                            f"refused without running anything in it ({_load_failure(error)}). Delete it to train from "
                            "step 0") from error
    if not isinstance(payload, dict) or not CHECKPOINT_KEYS <= payload.keys():
        found = sorted(map(str, payload)) if isinstance(payload, dict) else type(payload).__name__
        raise SparsifyError(f"{path} is not a post-training checkpoint attnlab wrote: it holds {found}, not "
                            f"{sorted(CHECKPOINT_KEYS)}. Delete it to train from step 0")
    return payload


def _load_failure(error: Exception) -> str:
    """What torch.load refused, in a line: for a foreign object the line naming it ("Unsupported
    global: GLOBAL exec ..."), not torch's advice to load the file unsafely."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = next((line for line in lines if "Unsupported global" in line), lines[0] if lines else "")
    return f"{type(error).__name__}: {named.split('. Please use')[0]}"


def _read_once(*values) -> list[float]:
    """``values`` (tensors on one device, or numbers) as floats, in one transfer to the host."""
    tensors = [value for value in values if torch.is_tensor(value)]
    read = iter(torch.stack([t.detach().to(torch.float64).reshape(()) for t in tensors]).tolist()) if tensors else iter(())
    return [next(read) if torch.is_tensor(value) else float(value) for value in values]


def _load_parameters(model, values: dict) -> None:
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in values.items():
            parameters[name].copy_(value)


def all_finite(row: dict) -> bool:
    return all(math.isfinite(row[key]) for key in ("loss", "ce", "kl", "expected_density") if key in row)


def describe_numbers(evaluation: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in evaluation.items())


def stop_on_nan(row: dict, state: TrainState, checkpoint: Path) -> None:
    last = state.steps[-1] if state.steps else {}
    kept = (f"the last checkpoint ({checkpoint}) is kept" if checkpoint.is_file()
            else "no checkpoint was written yet")
    raise SparsifyError(
        f"the loss became NaN/inf at step {row['step']} ({row}); last finite step: {last or 'none'}; "
        f"{kept}, no model was written. Lower lr, multiplier.lr or grad_clip")
