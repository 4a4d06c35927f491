"""Mean ablation's reference as a file: the scoring job takes each template's mean over the
task's held-apart pool once and writes it; the mean sweep reads it instead of drawing and
averaging the same pool again (31-33 s on IOI, 101-115 s on Docstring, SmolLM2 on 1 CPU core).

A safetensors file (no pickle), one tensor per template and layer, with what it was taken over in
its metadata. The reader refuses a file whose task, pool, seed, held-apart-from prompts or model
are not the ones asked for, or whose tensors do not match its templates and layers, so a stale or
copied file does not stand in for another run's reference.
"""

from __future__ import annotations

import dataclasses
import json
import os

FORMAT = "attnlab.template_means/1"


@dataclasses.dataclass
class TaskMeans:
    """Mean ablation's reference (``heads.template_means``: {template: per layer [tokens, width]})
    and the pool it was taken over."""

    by_template: dict
    pool: int  # prompts averaged over
    fewest: int  # prompts of the template with fewest
    seed: int

    def described(self) -> dict:
        """What a scores.json or sweep.json says of the reference."""
        return {"what": "each template's mean over a pool of the task's prompts drawn apart from those ranked and "
                        "counted on (its own seed; any prompt of the task dropped)",
                "prompts": self.pool, "templates": len(self.by_template), "fewest_per_template": self.fewest,
                "seed": self.seed}


@dataclasses.dataclass(frozen=True)
class Identity:
    """What a reference file must have been taken for: the task, the pool asked for
    (``pruning.mean_pool``), the pool's seed, the digest of the task's prompts it is held apart
    from (``counting.prompts_digest``) and the model (``model_fingerprint``: a model and its sparse
    copy share a tokenizer, so the prompts alone would not tell their references apart)."""

    task: str
    pool_asked: int
    seed: int
    held_apart_from: str
    model: str


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """A prepared model folder's name, its config.json's digest and its weights' sizes: cheap at
    any model size (no weight is read), and different for a model, its copy and its control."""
    import hashlib
    from pathlib import Path

    folder = Path(model_dir)
    config = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()[:16]
    sizes = ",".join(f"{path.name}:{path.stat().st_size}" for path in sorted(folder.glob("*.safetensors")))
    return f"{folder.resolve().name}|config {config}|weights {sizes}"


def write_means(means: TaskMeans, identity: Identity, path: str | os.PathLike) -> None:
    """Write ``means`` to ``path`` (through a temporary file: a killed job leaves none under the name)."""
    from safetensors.torch import save_file

    from attnlab.io import atomic_path

    templates = list(means.by_template)
    tensors = {f"{index}/{layer}": mean.detach().to("cpu").contiguous()
               for index, template in enumerate(templates)
               for layer, mean in enumerate(means.by_template[template])}
    layers = {len(means.by_template[template]) for template in templates}
    if len(layers) > 1:
        raise ValueError(f"mean reference for {path}: templates hold different numbers of layers ({sorted(layers)})")
    metadata = {"format": FORMAT, "identity": json.dumps(dataclasses.asdict(identity)),
                "templates": json.dumps(templates), "layers": str(layers.pop() if layers else 0),
                "pool": str(means.pool), "fewest": str(means.fewest), "seed": str(means.seed)}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def read_means(path: str | os.PathLike, identity: Identity, device) -> TaskMeans:
    """The reference in ``path`` on ``device``; refuses (ValueError, naming the file, what differs
    and the fix) a file not of this format, taken for another task, pool, seed, prompts or model,
    or short of tensors."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as opened:
        metadata = opened.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{path}: not a mean-ablation reference of this version (format "
                             f"{metadata.get('format')!r}, expected {FORMAT!r}); rerun the scoring job that "
                             f"writes it (`snakemake -R {path}`)")
        differ = _differences(json.loads(metadata["identity"]), dataclasses.asdict(identity))
        if differ:
            raise ValueError(f"{path} was taken for another reference ({'; '.join(differ)}): it is stale or was "
                             f"copied from another run; rerun the scoring job that writes it (`snakemake -R {path}`)")
        templates, layers = json.loads(metadata["templates"]), int(metadata["layers"])
        if len(opened.keys()) != len(templates) * layers:
            raise ValueError(f"{path} holds {len(opened.keys())} tensors where its {len(templates)} templates x "
                             f"{layers} layers need {len(templates) * layers}: it is damaged; rerun the scoring "
                             f"job that writes it (`snakemake -R {path}`)")
        by_template = {template: [opened.get_tensor(f"{index}/{layer}").to(device) for layer in range(layers)]
                       for index, template in enumerate(templates)}
    return TaskMeans(by_template, int(metadata["pool"]), int(metadata["fewest"]), int(metadata["seed"]))


def _differences(found: dict, asked: dict) -> list[str]:
    return [f"{key} {found.get(key)!r} in the file, {value!r} asked for"
            for key, value in asked.items() if found.get(key) != value]
