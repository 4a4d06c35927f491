"""What a model-running job asks for where the cost fit gives no estimate (pure standard library:
Snakemake reads it while it parses the workflow): memory from its weights on disk, and its
threads. ``attnlab.cost.requests`` starts from these and only ever raises them."""
from __future__ import annotations

import os


def weights_bytes(folder: str) -> int:
    """Bytes of a prepared model folder's safetensors weights (0 before it is prepared)."""
    if not os.path.isdir(folder):
        return 0
    return sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder)
               if name.endswith(".safetensors"))


def model_memory_mb(weights: int, least_mb: int, attempt: int = 1) -> int:
    """Memory a job that loads a model asks for: at least ``least_mb``, else 1.25x the weights on
    disk (``weights`` bytes: the loaded copy and its conversion) plus 4 GB (activations, the
    interpreter, the libraries), doubled with each retry. A 7B model stored in float32 (27.6 GB)
    asks for 38.5 GB; the embedded models keep the rules' old 8-32 GB."""
    needed = int(1.25 * weights / 1e6) + 4000
    return max(least_mb, needed) * attempt


def model_job_threads(cores: int | None, local: bool, most: int = 8) -> int:
    """Threads of a job that runs a model (generation, extraction, MLP analysis, pruning).

    Run locally, half of ``--cores`` (1 to ``most``): such a job spends its first seconds on
    one core (imports, loading the model and tokenizer: about 8 s of a typical 20 s job of the
    embedded default), so two at a time keep every core busy. On a cluster: ``most``.
    """
    if not local or not cores:
        return most
    return max(1, min(most, cores // 2))
