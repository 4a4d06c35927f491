import os
import re
import sys

from snakemake.utils import validate

# The pure-stdlib parts of the library are importable even when Snakemake
# runs outside the project's environment.
sys.path.insert(0, os.path.join(workflow.basedir, "src"))
from attnlab.sources import SourceError, check_model_source


validate(config, "../../config/schema.yaml")

MODELS = list(config["models"])
DATASETS = list(config["datasets"])
CONDITIONS = list(config["conditions"])

for _name, _model in config["models"].items():
    try:
        check_model_source(_name, _model["source"])
    except SourceError as error:
        raise WorkflowError(str(error)) from None


def _one_of(names):
    return "|".join(re.escape(name) for name in names)


wildcard_constraints:
    model=_one_of(MODELS),
    dataset=_one_of(DATASETS),
    condition=_one_of(CONDITIONS),
    ext="png|pdf|svg",


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


# ---- targets ----


def accuracy_summaries(wildcards):
    """Per-cell summaries for one dataset (all models x conditions)."""
    return expand("results/grades/{model}/{dataset}/{condition}.json",
                  model=MODELS, dataset=wildcards.dataset, condition=CONDITIONS)


def all_summaries():
    return expand("results/grades/{model}/{dataset}/{condition}.json",
                  model=MODELS, dataset=DATASETS, condition=CONDITIONS)


def all_targets():
    return [
        "results/tables/accuracy.csv",
        *expand("results/figures/accuracy/{dataset}.{ext}",
                dataset=DATASETS, ext=config["plots"]["format"]),
    ]
