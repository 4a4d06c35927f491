"""One entry point for every config check: ``check(config)`` (pure standard library + jsonschema).

The schema first (which also fills its defaults into ``config``), then every cross-reference
the schema cannot express: sparse copies and their bases, model and dataset sources, composite
figures, few-shot sources, templates, datasets, conditions and models named elsewhere, and,
for models already prepared under ``models_dir``, layers and heads. Every problem is a
``ConfigError`` (``SourceError`` and ``HeadRangeError`` are kinds of it) naming the key and the
fix. Snakemake calls it while it parses the workflow (common.smk), so a bad config fails in a
dry run, before any job.
"""

from __future__ import annotations

from pathlib import Path

from attnlab.checks import (ConfigError, check_arithmetic_range, check_chat_template, check_heads,
                            check_layer, check_raw_template, prepared_has_chat_template,
                            prepared_model_shape)
from attnlab.config import validate_config
from attnlab.plan import check_attention_figures, check_fewshot, comparison_pairs, figure_panels, selections
from attnlab.sources import check_model_source, check_sparse_models

SCHEMA = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"


def check(config: dict, schema_path: str | Path = SCHEMA, models_dir: str | Path = "resources/models") -> None:
    """Validate ``config`` in place (defaults filled) or raise ConfigError on the first problem."""
    validate_config(config, schema_path)
    chosen = selections(config)
    _check_sources(config)
    _check_names(config, chosen)
    _check_pruning(config["pruning"])
    _check_models(config, chosen, Path(models_dir))


def _check_pruning(pruning: dict) -> None:
    """Exact patching cannot be both the ranking and switched off."""
    if pruning["ranking"] == "exact" and not pruning["exact"]:
        raise ConfigError("pruning.exact is false but pruning.ranking is exact (the default): heads are "
                          "ranked by exact patching; remove exact: false, or set ranking: attribution "
                          "to rank by attribution alone")


def _check_sources(config: dict) -> None:
    check_sparse_models(config["models"])
    for name, model in config["models"].items():
        check_model_source(name, model["source"])
        arm = model["arm"]
        if arm["pmin"] > arm["pmax"]:
            raise ConfigError(f"models.{name}.arm: pmin ({arm['pmin']}) is above pmax ({arm['pmax']})")
    for name, dataset in config["datasets"].items():
        check_arithmetic_range(name, dataset["source"])
    check_raw_template(config["prompt"]["raw_template"])
    check_fewshot(config["models"], config["datasets"], config["prompt"])


def _check_names(config: dict, chosen: dict) -> None:
    """Datasets, conditions and models named outside their own sections must exist."""
    models, datasets, conditions = list(config["models"]), list(config["datasets"]), list(config["conditions"])
    check_attention_figures(chosen["figures"], config["conditions"], models, chosen["attention_datasets"])
    for key, names in (("attention.datasets", chosen["attention_datasets"]), ("mlp.datasets", chosen["mlp_datasets"])):
        unknown = [d for d in names if d not in datasets]
        if unknown:
            raise ConfigError(f"{key} names {unknown}, not in datasets: {datasets}")
    if chosen["mlp_datasets"] and config["mlp"]["baseline"] not in conditions:
        raise ConfigError(f"mlp.baseline is '{config['mlp']['baseline']}', not in conditions: {conditions}; "
                          "set it to the condition to compare against")
    pruning = chosen["pruning_models"]
    compared = [m for pair in comparison_pairs(config["pruning"]["compare"], pruning) for m in pair]
    unknown = [m for m in pruning + compared if m not in models]
    if unknown:
        raise ConfigError(f"pruning names models {unknown}, not in models: {models}")
    top = config["attention"]["top_changed"]
    missing = [c for c in top["between"] if c not in conditions]
    if top["k"] and chosen["attention_datasets"] and missing:
        raise ConfigError(f"attention.top_changed.between names {missing}, not in conditions: "
                          f"{conditions}; set it to two configured conditions or k: 0")


def _check_models(config: dict, chosen: dict, models_dir: Path) -> None:
    """Against each model already prepared: its chat template, layers and heads."""
    arm_used = any(spec["arm"] for spec in config["conditions"].values())
    for name, model in config["models"].items():
        prepared = models_dir / name
        check_chat_template(name, model["prompt_format"], prepared_has_chat_template(prepared))
        shape = prepared_model_shape(prepared)
        if not shape:
            continue
        if chosen["attention_datasets"]:
            check_heads(config["attention"]["heads"], *shape, name)
        check_heads(figure_panels(chosen["figures"], name), *shape, name, "attention.figures")
        if arm_used:
            check_layer(model["arm"]["layer"], shape[0], name, f"models.{name}.arm.layer")
        if chosen["mlp_datasets"]:
            check_layer(config["mlp"]["layer"], shape[0], name, "mlp.layer")
