"""What the planned GPU jobs will hold on the card, from the cost fit (``attnlab.cost.model``), and
the refusal of a plan that cannot fit a declared GPU memory (pure standard library: Snakemake runs
it while it parses the workflow, before any job).

A GPU memory is declared as a Snakemake resource, beside the executor's other cluster settings
(``--resources gpu_mem_gb=80``, or ``resources: [gpu_mem_gb=80]`` in a profile), not in the
config: it belongs to the cluster, not to the experiment. Each job whose model's config.json can
be read (a prepared folder; a source's own: a local folder, a hub model in the local cache; a
sparse copy's base) is estimated; the others are left to run (``estimates`` says which and
why), never refused. Edge-circuit jobs are estimated here (``estimates``); head scoring, the
head sweeps and post-training, whose workloads the settings alone also give, by
``attnlab.cost.requests.planned_estimates``, which the workflow calls. The other fitted stages'
workloads depend on the prompts' lengths, known only once make_prompts has run; their jobs'
requests and estimates come from ``attnlab.cost.requests`` when they start. Token counts
per prompt are the tasks' under SmolLM2's tokenizer (``TASK_TOKENS``): another tokenizer's
differ by a few tokens, and Greater-Than's digit-by-digit rows (ten per prompt) are more than a
tokenizer with two-digit tokens (GPT-2, OLMo) needs: its estimate is an upper bound there.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from attnlab.cost import model as cost
from attnlab.config.checks import ConfigError
from attnlab.config.sources import source_config

# (tokens per row, tokens from each row's first clean/corrupted difference on, rows per prompt)
# of each task's prompts under SmolLM2's tokenizer (32 prompts, seed 0; Greater-Than digit by
# digit: ten rows per prompt, one per first digit)
TASK_TOKENS = {"ioi": (20, 14.3, 1), "ioi_long": (47, 13.0, 1), "greater_than": (18, 9.0, 10),
               "docstring": (71, 45.0, 1), "program": (16, 16.0, 1)}
FLOAT32 = 4  # edge circuits load every model in float32


def gpu_memory_limit(value) -> float | None:
    """The declared ``gpu_mem_gb`` resource (None when not declared); refused unless a positive
    number."""
    value = getattr(value, "value", value)  # Snakemake's Resource once parsed
    if value is None:
        return None
    try:
        limit = float(value)
    except (TypeError, ValueError):
        limit = math.nan
    if not limit > 0 or math.isinf(limit):
        raise ConfigError(f"resource gpu_mem_gb is {value!r}: give the GPU's memory in GB as a positive number "
                          f"(--resources gpu_mem_gb=80, or resources: [gpu_mem_gb=80] in the profile)")
    return limit


@dataclass(frozen=True)
class JobEstimate:
    rule: str
    model: str
    what: str  # the job's wildcards beyond the model
    estimate: cost.Estimate | None
    why_none: str = ""
    lower: str = ""  # the settings that lower the estimate

    def line(self) -> str:
        where = f"{self.rule} {self.model}{' ' + self.what if self.what else ''}"
        if self.estimate is None:
            return f"{where}: no estimate ({self.why_none}); not checked against gpu_mem_gb"
        return f"{where}: {self.estimate.describe()}"


def model_config(name: str, models: dict, models_dir: Path, bases: dict) -> dict | None:
    """config.json of ``name``'s prepared folder, else its source's (a local folder's, a hub
    model's in the local cache: ``sources.source_config``); a sparse copy's: its base's."""
    for folder in (models_dir / name, models_dir / bases.get(name, name)):
        path = folder / "config.json"
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except (OSError, ValueError):
                return None
    try:
        return source_config(models[bases.get(name, name)]["source"])
    except (OSError, ValueError, KeyError):
        return None


def prompt_split(pruning: dict, task: str) -> tuple[int, int]:
    """How many of ``task``'s prompts heads (and edges) are ranked on and counted on: the sizes of
    ``patching.tasks.split_for_ranking``'s split."""
    n, share = pruning["tasks"][task]["n"], pruning["rank_share"]
    ranked = n if share == 0 else min(n - 1, max(1, round(share * n)))
    return ranked, n if share == 0 else n - ranked


def whole_prompts(batch: int, rows_per_prompt: int) -> int:
    """A mini-batch's rows as the patching engine takes them (``TaskBatch.whole_prompts``, which
    needs torch: rounded down to whole prompts, at least one)."""
    return max(1, batch // rows_per_prompt) * rows_per_prompt


def edge_estimate(config: dict, task: str, pruning: dict, device: str = "cuda") -> cost.Estimate | None:
    """An edge-circuit job on ``device``: the memory of the larger of EAP-IG scoring and circuit
    evaluation (float32 weights), the time of both, on the prompts the head sweep ranks on and
    counts on."""
    edges, (tokens, points, rows_per_prompt) = pruning["edges"], TASK_TOKENS[task]
    _, counted = prompt_split(pruning, task)
    counted = min(counted, edges["n_counted"] or counted)
    rows = whole_prompts(edges["batch_size"], rows_per_prompt)
    per_batch = rows * points
    scores = ranking_estimate(config, task, pruning, device)
    circuit = cost.estimate("edge_circuit", config, {"batch": rows, "tokens": tokens, "points_per_batch": per_batch,
                                                     "points": counted * rows_per_prompt * points,
                                                     "prompts": counted * rows_per_prompt}, FLOAT32, device)
    if scores is None or circuit is None:
        return None
    circuit = within_cache(circuit, edges["cache_gb"], per_batch / (counted * rows_per_prompt * points))
    # one circuit's time: the sweep evaluates one per edge count (EdgeSweep's counts)
    return cost.in_sequence(scores, circuit, _edge_counts({**pruning, **edges}))


def ranking_estimate(config: dict, task: str, pruning: dict, device: str = "cuda") -> cost.Estimate | None:
    """What orders the edges, on the ranked prompts (``pruning.edges.method``): EAP-IG's scoring;
    ACDC's patched forward of every ranked prompt per edge, every edge tried (an upper bound:
    edges into a component that sends nothing are removed without one), and its two references;
    Edge Pruning's steps, each as one EAP step of a mini-batch (a recording forward, then a forward
    and a backward: the cost fit has not measured Edge Pruning's own passes)."""
    edges, (tokens, points, rows_per_prompt) = pruning["edges"], TASK_TOKENS[task]
    ranked, _ = prompt_split(pruning, task)
    rows = whole_prompts(edges["batch_size"], rows_per_prompt)
    per_batch = rows * points
    method = edges.get("method", "eap_ig")
    if method == "acdc":
        return acdc_estimate(config, {"batch": rows, "tokens": tokens, "points_per_batch": per_batch,
                                      "points": ranked * rows_per_prompt * points,
                                      "prompts": ranked * rows_per_prompt}, device)
    if method == "edge_pruning":
        step = cost.estimate("edge_scores", config, {"batch": rows, "tokens": tokens, "points_per_batch": per_batch,
                                                     "prompts": rows, "steps": 1, "chunks": 1}, FLOAT32, device)
        return None if step is None else cost.in_sequence(step, step, edges["edge_pruning"]["steps"] - 1)
    chunk = min(per_batch, edges["score_chunk"] or per_batch)
    return cost.estimate("edge_scores", config, {"batch": rows, "tokens": tokens, "points_per_batch": chunk,
                                                 "prompts": ranked * rows_per_prompt, "steps": edges["steps"],
                                                 "chunks": math.ceil(per_batch / chunk)}, FLOAT32, device)


def acdc_estimate(config: dict, work: dict, device: str) -> cost.Estimate | None:
    """ACDC on ``work`` (an edge_circuit workload of the ranked prompts): its reference and one
    patched forward per edge, every edge tried (an upper bound)."""
    one, shape = cost.estimate("edge_circuit", config, work, FLOAT32, device), cost.Shape.of(config)
    return None if one is None or shape is None else cost.in_sequence(one, one, shape.edges())


def _edge_counts(settings: dict) -> int:
    """About how many circuits an edge sweep evaluates: its grid (the coarse one under
    bisection), the points refined near the threshold, and those spent on the interval's ends."""
    grid = settings["coarse_points"] if settings["search"] == "bisection" else settings["log_points"]
    return grid + settings["refine_points"] + settings["interval_points"]


def within_cache(circuit: cost.Estimate, cache_gb: float | None, batch_share: float) -> cost.Estimate:
    """The circuits' estimate with the recordings kept stopped at ``cache_gb``: past it, one
    mini-batch's recording (``batch_share`` of them all) is made again while the others stay."""
    recordings = circuit.terms["recordings"]
    if cache_gb is None or recordings <= cache_gb * 1e9:
        return circuit
    terms = dict(circuit.terms, recordings=cache_gb * 1e9 + min(1.0, batch_share) * recordings)
    return cost.Estimate(circuit.weights_bytes + sum(terms.values()), circuit.weights_bytes, circuit.seconds, terms)


def estimates(config: dict, chosen: dict, bases: dict, models_dir: Path) -> list[JobEstimate]:
    """Every planned edge-circuit job's estimate on a GPU (``requests.planned_estimates`` adds the others
    known at parse time)."""
    pruning, out = config["pruning"], []
    edge_tasks = [task for task in pruning["edges"]["tasks"] if task in pruning["tasks"]]
    for model in chosen.get("edge_models") or []:
        model_json = model_config(model, config["models"], models_dir, bases)
        for task in edge_tasks:
            estimate = None if model_json is None else edge_estimate(model_json, task, pruning)
            out.append(JobEstimate("edge_circuit", model, task, estimate,
                                   "its config.json is not at hand before it is prepared" if model_json is None
                                   else "the cost fit has no family or stage for it",
                                   "pruning.edges.batch_size, pruning.edges.score_chunk, pruning.edges.cache_gb"))
    return out


def check_gpu_memory(jobs: list[JobEstimate], limit_gb: float | None) -> None:
    """Refuse the plan when a job's estimate exceeds ``limit_gb``, naming each and what lowers it."""
    if limit_gb is None:
        return
    over = [job for job in jobs if job.estimate is not None and job.estimate.memory_bytes > limit_gb * 1e9]
    if over:
        lines = "\n".join(f"  {job.line()}\n    lower: {job.lower}" for job in over)
        raise ConfigError(f"{len(over)} planned job(s) would hold more than the declared GPU memory "
                          f"(gpu_mem_gb={limit_gb:g}):\n{lines}\n(estimates from attnlab.cost.model, fitted by "
                          f"benchmarks/scale/measure.py; a larger gpu_mem_gb declares a larger card)")
