import os
import re
import sys
from pathlib import Path

# This workflow's own library comes first, for Snakemake (its pure-stdlib parts: it may run
# outside the project's environment) and for every job's scripts, installed or not (a conda
# env without the package, a virtualenv shared by two clones): they import it without a path line.
LIBRARY = os.path.join(workflow.basedir, "src")
sys.path.insert(0, LIBRARY)
_paths = os.environ.get("PYTHONPATH", "")
if LIBRARY not in _paths.split(os.pathsep):  # set for the jobs, not read from the user
    os.environ.update(PYTHONPATH=os.pathsep.join(filter(None, [LIBRARY, _paths])))
from attnlab.config.plan import (area_inputs, arm_of, cell_generation, comparison_pairs, config_label, control_of, fewshot_shots,
                                 fewshot_spec, figure_files, has_length_sweep, has_placement_sweep, length_families,
                                 gap_pairs, model_datasets, mediation_cells, models_on, placements,
                                 pruning_ablations, selections, sparse_pairs, sweep_folders)
from attnlab.cost.defaults import model_job_threads, model_memory_mb, weights_bytes
from attnlab.config import settings as typed
from attnlab.config.sources import sparse_bases
from attnlab.config.schema import check_unique_keys
from attnlab.config.validate import ConfigError, check, rebuild_requests
from attnlab.cost.budget import check_gpu_memory, gpu_memory_limit
from attnlab.cost.requests import READ_INPUTS, check_acdc_time, job_request, planned_estimates


def check_local_dataset(name, spec):
    """A user's local data file read as its job will (pandas and datasets: imported only then)."""
    from attnlab.reasoning.data import check_local_dataset as read

    read(name, spec)


# The schema (defaults filled in place) and every cross-reference, before any job runs.
# A prepared model folder that -R/--forcerun (or -F) rebuilds is not read: it may be the damaged one.
_REBUILDING = rebuild_requests(sys.argv, workflow.dag_settings)
try:
    check_unique_keys(workflow.configfiles)  # a key given twice: YAML (and so Snakemake) keeps the last
    check(config, os.path.join(workflow.basedir, "config", "schema.yaml"), rebuilding=_REBUILDING,
          read_dataset=check_local_dataset)
except ConfigError as error:
    raise WorkflowError(str(error)) from None

CONFIG_LABEL = config_label(workflow.configfiles)  # what the gathered tables say they hold
MODELS = list(config["models"])
SPARSE_BASES = sparse_bases(config["models"])  # sparse copy -> its dense base
DENSE_MODELS = [m for m in MODELS if m not in SPARSE_BASES]
DATASETS = list(config["datasets"])
MODEL_DATASETS = model_datasets(config)  # model -> the datasets it runs on (models.*.datasets)
CONDITIONS = list(config["conditions"])
FEWSHOT = fewshot_shots(config["models"], config["prompt"])  # worked examples per model
EXT = config["plots"]["format"]

# Length sweep: conditions at the default placement without ARM; the plain ones are length 0.
FAMILIES = length_families(config["conditions"])
LENGTH_SWEEP = has_length_sweep(FAMILIES)
# Placement sweep: any insertion away from the default placement, compared with the
# same kind at the default placement and with the plain prompt.
PLACEMENTS = placements(config["conditions"])
PLACEMENT_SWEEP = has_placement_sweep(PLACEMENTS)

CHOSEN = selections(config)  # what runs: attention and MLP datasets, composite figures, swept models
# A declared GPU memory (--resources gpu_mem_gb=80): every planned job the cost fit can estimate
# must fit it, before any job runs (attnlab.cost.budget).
try:
    # ACDC's time against its declared minutes, on the device its jobs will run on
    check_acdc_time(config, CHOSEN, SPARSE_BASES, Path("resources/models"), local=workflow.local_exec)
    _GPU_MEMORY = gpu_memory_limit(workflow.global_resources.get("gpu_mem_gb"))
    if _GPU_MEMORY is not None:  # nothing to read otherwise (every job parses this file again)
        check_gpu_memory(planned_estimates(config, CHOSEN, SPARSE_BASES, Path("resources/models")), _GPU_MEMORY)
except ConfigError as error:
    raise WorkflowError(str(error)) from None
ATTENTION = config["attention"]
ATTENTION_DATASETS = CHOSEN["attention_datasets"]
HEADS = ATTENTION["heads"]
ATTENTION_FIGURES = CHOSEN["figures"]
PRUNING = config["pruning"]
PRUNING_MODELS = CHOSEN["pruning_models"]
TASKS = list(PRUNING["tasks"]) if PRUNING_MODELS else []
# Every configured ablation gets its own sweeps and figures; the first, the primary, is the one
# whose scores and sweep ground truth reads.
ABLATIONS = pruning_ablations(PRUNING)
# mean ablation's reference: the scoring job writes it (under mean ablation), the mean sweep reads it
MEANS_FILE = "results/pruning/{model}/{task}/mean/means.safetensors"
PRIMARY_ABLATION = ABLATIONS[0]
# Compared pairs of a model and its own sparse copy, both swept: heads needed against density.
SPARSE_PAIRS = [pair for pair in sparse_pairs(comparison_pairs(PRUNING["compare"], PRUNING_MODELS), SPARSE_BASES)
                if set(pair) <= set(PRUNING_MODELS)]
# Compared pairs of a dense model (its base, or its dense control) and a sparse copy: the figures
# state the share of the dense model's clean − corrupted gap the copy keeps.
GAP_PAIRS = [pair for pair in gap_pairs(comparison_pairs(PRUNING["compare"], PRUNING_MODELS), SPARSE_BASES)
             if set(pair) <= set(PRUNING_MODELS)]
# What heads_vs_density reads: both models' sweep summaries ("model/task/ablation", every ablation)
# and each copy's held-out numbers.
DENSITY_SWEEPS = {key: f"{folder}/sweep.json" for key, folder in
                  sweep_folders([m for pair in SPARSE_PAIRS for m in pair], TASKS, ABLATIONS).items()}
# Their curves too: whether a count (and so an N×) is fragile is read from the curve itself.
DENSITY_CURVES = {key: path.replace("sweep.json", "sweep.csv") for key, path in DENSITY_SWEEPS.items()}
# and each prompt's metric at every k: the N×'s interval resamples the prompts of both models.
DENSITY_PER_PROMPT = {key: path.replace("sweep.json", "per_prompt.parquet") for key, path in DENSITY_SWEEPS.items()}
DENSITY_SUMMARIES = {copy: f"results/sparsify/{copy}/summary.json" for _, copy in SPARSE_PAIRS}
EDGE_MODELS = CHOSEN["edge_models"]  # the swept models whose edge circuits are found
EDGE_TASKS = [task for task in PRUNING["edges"]["tasks"] if task in TASKS] if EDGE_MODELS else []
# Pairs of a model and its sparse copy with edge circuits for both.
EDGE_PAIRS = [pair for pair in SPARSE_PAIRS if set(pair) <= set(EDGE_MODELS)]
# What edges_vs_density reads, as heads_vs_density does: "model/task" -> each file of the edge sweep.
EDGE_DENSITY = {kind: {f"{model}/{task}": f"results/circuits/{model}/{task}/{name}"
                       for model in dict.fromkeys(m for pair in EDGE_PAIRS for m in pair) for task in EDGE_TASKS}
                for kind, name in (("summary", "summary.json"), ("curve", "curve.csv"), ("per_prompt", "per_prompt.parquet"))}
# Every swept curve (heads under each ablation, edges) whose areas (MIB's CPR and CMD) circuit_areas
# gives, keyed "unit/model/task/ablation", with every compared pair's differences.
AREA_INPUTS = area_inputs(PRUNING_MODELS, TASKS, ABLATIONS, EDGE_MODELS, EDGE_TASKS)
AREA_PAIRS = [pair for pair in comparison_pairs(PRUNING["compare"], PRUNING_MODELS) if set(pair) <= set(PRUNING_MODELS)]
# Compiled-program models scored against their truth (attnlab.groundtruth), on their own task.
GROUNDTRUTH = config["groundtruth"]
GROUNDTRUTH_MODELS = CHOSEN["groundtruth_models"]
MLP = config["mlp"]
MLP_DATASETS = CHOSEN["mlp_datasets"]
MEDIATION = config["mediation"]
MEDIATION_CELLS = mediation_cells(config)  # (model, dataset, treated condition)


def _one_of(names):
    # An empty constraint would be no constraint: with no names, match nothing.
    return "|".join(re.escape(name) for name in names) or "(?!)"


wildcard_constraints:
    model=_one_of(MODELS),
    dataset=_one_of(DATASETS),
    condition=_one_of(CONDITIONS),
    ext="png|pdf|svg",
    task=_one_of(TASKS),
    ablation=_one_of(ABLATIONS),
    layer=r"\d+",
    head=r"\d+",
    figure=_one_of([figure["name"] for figure in ATTENTION_FIGURES]),


# ---- parameter slices: each rule gets only the config it uses ----


def model_source(wildcards):
    return config["models"][wildcards.model]["source"]


def control_training(wildcards):
    """A sparse copy's dense control (a local source under resources/sparsify/{copy}/control) is
    prepared after that copy's post-training, which writes it: its summary is the input."""
    copy = control_of(config["models"][wildcards.model]["source"], SPARSE_BASES)
    return {"trained_with": f"results/sparsify/{copy}/summary.json"} if copy else {}


def sparse_base_dir(wildcards):
    return f"resources/models/{SPARSE_BASES[wildcards.model]}"


def model_memory(least_mb):
    """``mem_mb`` of a job that loads ``{model}`` (a sparse copy not yet trained: its base): at
    least ``least_mb``, more for a model whose weights need it (attnlab.cost.defaults.model_memory_mb)."""
    def memory(wildcards, attempt):
        folder = f"resources/models/{wildcards.model}"
        weights = weights_bytes(folder) or weights_bytes(f"resources/models/{SPARSE_BASES.get(wildcards.model, '')}")
        return model_memory_mb(weights, least_mb, attempt)
    return memory


def fitted(rule, batch):
    """``mem_mb`` and ``runtime`` of a GPU rule whose job the cost fit estimates, at the attempt's
    ``batch`` (attnlab.cost.requests: the rule's old request where it cannot estimate)."""
    def asked(wildcards, input, attempt):
        inputs = {name: getattr(input, name, None) for name in READ_INPUTS}
        return job_request(rule, config, dict(wildcards.items()), inputs, attempt=attempt, local=workflow.local_exec,
                           batch=batch(wildcards, attempt), bases=SPARSE_BASES)
    return {"mem_mb": lambda wildcards, input, attempt: asked(wildcards, input, attempt).mem_mb,
            "runtime": lambda wildcards, input, attempt: asked(wildcards, input, attempt).runtime}


def model_threads(wildcards):
    """Threads of a model-running job: half of --cores locally (see attnlab.config.plan)."""
    cores = workflow.global_resources.get("_cores")  # a Resource once parsed, None when not given
    return model_job_threads(getattr(cores, "value", cores), workflow.local_exec)


def sparsify_settings(wildcards):
    return config["models"][wildcards.model]["source"]["sparsify"]


def sparsify_figures():
    return expand("results/figures/sparsify/{model}/{figure}.{ext}", model=list(SPARSE_BASES),
                  figure=["training", "density"], ext=EXT)


def dataset_spec(wildcards):
    """What prepare_dataset reads (not the dataset's generation overrides)."""
    return {k: v for k, v in config["datasets"][wildcards.dataset].items() if k != "generation"}


def condition_spec(wildcards):
    return config["conditions"][wildcards.condition]


def prompt_format(wildcards):
    return config["models"][wildcards.model]["prompt_format"]


def fewshot_input(wildcards):
    """The dataset's example pool, for a model that takes few-shot examples."""
    if not FEWSHOT[wildcards.model]:
        return {}
    return {"fewshot": f"results/data/fewshot/{wildcards.dataset}.parquet"}


def generation_settings(wildcards):
    """The cell's whole generation section: the fields of settings.Generation, in the config's order."""
    return cell_generation(config, wildcards.model, wildcards.dataset)


def grade_keys(wildcards):
    return {"model": wildcards.model, "dataset": wildcards.dataset,
            "condition": wildcards.condition}


def arm_settings(wildcards):
    """The model's ARM settings for an ARM condition (its arm_seed in place of the model's seed),
    else None (so ARM edits rerun only ARM jobs)."""
    return arm_of(config, wildcards.model, wildcards.condition)


def mlp_settings(wildcards):
    return typed.slice_of(typed.MlpAnalysis, MLP)


def mlp_files(wildcards):
    """Per-condition statistics and histograms for one model x dataset."""
    return {
        **{f"stats_{c}": f"results/mlp/{wildcards.model}/{wildcards.dataset}/{c}.csv" for c in CONDITIONS},
        **{f"hist_{c}": f"results/mlp/{wildcards.model}/{wildcards.dataset}/{c}.hist.csv" for c in CONDITIONS},
    }


def _halved(batch_size, attempt):
    """A retry after running out of memory gets half the batch of the attempt before."""
    return max(1, batch_size // 2 ** (attempt - 1))


def generation_batch(wildcards, attempt):
    return _halved(generation_settings(wildcards)["batch_size"], attempt)


def extraction_batch(wildcards, attempt):
    return _halved(ATTENTION["batch_size"], attempt)


def mlp_batch(wildcards, attempt):
    return _halved(MLP["batch_size"], attempt)


def mediation_settings(wildcards):
    return typed.slice_of(typed.Mediation, MEDIATION)


def mediation_batch(wildcards, attempt):
    return _halved(MEDIATION["batch_size"], attempt)


def mediation_keys(wildcards):
    return {"model": wildcards.model, "dataset": wildcards.dataset, "condition": wildcards.condition,
            "baseline": MEDIATION["baseline"]}


def mediation_arm(wildcards):
    """ARM's settings for the baseline runs of ``arm_seeds`` (None: none asked for)."""
    return config["models"][wildcards.model]["arm"] if MEDIATION["arm_seeds"] else None


def mediation_inputs(wildcards):
    cell = f"{wildcards.model}/{wildcards.dataset}"
    return {"model": f"resources/models/{wildcards.model}",
            "baseline": f"results/prompts/{cell}/{MEDIATION['baseline']}.parquet",
            "treated": f"results/prompts/{cell}/{wildcards.condition}.parquet",
            "generations": f"results/generations/{cell}/{wildcards.condition}.parquet",
            "grades": f"results/grades/{cell}/{wildcards.condition}.csv"}


def mediation_summaries():
    return [f"results/mediation/{m}/{d}/{c}.json" for m, d, c in MEDIATION_CELLS]


def extraction_settings(wildcards):
    return typed.slice_of(typed.Extraction, ATTENTION)


def attention_files(wildcards):
    """One HDF5 per condition for a model x dataset, in CONDITIONS order."""
    return expand("results/attention/{model}/{dataset}/{condition}.h5",
                  model=wildcards.model, dataset=wildcards.dataset, condition=CONDITIONS)


def composite_figure(wildcards):
    """One configured composite figure: its panels (datasets filled in), conditions and layout."""
    return next(figure for figure in ATTENTION_FIGURES if figure["name"] == wildcards.figure)


def composite_figure_files(wildcards):
    """The attention files one composite figure reads, and only those."""
    return list(figure_files(composite_figure(wildcards)).values())


def scoring_settings(wildcards):
    return typed.scoring_params(PRUNING, wildcards.task, ABLATIONS)


def sweep_settings(wildcards):
    return typed.sweep_params(PRUNING, wildcards.ablation)


def sweep_means(wildcards):
    """The scoring job's mean reference, which only a mean sweep reads."""
    return [MEANS_FILE.format(model=wildcards.model, task=wildcards.task)] if wildcards.ablation == "mean" else []


def wildcard_ablation(wildcards):
    return wildcards.ablation


def pruning_batch(wildcards, attempt):
    return _halved(PRUNING["batch_size"], attempt)


def _sweep_files(task: str, folder: str, names: tuple[str, str, str], models: list[str]) -> dict[str, str]:
    """Each model's curves, count summary and per-prompt metrics for one task, under
    results/{folder}/ (pruning: heads; circuits: edges), keyed as plot_pruning.py reads them."""
    return {f"{kind}_{model}": f"results/{folder}/{model}/{task}/{name}"
            for model in models for kind, name in zip(("sweep", "summary", "per_prompt"), names)}


def pruning_sweeps(wildcards):
    """Each swept model's sweep of one task under one ablation."""
    names = tuple(f"{wildcards.ablation}/{name}" for name in ("sweep.csv", "sweep.json", "per_prompt.parquet"))
    return _sweep_files(wildcards.task, "pruning", names, PRUNING_MODELS)


def edge_settings(wildcards):
    return typed.edge_params(PRUNING)


def groundtruth_settings(wildcards):
    return typed.slice_of(typed.GroundTruth, {**PRUNING, **GROUNDTRUTH})


def groundtruth_batch(wildcards, attempt):
    return _halved(GROUNDTRUTH["batch_size"], attempt)


def edge_batch(wildcards, attempt):
    return _halved(PRUNING["edges"]["batch_size"], attempt)


def edge_sweeps(wildcards):
    return _sweep_files(wildcards.task, "circuits", ("curve.csv", "summary.json", "per_prompt.parquet"), EDGE_MODELS)


def pruning_bootstrap():
    """The resamples behind every interval, with the seed they are drawn from."""
    return {**PRUNING["bootstrap"], "seed": PRUNING["seed"]}


# ---- targets ----


def cell_summaries(wildcards):
    """Summaries of every condition for one model x dataset."""
    return expand("results/grades/{model}/{dataset}/{condition}.json",
                  model=wildcards.model, dataset=wildcards.dataset, condition=CONDITIONS)


def models_on_dataset(wildcards):
    """The models that run on one dataset (models.*.datasets), in the config's order."""
    return models_on(config, wildcards.dataset)


def accuracy_summaries(wildcards):
    """Per-cell summaries for one dataset (its models x conditions)."""
    return expand("results/grades/{model}/{dataset}/{condition}.json",
                  model=models_on_dataset(wildcards), dataset=wildcards.dataset, condition=CONDITIONS)


def placement_summaries(wildcards):
    """Summaries of the conditions the placement table compares (ARM left out), one dataset."""
    return expand("results/grades/{model}/{dataset}/{condition}.json",
                  model=models_on_dataset(wildcards), dataset=wildcards.dataset, condition=list(PLACEMENTS))


def dataset_items(wildcards):
    """The graded items of one dataset's cells (its paired comparisons read them)."""
    return [summary.replace(".json", ".csv") for summary in accuracy_summaries(wildcards)]


def all_summaries():
    return [summary for model, datasets in MODEL_DATASETS.items()
            for summary in expand("results/grades/{model}/{dataset}/{condition}.json",
                                  model=model, dataset=datasets, condition=CONDITIONS)]


def attention_targets():
    ext = EXT
    targets = []
    for model in MODELS:
        for dataset in [d for d in ATTENTION_DATASETS if d in MODEL_DATASETS[model]]:
            figures = f"results/figures/attention/{model}/{dataset}"
            tables = f"results/tables/attention/{model}/{dataset}"
            targets += [f"{figures}/layer{h['layer']}_head{h['head']}.{ext}" for h in HEADS]
            targets += [f"{tables}/lambda.csv", f"{figures}/lambda.{ext}"]
            if ATTENTION["top_changed"]["k"]:
                targets += [f"{tables}/head_changes.csv", f"{figures}/top_changed"]
    targets += [f"results/figures/attention/composite/{figure['name']}.{ext}" for figure in ATTENTION_FIGURES]
    return targets


def pruning_targets():
    return [
        *expand("results/pruning/{model}/{task}/scores.json", model=PRUNING_MODELS, task=TASKS),
        *expand("results/figures/pruning/{ablation}/{task}.{ext}", ablation=ABLATIONS, task=TASKS, ext=EXT),
        *(["results/tables/heads_vs_density.csv"] if SPARSE_PAIRS and TASKS else []),
        *(["results/tables/areas.csv"] if TASKS else []),
    ]


def edge_targets():
    return [
        *expand("results/circuits/{model}/{task}/edges.parquet", model=EDGE_MODELS, task=EDGE_TASKS),
        *expand("results/figures/circuits/{task}.{ext}", task=EDGE_TASKS, ext=EXT),
        *expand("results/figures/circuits/{model}/{task}.circuit.{ext}", model=EDGE_MODELS, task=EDGE_TASKS,
                ext=EXT),
        *(["results/tables/edges_vs_density.csv"] if EDGE_PAIRS and EDGE_TASKS else []),
    ]


def groundtruth_targets():
    if not GROUNDTRUTH_MODELS:
        return []
    return ["results/tables/groundtruth.csv", f"results/figures/groundtruth/roc.{EXT}"]


def mlp_targets():
    return [target for model in MODELS for dataset in MLP_DATASETS if dataset in MODEL_DATASETS[model]
            for target in (f"results/tables/mlp/{model}/{dataset}.csv", f"results/figures/mlp/{model}/{dataset}.{EXT}")]


def placement_targets():
    if not PLACEMENT_SWEEP:
        return []
    datasets = [dataset for dataset in DATASETS if models_on(config, dataset)]
    return [*expand("results/tables/placement/{dataset}.csv", dataset=datasets),
            *expand("results/figures/placement/{dataset}.{ext}", dataset=datasets, ext=EXT)]


def length_sweep_targets():
    if not LENGTH_SWEEP:
        return []
    return [f"results/figures/length_sweep/{model}/{dataset}.{EXT}"
            for model, datasets in MODEL_DATASETS.items() for dataset in datasets]


def all_targets():
    return [
        *sparsify_figures(),
        *length_sweep_targets(),
        *pruning_targets(),
        *edge_targets(),
        *groundtruth_targets(),
        *(["results/tables/accuracy.csv"] if all_summaries() else []),  # none: every model has datasets: []
        *expand("results/figures/accuracy/{dataset}.{ext}",
                dataset=[dataset for dataset in DATASETS if models_on(config, dataset)], ext=config["plots"]["format"]),
        *expand("results/tables/accuracy_paired/{dataset}.csv",
                dataset=[dataset for dataset in DATASETS if models_on(config, dataset)]),
        *attention_targets(),
        *mlp_targets(),
        *placement_targets(),
        *([f"results/figures/mediation/{m}/{d}/{c}.{EXT}" for m, d, c in MEDIATION_CELLS]
          + ["results/tables/mediation.csv"] if MEDIATION_CELLS else []),
    ]
