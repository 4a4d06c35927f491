import os
import re
import sys

from snakemake.utils import validate

# The pure-stdlib parts of the library are importable even when Snakemake
# runs outside the project's environment.
sys.path.insert(0, os.path.join(workflow.basedir, "src"))
from attnlab.sources import SourceError, check_heads, check_model_source, prepared_model_shape


validate(config, "../../config/schema.yaml")

MODELS = list(config["models"])
DATASETS = list(config["datasets"])
CONDITIONS = list(config["conditions"])
EXT = config["plots"]["format"]

def _family(spec):
    """What a condition inserts, regardless of length; None when it inserts nothing."""
    if spec["kind"] == "none" or spec.get("length", 0) == 0:
        return None
    return f"repeat '{spec['unit']}'" if spec["kind"] == "repeat" else f"text: {spec.get('text', 'default')[:24]}"


FAMILIES = {name: _family(spec) for name, spec in config["conditions"].items()}
# A length sweep: some inserted kind configured at two or more lengths.
LENGTH_SWEEP = any(list(FAMILIES.values()).count(f) > 1 for f in set(FAMILIES.values()) - {None})

ATTENTION = config["attention"]
ATTENTION_DATASETS = (ATTENTION["datasets"] or DATASETS) if ATTENTION["enabled"] else []
HEADS = ATTENTION["heads"]
PRUNING = config["pruning"]
PRUNING_MODELS = (PRUNING["models"] or MODELS) if PRUNING["enabled"] else []
TASKS = list(PRUNING["tasks"]) if PRUNING["enabled"] else []


def _check_config():
    """Cross-references the schema cannot express; fails before any job runs."""
    for name, model in config["models"].items():
        check_model_source(name, model["source"])
        shape = prepared_model_shape(f"resources/models/{name}")
        if shape and ATTENTION_DATASETS:
            check_heads(HEADS, *shape, name)
    unknown = [d for d in ATTENTION_DATASETS if d not in DATASETS]
    if unknown:
        raise SourceError(f"attention.datasets names {unknown}, not in datasets: {DATASETS}")
    unknown = [m for m in PRUNING_MODELS + (PRUNING["compare"] or []) if m not in MODELS]
    if unknown:
        raise SourceError(f"pruning names models {unknown}, not in models: {MODELS}")
    top = ATTENTION["top_changed"]
    if top["k"] and ATTENTION_DATASETS:
        missing = [c for c in top["between"] if c not in CONDITIONS]
        if missing:
            raise SourceError(
                f"attention.top_changed.between names {missing}, not in conditions: "
                f"{CONDITIONS}; set it to two configured conditions or k: 0"
            )


try:
    _check_config()
except SourceError as error:
    raise WorkflowError(str(error)) from None


def _one_of(names):
    return "|".join(re.escape(name) for name in names)


wildcard_constraints:
    model=_one_of(MODELS),
    dataset=_one_of(DATASETS),
    condition=_one_of(CONDITIONS),
    ext="png|pdf|svg",
    task=_one_of(TASKS),
    layer=r"\d+",
    head=r"\d+",


# ---- parameter slices: each rule gets only the config it uses ----


def model_source(wildcards):
    return config["models"][wildcards.model]["source"]


def dataset_spec(wildcards):
    return config["datasets"][wildcards.dataset]


def condition_spec(wildcards):
    return config["conditions"][wildcards.condition]


def prompt_format(wildcards):
    return config["models"][wildcards.model]["prompt_format"]


def generation_settings(wildcards):
    """Top-level generation settings, then the dataset's, then the model's overrides."""
    return {
        **config["generation"],
        **config["datasets"][wildcards.dataset].get("generation", {}),
        **config["models"][wildcards.model].get("generation", {}),
    }


def grade_keys(wildcards):
    return {"model": wildcards.model, "dataset": wildcards.dataset,
            "condition": wildcards.condition}


def extraction_settings(wildcards):
    keys = ("max_prompts", "batch_size", "device", "dtype", "full_map_layers")
    return {key: ATTENTION[key] for key in keys}


def attention_files(wildcards):
    """One HDF5 per condition for a model x dataset, in CONDITIONS order."""
    return expand("results/attention/{model}/{dataset}/{condition}.h5",
                  model=wildcards.model, dataset=wildcards.dataset, condition=CONDITIONS)


def pruning_settings(wildcards):
    """The pruning settings one model x task uses (not the plot's)."""
    keys = ("seed", "ablation", "ranking", "exact", "batch_size", "device", "all_k_up_to",
            "log_points", "threshold")
    return {**{key: PRUNING[key] for key in keys}, **PRUNING["tasks"][wildcards.task]}


def pruning_sweeps(wildcards):
    return expand("results/pruning/{model}/{task}/sweep.csv", model=PRUNING_MODELS, task=wildcards.task)


# ---- targets ----


def cell_summaries(wildcards):
    """Summaries of every condition for one model x dataset."""
    return expand("results/grades/{model}/{dataset}/{condition}.json",
                  model=wildcards.model, dataset=wildcards.dataset, condition=CONDITIONS)


def accuracy_summaries(wildcards):
    """Per-cell summaries for one dataset (all models x conditions)."""
    return expand("results/grades/{model}/{dataset}/{condition}.json",
                  model=MODELS, dataset=wildcards.dataset, condition=CONDITIONS)


def all_summaries():
    return expand("results/grades/{model}/{dataset}/{condition}.json",
                  model=MODELS, dataset=DATASETS, condition=CONDITIONS)


def attention_targets():
    ext = EXT
    targets = []
    for model in MODELS:
        for dataset in ATTENTION_DATASETS:
            figures = f"results/figures/attention/{model}/{dataset}"
            tables = f"results/tables/attention/{model}/{dataset}"
            targets += [f"{figures}/layer{h['layer']}_head{h['head']}.{ext}" for h in HEADS]
            targets += [f"{tables}/lambda.csv", f"{figures}/lambda.{ext}"]
            if ATTENTION["top_changed"]["k"]:
                targets += [f"{tables}/head_changes.csv", f"{figures}/top_changed"]
    return targets


def pruning_targets():
    return [
        *expand("results/pruning/{model}/{task}/scores.csv", model=PRUNING_MODELS, task=TASKS),
        *expand("results/figures/pruning/{task}.{ext}", task=TASKS, ext=EXT),
    ]


def length_sweep_targets():
    if not LENGTH_SWEEP:
        return []
    return expand("results/figures/length_sweep/{model}/{dataset}.{ext}",
                  model=MODELS, dataset=DATASETS, ext=EXT)


def all_targets():
    return [
        *length_sweep_targets(),
        *pruning_targets(),
        "results/tables/accuracy.csv",
        *expand("results/figures/accuracy/{dataset}.{ext}",
                dataset=DATASETS, ext=config["plots"]["format"]),
        *attention_targets(),
    ]
