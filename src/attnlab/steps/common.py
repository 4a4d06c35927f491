"""Shared by the steps: logging into the rule's log, seeds, the retry batch size, summaries."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys

import pandas as pd

from attnlab import io
from attnlab.cost.model import described
from attnlab.config.settings import Extraction, MlpAnalysis


log = logging.getLogger("attnlab")


def setup_logging(log_path: str | None = None) -> None:
    """Send stderr (tqdm bars, warnings, our logging) to the rule's log file; and, as every
    job's script calls this first, spare the job the interpreter's last garbage collections."""
    if log_path:
        sys.stderr = open(log_path, "w", buffering=1)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # At exit the interpreter collects garbage while it clears every module: with torch and
    # transformers loaded that walks millions of objects, 1.0-1.3 s of each model job measured
    # (0.2 s frozen). A job's outputs are closed and renamed before it returns and its log is
    # line-buffered and flushed at exit as always; freezing only leaves the objects still alive
    # then uncollected, which the process's end releases anyway.
    atexit.register(gc.freeze)


def _seed_everything(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _batch_size(configured: int, given: int | None) -> int:
    """The batch this attempt uses: Snakemake halves it for each retry (resources.batch_size)."""
    batch = given or configured
    if batch < configured:
        log.warning("batch size %d (configured %d, halved for a retry after running out of memory)",
                    batch, configured)
    limit = os.environ.get("ATTNLAB_TEST_OOM_ABOVE_BATCH")  # fault injection for the retry test
    if limit and batch > int(limit):
        raise MemoryError(f"simulated out-of-memory at batch size {batch} "
                          f"(ATTNLAB_TEST_OOM_ABOVE_BATCH={limit})")
    return batch


def _arm(arm: dict | None):
    from attnlab.interventions.mlp import ArmSettings

    return ArmSettings(**arm) if arm else None


def _read_summaries(paths: list[str]) -> pd.DataFrame:
    """One row per graded model x dataset x condition cell."""
    return pd.DataFrame([io.read_json(p) for p in paths])


# Summary keys added after the tables' first release: last, so every earlier column keeps
# its position (the summaries' sorted keys would put them among the lenient_* columns).
LATER_COLUMNS = ("lenient_substring_only", "lenient_exact_acc")


def _ordered(table: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """``keys`` first, then the other columns as read, LATER_COLUMNS last."""
    later = [c for c in LATER_COLUMNS if c in table.columns]
    return table[keys + [c for c in table.columns if c not in keys and c not in later] + later]


def _model_and_prompts(model_dir: str, prompts_path: str, settings: Extraction | MlpAnalysis,
                       threads: int, batch_size: int | None):
    """(model, prompts, device, dtype, batch size) of a job that runs prompts through a model:
    the first ``max_prompts`` prompts, the model on the configured device and dtype, the
    batch of this attempt (``_batch_size``), torch on ``threads`` threads."""
    import torch

    from attnlab.models import load_model, pick_device, pick_dtype

    torch.set_num_threads(threads)
    batch_size = _batch_size(settings.batch_size, batch_size)
    prompts = io.read_parquet(prompts_path)
    if settings.max_prompts:
        prompts = prompts.head(settings.max_prompts)
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    return load_model(model_dir, device, dtype), prompts, device, dtype, batch_size


def log_replaced_rows(table: pd.DataFrame, out_path: str, keys: list[str]) -> None:
    """Say in the log which rows of the last table written to ``out_path`` this one drops or
    rewrites. Snakemake removes an output before its job runs, so the last table's rows are kept
    beside it (``.<name>.last.csv``, not an output) for the next run to compare with."""
    last = os.path.join(os.path.dirname(out_path), f".{os.path.basename(out_path).removesuffix('.csv')}.last.csv")
    if os.path.exists(last):
        previous = pd.read_csv(last, dtype=str).set_index(keys)
        current = table.astype(str).set_index(keys)
        dropped = previous.index.difference(current.index)
        shared = previous.index.intersection(current.index)
        rewritten = [key for key in shared if not previous.loc[key].equals(current.loc[key].reindex(previous.columns))]
        label = table["config"].iloc[0] if "config" in table and len(table) else "?"
        for kind, rows in (("no longer holds", dropped), ("rewrites", rewritten)):
            for key in rows:
                log.warning("%s: this run (config %s) %s the row %s of the last table (config %s)", out_path,
                            label, kind, dict(zip(keys, key)), previous.loc[key].get("config", "?"))
    io.write_csv(table, last)


def log_request(rule: str, smk) -> None:
    """What this job asked the scheduler for (its resources) and what that rests on: the cost fit,
    or its rule's request where the fit cannot estimate it (``attnlab.cost.requests``)."""
    from attnlab.cost.requests import READ_INPUTS, job_request
    from attnlab.config.sources import sparse_bases

    resources = smk.resources
    inputs = {name: getattr(smk.input, name, None) for name in READ_INPUTS}
    # a rule without a batch_size resource (sparsify_model: its settings hold its batch) passes 1
    asked = job_request(rule, smk.config, dict(smk.wildcards.items()), inputs, attempt=1, local=True,
                        batch=resources.get("batch_size", 1), bases=sparse_bases(smk.config["models"]))
    log.info("%s asked for mem_mb=%s and runtime=%s min: %s", rule, resources.get("mem_mb"), resources.get("runtime"),
             asked.basis)


def log_cost_estimate(stage: str, model_dir: str, work: dict, dtype, device, repeats: int = 1) -> None:
    """The cost fit's estimate of this job's peak memory and time (``attnlab.cost.model``; its
    stages and workload sizes), in the log, so a cluster's request can be checked against it."""
    config = io.read_json(os.path.join(model_dir, "config.json"))
    log.info("%s", described(stage, config, work, dtype.itemsize, device.type, repeats))
