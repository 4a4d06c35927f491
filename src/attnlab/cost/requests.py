"""What each GPU rule's job asks the scheduler for (``mem_mb``, ``runtime`` in minutes), and what
it should hold on the card, from the cost fit (``attnlab.cost.model``).

Snakemake evaluates a rule's resources when it builds the plan (a dry run), and again just before
the job starts, once its inputs exist: the prepared model's config.json and, for generation and
extraction, the prompts' lengths. Where either is missing, or the cost fit has no family or
stage for the model (``cost.estimate`` None), the job asks what it asked before the fit
(``defaults.model_memory_mb``'s weights rule and the rule's own minutes) and its ``basis`` says so.

- Host memory (``mem_mb``). On the CPU the weights, the stage's estimate above them widened by
  the fit's largest relative error on that stage (``margins``: in its measurements of the
  model's family, or with each family left out for a family it has not seen), and the process's own
  ``PROCESS_BYTES``; on a GPU the activations are on the card, and the host holds the weights while they
  load, so the weights rule stands. Never less than the weights rule (and the rule's floor): the
  fit was measured on models of 1 to 4 layers, so it only ever raises a request.
- Minutes (``runtime``). On the CPU the fitted seconds times the fit's largest time factor on
  that stage, times each repeat
  of the workload in one job (the ablations of ``score_heads``). No GPU time has been measured,
  so a job on a GPU keeps its rule's minutes, and says so.
- The GPU estimate: the same fit at the job's dtype on "cuda" (memory coefficients measured on
  the CPU: no CUDA context, no caching allocator's slack), written in the job's log.

The fitted rules (``FITTED``): generate, extract_attention, score_heads (attribution, then exact
patching where asked for: the larger peak, both times), sweep_heads (the heads fit's whole
patched forwards, one per k at most as many as its search can measure: ``sweep_points``),
edge_circuit (scoring, then the sweep's circuits), mediate, mlp_activations (a forward stopped
at the recorded layer) and sparsify_model (the one measured training step composed with what
the settings say the job holds and runs: ``attnlab.cost.training``). Generation, extraction and the
MLP forward are timed over every batch of the job's prompts, each as long as the longest.
The ground-truth jobs keep their rule's request: their compiled models are tiny.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from attnlab.anatomy.families import text_config
from attnlab.cost import model as cost
from attnlab.config.checks import ConfigError
from attnlab.cost.budget import (FLOAT32, TASK_TOKENS, JobEstimate, edge_estimate, estimates, model_config,
                                   prompt_split, ranking_estimate, whole_prompts)
from attnlab.config.plan import cell_generation, pruning_ablations, with_mib_sizes
from attnlab.cost.defaults import model_memory_mb, weights_bytes
from attnlab.cost.training import sparsify_estimate

# the process before it loads a model (Python, torch, transformers, attnlab's stages imported:
# 521 MiB here), rounded up: the fit measures each stage above what the process held
PROCESS_BYTES = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FITTED = {"generate": "generation", "extract_attention": "extraction", "score_heads": "heads",
          "sweep_heads": "sweep", "edge_circuit": "edges", "mediate": "mediation",
          "mlp_activations": "mlp_activations", "sparsify_model": "sparsify"}
# the inputs whose sizes a workload reads (generation and extraction: the prompts; mediation: the
# treated prompts and their generations)
READ_INPUTS = ("prompts", "treated", "generations")
# each fitted rule's request before the fit: memory beside the weights rule, minutes (score_heads':
# per ablation); a job asks at least this
# a head sweep's whole forwards besides one per k: the ablation's references, the unpatched model's
# clean and corrupted metrics on the counted prompts
SWEEP_FORWARDS = 3
FLOORS = {"generate": (16000, 120), "extract_attention": (16000, 60), "score_heads": (16000, 60),
          "sweep_heads": (16000, 60), "edge_circuit": (16000, 60), "mediate": (16000, 120),
          "mlp_activations": (8000, 30), "sparsify_model": (32000, 240)}


@dataclass(frozen=True)
class Request:
    mem_mb: int
    runtime: int  # minutes
    device: str
    estimate: cost.Estimate | None  # the job's estimate on its device
    basis: str  # what the request rests on

    def line(self) -> str:
        found = "no estimate" if self.estimate is None else f"estimated {self.estimate.describe()}"
        return (f"asks mem_mb={self.mem_mb}, runtime={self.runtime} min on the {self.device}: {self.basis}; "
                f"{found}")


def job_device(setting: str, local: bool) -> str:
    """The device a GPU rule's job will run on: its section's ``device``; under "auto", a GPU
    where the job is sent to a cluster (every GPU rule declares ``gpu=1``) or where this machine
    has NVIDIA's driver loaded, else the CPU."""
    if setting in ("cpu", "cuda"):
        return setting
    return "cuda" if not local or os.path.exists("/proc/driver/nvidia/version") else "cpu"


def dtype_bytes(setting: str, device: str) -> int:
    """Bytes per element of a section's ``dtype``; "auto" is bfloat16 on CUDA, float32 on the CPU."""
    if setting in DTYPE_BYTES:
        return DTYPE_BYTES[setting]
    return 2 if device == "cuda" else 4


def column(path: str | None, name: str) -> list | None:
    """A parquet file's column, None before the file exists or where pyarrow is not importable
    (Snakemake run outside the project's environment)."""
    try:
        import pyarrow.parquet as parquet

        return parquet.read_table(path, columns=[name]).column(name).to_pylist()
    except Exception:  # noqa: BLE001 - not written yet, unreadable, or no pyarrow: the rule's request
        return None


def prompt_sizes(path: str | None) -> tuple[int, int] | None:
    """(how many prompts, the longest's tokens) of a prompts parquet (its ``n_prompt_tokens``),
    None where unread."""
    lengths = column(path, "n_prompt_tokens")
    return (len(lengths), int(max(lengths))) if lengths else None


def mediation_work(section: dict, inputs: dict, batch: int) -> dict | None:
    """mediate's workload before it runs: the treated prompts' items (``max_items`` of them at
    most), each its longest prompt and the longest generation after it (the continuation is cut
    at the answer: an upper bound), None before those files exist."""
    prompts, generated = column(inputs.get("treated"), "n_prompt_tokens"), column(inputs.get("generations"),
                                                                                    "n_new_tokens")
    if not prompts or not generated:
        return None
    items = min(len(prompts), section["max_items"] or len(prompts))
    return mediation_sizes(items, batch, int(max(prompts)) + int(max(generated)), int(max(generated)),
                           len(section["arm_seeds"]), section["patched_layers"])


def mediation_sizes(items: int, batch: int, tokens: int, continuation: int, arm_seeds: int,
                    patched_layers: list[int] | None) -> dict:
    """cost's mediation workload: ``items`` in batches of ``batch`` rows of up to ``tokens``, the
    longest continuation scored (its metric reads one position more), the ARM seeds run, and the
    layers patched one at a time (layer 0 always; None: every layer)."""
    work = {"prompts": items, "batch": min(batch, items), "tokens": tokens, "scored": continuation + 1,
            "arm_seeds": arm_seeds}
    if patched_layers is not None:
        work["patched"] = len({0, *patched_layers})
    return work


def heads_work(pruning: dict, task: str, batch: int) -> tuple[dict, int]:
    """score_heads' workload: the prompts heads are ranked on in mini-batches of ``batch`` rows,
    whether exact patching runs beside attribution, and how many times it runs (once per
    ablation). Its whole forwards besides the resumed passes: the references', the recording's,
    and the unpatched model's clean and corrupted metrics (once a job: counted in each run)."""
    tokens, _, rows_per_prompt = TASK_TOKENS[task]
    ranked, _ = prompt_split(pruning, task)
    prompts = ranked * rows_per_prompt
    return ({"prompts": prompts, "batch": min(whole_prompts(batch, rows_per_prompt), prompts), "tokens": tokens,
             "forwards": 4, "exact": bool(pruning["exact"])},  # validate: an exact ranking needs it
            len(pruning_ablations(pruning)))


def log_grid(n: int, max_all: int, points: int) -> list[int]:
    """``circuits.curves.k_grid`` without numpy (Snakemake's process reads this): every k up to
    ``n`` where ``n <= max_all``, else ``points`` log-spaced k from 1 to ``n``, with 0 and ``n``."""
    if n <= max_all:
        return list(range(n + 1))
    spaced = {round(n ** (i / (points - 1))) for i in range(points)} if points > 1 else {1}
    return [0, *sorted(k for k in spaced if 0 < k < n), n]


def sweep_points(n_heads: int, pruning: dict, configured: bool) -> int:
    """How many k one ranking's head sweep measures at most (``steps.circuits._head_count``),
    never more than every k. rounds (a bound): the grid, and for the configured ranking every k
    inside the widest step of the grid (the bracket of the first crossing, refined to the head)
    and up to log_points below the interval's ends. bisection: the coarse grid, and for the
    configured ranking every k of the fine grid (measured only where the curve's band holds the
    threshold), a bisection of the widest bracket, and up to log_points for the interval's ends;
    not a proven bound (a curve crossing the threshold many times opens a bracket each time, and
    the search starts again after every point), but one no curve of the tests exceeded, by
    far."""
    mib = pruning.get("mib_sizes", True)  # MIB's sizes measured too (plan.with_mib_sizes)
    fine = with_mib_sizes(log_grid(n_heads, pruning["all_k_up_to"], pruning["log_points"]), n_heads, mib)
    if pruning["search"] == "bisection":
        coarse = with_mib_sizes(log_grid(n_heads, 0, pruning["coarse_points"]), n_heads, mib)
        points = len(coarse) + (len(fine) + math.ceil(math.log2(n_heads + 1)) + pruning["log_points"]
                                if configured else 0)
    else:
        widest = max(high - low for low, high in zip(fine, fine[1:]))
        points = len(fine) + (widest - 1 + pruning["log_points"] if configured else 0)
    return min(points, n_heads + 1)


def sweep_work(pruning: dict, task: str, batch: int, n_heads: int) -> dict:
    """sweep_heads' workload: the counted prompts in mini-batches of ``batch`` rows (whole
    prompts), and its whole forwards (every one a patched or plain forward over them): the
    ablation's references, the unpatched model's clean and corrupted metrics
    (``_counted_prompts``), and each ranking's sweep at most (``sweep_points``; the other ranking
    where it is swept too)."""
    tokens, _, rows_per_prompt = TASK_TOKENS[task]
    _, counted = prompt_split(pruning, task)
    prompts = counted * rows_per_prompt
    other = pruning["sweep_other_ranking"] and (pruning["exact"] or pruning["ranking"] == "exact")
    points = sweep_points(n_heads, pruning, True) + (sweep_points(n_heads, pruning, False) if other else 0)
    return {"prompts": prompts, "batch": min(whole_prompts(batch, rows_per_prompt), prompts), "tokens": tokens,
            "forwards": SWEEP_FORWARDS + points, "exact": False}


def job_request(rule: str, config: dict, wildcards: dict, inputs: dict, *, attempt: int, local: bool, batch: int,
                bases: dict, models_dir: str = "resources/models") -> Request:
    """What ``rule``'s job for ``wildcards`` asks for (a rule in ``FITTED``), its inputs
    (``inputs``: name -> path) read where they exist, at ``batch`` rows (the attempt's)."""
    model = wildcards["model"]
    model_json = model_config(model, config["models"], Path(models_dir), bases)
    weights = weights_bytes(f"{models_dir}/{model}") or weights_bytes(f"{models_dir}/{bases.get(model, model)}")
    stage, section, work, repeats = _workload(rule, config, wildcards, inputs, batch, model_json)
    device = job_device(section.get("device", "auto"), local)
    element_bytes = 4 if stage in ("heads", "sweep", "edges") else dtype_bytes(section.get("dtype", "auto"), device)
    least_mb, least_min = FLOORS[rule]
    return request(stage, model_json, work, device=device, element_bytes=element_bytes, weights=weights,
                   least_mb=least_mb, least_min=least_min * repeats, attempt=attempt, repeats=repeats)


def _workload(rule: str, config: dict, wildcards: dict, inputs: dict, batch: int,
              model_json: dict | None) -> tuple[str, dict, dict | None, int]:
    """``rule``'s stage, settings section, workload (None before its inputs or the model's config
    tell its size) and repeats."""
    stage = FITTED[rule]
    sizes = prompt_sizes(inputs.get("prompts"))  # every batch as long as the longest prompt: an upper bound
    if stage == "mlp_activations":  # the first max_prompts, each forward stopped at the recorded layer
        section = config["mlp"]
        sizes = _first_prompts(sizes, section["max_prompts"])
        return stage, section, sizes and {"prompts": sizes[0], "batch": min(batch, sizes[0]), "tokens": sizes[1],
                                          "layers_run": section["layer"] + 1}, 1
    if stage == "sparsify":  # the copy's post-training settings (attnlab.cost.training reads them itself)
        section = config["models"][wildcards["model"]]["source"]["sparsify"]
        return stage, section, section, 1
    if stage == "sweep":
        shape = None if model_json is None else cost.Shape.of(model_json)
        return stage, config["pruning"], shape and sweep_work(config["pruning"], wildcards["task"], batch,
                                                              shape.depth * shape.heads), 1
    if stage == "generation":
        section = cell_generation(config, wildcards["model"], wildcards["dataset"])
        return stage, section, sizes and {"prompts": sizes[0], "batch": min(batch, sizes[0]),
                                          "new_tokens": section["max_new_tokens"], "prompt_tokens": sizes[1]}, 1
    if stage == "extraction":
        section = config["attention"]
        sizes = _first_prompts(sizes, section["max_prompts"])
        return stage, section, sizes and {"prompts": sizes[0], "batch": min(batch, sizes[0]), "tokens": sizes[1]}, 1
    if stage == "mediation":
        return stage, config["mediation"], mediation_work(config["mediation"], inputs, batch), 1
    if stage == "edges":  # budget.edge_estimate reads the task's sizes and the edge settings itself
        return stage, config["pruning"], {"task": wildcards["task"], "pruning": config["pruning"]}, 1
    work, repeats = heads_work(config["pruning"], wildcards["task"], batch)
    return stage, config["pruning"], work, repeats


def _first_prompts(sizes: tuple[int, int] | None, max_prompts: int | None) -> tuple[int, int] | None:
    """``prompt_sizes`` of a job that runs the first ``max_prompts`` (None: all of them)."""
    return sizes and (min(sizes[0], max_prompts or sizes[0]), sizes[1])


def request(stage: str, model_json: dict | None, work: dict | None, *, device: str, element_bytes: int,
            weights: int, least_mb: int, least_min: int, attempt: int, repeats: int = 1) -> Request:
    """The job's request for ``stage``'s ``work`` (``repeats`` times in one job), or its rule's
    (``least_mb`` beside the weights, ``least_min``) where it cannot be estimated."""
    before = model_memory_mb(weights, least_mb, attempt)
    found = None if model_json is None or work is None else stage_estimate(stage, model_json, work, element_bytes,
                                                                           device)
    if found is None:
        why = ("its config.json is not at hand yet" if model_json is None else
               "its workload is not known before its inputs exist" if work is None else
               "the cost fit has no family or stage for it")
        return Request(before, least_min * attempt, device, None, f"the rule's request ({why})")
    if device == "cuda":
        return Request(before, least_min * attempt, device, found,
                       "host memory: the weights rule (activations are on the card); minutes: the rule's "
                       "(no GPU time fit yet)")
    memory_margin, time_factor = margins(stage, text_config(model_json).get("model_type", ""))
    above = found.memory_bytes - found.weights_bytes
    memory_mb = math.ceil((found.weights_bytes + above * (1 + memory_margin) + PROCESS_BYTES) / 1e6) * attempt
    minutes = 0 if found.seconds is None else math.ceil(found.seconds * repeats * time_factor / 60) * attempt
    return Request(max(before, memory_mb), max(least_min * attempt, minutes), device, found,
                   f"the cost fit: the stage's estimate above the weights x{1 + memory_margin:.2f} and its time "
                   f"x{time_factor:.2f} (its largest errors for this family, or for a family it has not seen)"
                   f"{f' for {repeats} runs' if repeats > 1 else ''}, "
                   f"at least the rule's request")


def stage_estimate(stage: str, model_json: dict, work: dict, element_bytes: int, device: str) -> cost.Estimate | None:
    """``cost.estimate`` of a job's stage; an edge job's (its ``work``: the task and the pruning
    settings) is scoring's and its circuits' together (``budget.edge_estimate``); a head-scoring
    job's attribution's and exact patching's, one after the other."""
    if stage == "edges":
        return edge_estimate(model_json, work["task"], work["pruning"], device)
    if stage == "sparsify":
        return sparsify_estimate(model_json, work, device)
    if stage == "sweep":  # whole patched forwards as exact patching's own (the heads fit), no head resumed alone
        return cost.estimate("heads", model_json, work, element_bytes, device)
    if stage == "heads":
        attribution = cost.estimate("head_attribution", model_json, work, element_bytes, device)
        if not work.get("exact", True):
            return attribution
        return cost.in_sequence(attribution, cost.estimate("heads", model_json, work, element_bytes, device))
    return cost.estimate(stage, model_json, work, element_bytes, device)


def margins(stage: str, model_type: str) -> tuple[float, float]:
    """The cost fit's largest relative memory error (above the weights) and time factor on
    ``stage`` (an edge or head-scoring job: the larger of its two stages'): in its own measurements for
    a family it was fitted to, else the worst with each family left out of the fit and predicted."""
    table = cost.load_coefficients()
    names = {"edges": ("edge_scores", "edge_circuit"), "heads": ("head_attribution", "heads"),
             "sweep": ("heads",), "sparsify": ("lora_step",)}.get(stage, (stage,))
    seen = model_type in table.get("model_types", ())
    fits = [table["stages"][name]["fit"] for name in names]
    fits = [fit if seen else fit.get("held_out_family", fit) for fit in fits]
    return max(fit["largest_memory_error"] for fit in fits), max(fit["largest_time_factor"] for fit in fits)


def planned_estimates(config: dict, chosen: dict, bases: dict, models_dir: Path) -> list[JobEstimate]:
    """Every planned GPU job whose workload the settings alone give, estimated on a GPU before
    any job runs (``budget.check_gpu_memory`` refuses a plan over a declared ``gpu_mem_gb``): edge
    circuits (``budget.estimates``), head scoring and sweeps (float32, the first attempt's batch),
    and each sparse copy's post-training. Generation, extraction, the MLP forward and mediation
    wait for their prompts' lengths: their estimates are in their logs."""
    pruning, out = config["pruning"], estimates(config, chosen, bases, models_dir)
    settings_of = {"score_heads": "pruning.batch_size, pruning.tasks.<task>.n, pruning.rank_share",
                   "sweep_heads": "pruning.batch_size, pruning.tasks.<task>.n, pruning.rank_share",
                   "sparsify_model": "sparsify.batch_size, sparsify.seq_len, sparsify.train (lora), "
                                     "sparsify.heldout_sequences"}
    jobs = [(rule, model, task, {"model": model, "task": task, "ablation": ""})
            for model in chosen.get("pruning_models") or [] for task in pruning["tasks"]
            for rule in ("score_heads", "sweep_heads")]
    jobs += [("sparsify_model", copy, "", {"model": copy}) for copy in bases]
    for rule, model, what, wildcards in jobs:
        model_json = model_config(model, config["models"], models_dir, bases)
        found = None
        if model_json is not None:
            stage, section, work, repeats = _workload(rule, config, wildcards, {}, pruning["batch_size"], model_json)
            if section.get("device") == "cpu":  # a job that never runs on a card
                continue
            found = work and stage_estimate(stage, model_json, work, FLOAT32, "cuda")
        out.append(JobEstimate(rule, model, what, found,
                               "its config.json is not at hand before it is prepared" if model_json is None
                               else "the cost fit has no family or stage for it", settings_of[rule]))
    return out


def acdc_minutes(model_json: dict, task: str, pruning: dict, device: str) -> tuple[float, int] | None:
    """ACDC's estimated minutes on ``device`` for the task's ranked prompts and the model's edges
    (``with_time_factor``); None where the fit has no time for it (a GPU)."""
    return with_time_factor(ranking_estimate(model_json, task, pruning, device), model_json)


def with_time_factor(found: cost.Estimate | None, model_json: dict) -> tuple[float, int] | None:
    """An ACDC estimate's minutes times the fit's largest time factor on edge circuits, and the
    model's edges; None without a time."""
    shape = cost.Shape.of(model_json)
    if found is None or found.seconds is None or shape is None:
        return None
    _, factor = margins("edges", text_config(model_json).get("model_type", ""))
    return found.seconds * factor / 60, shape.edges()


def check_acdc_time(config: dict, chosen: dict, bases: dict, models_dir: Path, local: bool) -> list[str]:
    """Refuse a plan whose ACDC job is estimated longer than ``pruning.edges.acdc.max_minutes``,
    naming the key, its value and each estimate. Returns what could not be estimated (a model
    whose config.json is not at hand yet, a job on a GPU): the job checks again when it starts, on
    its own prompts (``steps.edge_methods.acdc_time_check``)."""
    pruning = config["pruning"]
    if pruning["edges"].get("method") != "acdc":
        return []
    limit, device = pruning["edges"]["acdc"]["max_minutes"], job_device(pruning["device"], local)
    over, unknown = [], []
    for model in chosen.get("edge_models") or []:
        model_json = model_config(model, config["models"], models_dir, bases)
        for task in [task for task in pruning["edges"]["tasks"] if task in pruning["tasks"]]:
            found = None if model_json is None else acdc_minutes(model_json, task, pruning, device)
            if found is None:
                unknown.append(f"{model}/{task}")
            elif found[0] > limit:
                over.append(f"  {model}/{task}: {found[1]:,} edges, estimated {found[0]:,.0f} min on the {device}")
    if over:
        raise ConfigError(acdc_refusal(limit, over))
    return unknown


def acdc_refusal(limit: float, over: list[str]) -> str:
    return (f"pruning.edges.acdc.max_minutes = {limit:g}, but ACDC (one patched forward of the ranked prompts per "
            "edge, every edge tried; the cost fit's estimate, attnlab.cost.budget.ranking_estimate) would take "
            "longer:\n" + "\n".join(over) + "\nraise max_minutes where the job may run that long, use method "
            "eap_ig or edge_pruning, or fewer ranked prompts (pruning.tasks.<task>.n, pruning.rank_share)")
