"""The post-training settings, typed: built once from the validated config (config/schema.yaml
holds every default and description) where a job starts, read as attributes by the library.

A field that shapes training carries ``SHAPES_TRAINING`` in its metadata; the checkpoint
fingerprint covers exactly those fields, so a job resumes when only what is measured or logged
changed (evaluation, logging, checkpoint cadence, snapshots, calibration) and starts over when
anything that decides the weights changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

SHAPES_TRAINING = {"shapes_training": True}


def _training(**kwargs):
    return field(metadata=SHAPES_TRAINING, **kwargs)


@dataclass(frozen=True)
class PerLayer:
    enabled: bool
    step: float
    rounds: int
    sensitivity_sequences: int


@dataclass(frozen=True)
class Calibration:
    enabled: bool
    max_kl: float
    step: float
    lowest: float
    sequences: int  # held out of the training text, so its count shapes training (fingerprint)
    per_layer: PerLayer


@dataclass(frozen=True)
class Lora:
    rank: int
    alpha: float
    modules: tuple[str, ...]


@dataclass(frozen=True)
class Constraint:
    type: str  # ce_control | ce | kl (config/schema.yaml)
    slack: float


@dataclass(frozen=True)
class Multiplier:
    init: float
    lr: float
    ema: float
    min: float
    max: float


@dataclass(frozen=True)
class SparsifySettings:
    base: str = _training()
    gate_bias: float = _training()
    gate_gradient: str = _training()
    train: str = _training()
    lora: Lora = _training()
    lr: float = _training()
    lr_schedule: str = _training()
    weight_decay: float = _training()
    warmup_steps: int = _training()
    steps: int = _training()
    batch_size: int = _training()
    seq_len: int = _training()
    grad_clip: float = _training()
    constraint: Constraint = _training()
    multiplier: Multiplier = _training()
    seed: int = _training()
    corpus: dict = _training()  # one source or {mixture: {name: {weight, source}}} (config.corpus)
    heldout_sequences: int = _training()
    dtype: str = _training()
    gradient_checkpointing: bool = _training()
    calibrate_gate_bias: Calibration = field()
    snapshot_steps: tuple[int, ...] = field()
    eval_every: int = field()
    checkpoint_every: int = field()
    log_every: int = field()
    device: str = field()

    @classmethod
    def of(cls, config) -> SparsifySettings:
        """``config`` itself if typed already, else built from a validated config mapping."""
        return config if isinstance(config, cls) else cls.from_config(config)

    @classmethod
    def from_config(cls, config: dict) -> SparsifySettings:
        """From ``models.<name>.source.sparsify`` after schema validation (defaults filled)."""
        calibration = config["calibrate_gate_bias"]
        nested = {
            "lora": Lora(**{**config["lora"], "modules": tuple(config["lora"]["modules"])}),
            "constraint": Constraint(**config["constraint"]),
            "multiplier": Multiplier(**config["multiplier"]),
            "calibrate_gate_bias": Calibration(**{**calibration, "per_layer": PerLayer(**calibration["per_layer"])}),
            "snapshot_steps": tuple(config["snapshot_steps"]),
            "corpus": dict(config["corpus"]),
        }
        return cls(**{**config, **nested})

    def as_config(self) -> dict:
        """The settings as the config wrote them (for provenance and summaries)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def fingerprint(self) -> str:
        """What must match for a checkpoint to be resumed: every field that shapes training,
        and the calibration's sequence count (its documents are held out of the training text)."""
        config = self.as_config()
        keep = {f.name: config[f.name] for f in dataclasses.fields(self) if f.metadata.get("shapes_training")}
        keep["calibration_sequences"] = self.calibrate_gate_bias.sequences
        return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]
