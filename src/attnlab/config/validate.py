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

import logging
import os
from pathlib import Path

from attnlab.anatomy.families import UnknownFamily, config_shape, family_of, text_config
from attnlab.config.checks import (ConfigError, fused_mode, check_arithmetic_range, check_chat_template, check_heads,
                                   check_layer, check_raw_template, damaged_model_files,
                                   prepared_has_chat_template, prepared_model_config)
from attnlab.config.schema import validate_config
from attnlab.config.plan import (check_attention_figures, check_fewshot, comparison_pairs, control_of, figure_panels,
                                 model_datasets, selections)
from attnlab.config.sources import (PROGRAM_SPEC, check_model_source, check_sparse_models, program_spec,
                                    source_config, sparse_bases)

log = logging.getLogger(__name__)

SCHEMA = Path(__file__).resolve().parents[3] / "config" / "schema.yaml"  # the checkout's config/


def check(config: dict, schema_path: str | Path = SCHEMA, models_dir: str | Path = "resources/models",
          rebuilding: frozenset[str] = frozenset(), read_dataset=None) -> None:
    """Validate ``config`` in place (defaults filled) or raise ConfigError on the first problem.
    ``rebuilding``: what this run is told to rebuild (Snakemake's --forcerun targets and rules,
    "all" for --forceall): a prepared model folder in it is not read, so that a damaged one
    can be rebuilt. ``read_dataset(name, spec)``: reads a user's local data file as its job will
    (the workflow passes ``reasoning.data.check_local_dataset``, the job's own reader: this
    parse-time layer does not import the stage)."""
    validate_config(config, schema_path)
    chosen = selections(config)
    _check_sources(config, read_dataset)
    _check_names(config, chosen)
    _check_pruning(config["pruning"])
    _check_groundtruth(config, chosen)
    _check_models(config, chosen, Path(models_dir), rebuilding)


def _check_pruning(pruning: dict) -> None:
    """Exact patching cannot be both the ranking and switched off; edge circuits use a head
    sweep's prompts, so their tasks must be swept."""
    if pruning["ranking"] == "exact" and not pruning["exact"]:
        raise ConfigError("pruning.exact is false but pruning.ranking is exact (its default): heads are "
                          "ranked by exact patching; remove exact: false, or set ranking: attribution "
                          "to rank by attribution alone")
    pruned = pruning["edges"]["edge_pruning"]
    if pruned["warmup"] > pruned["steps"]:
        raise ConfigError(f"pruning.edges.edge_pruning.warmup = {pruned['warmup']} exceeds its steps = "
                          f"{pruned['steps']}: the target sparsity would never be reached; set warmup at most steps")
    unswept = [task for task in pruning["edges"]["tasks"] if task not in pruning["tasks"]]
    if unswept:
        raise ConfigError(f"pruning.edges.tasks names {unswept}, which pruning.tasks lacks "
                          f"({sorted(pruning['tasks'])}): edge circuits run on a head sweep's prompts; "
                          "add the task to pruning.tasks, or drop it from pruning.edges.tasks")


def _check_groundtruth(config: dict, chosen: dict) -> None:
    """The task 'program' runs on compiled-program models alone; a model scored against its truth
    is one, swept on that task with its edge circuit."""
    models, pruning = config["models"], config["pruning"]
    if "program" in pruning["tasks"]:
        plain = [m for m in chosen["pruning_models"] if program_spec(models[m]["source"]) is None]
        if plain:
            raise ConfigError(f"pruning.tasks has 'program', a compiled program's own task, but {plain} are not "
                              f"compiled-program models (a local source folder with {PROGRAM_SPEC}, as "
                              "data/groundtruth has): set pruning.models to those models, or drop the task")
    for name in chosen["groundtruth_models"]:
        if name not in models:
            raise ConfigError(f"groundtruth.models names '{name}', not in models: {sorted(models)}")
        if program_spec(models[name]["source"]) is None:
            raise ConfigError(f"groundtruth.models: '{name}' has no {PROGRAM_SPEC} in its source "
                              f"{models[name]['source']}: only compiled-program models (data/groundtruth, "
                              "`make groundtruth-models`) have a truth to score against")
        if name not in chosen["edge_models"] or "program" not in pruning["edges"]["tasks"]:
            raise ConfigError(f"groundtruth.models: '{name}' must be swept on the task 'program' with its edge "
                              "circuit: add program to pruning.tasks and pruning.edges.tasks, and keep the model "
                              "in pruning.models and pruning.edges.models")


def _check_sources(config: dict, read_dataset=None) -> None:
    check_sparse_models(config["models"])
    bases = sparse_bases(config["models"])
    for name, model in config["models"].items():
        copy = control_of(model["source"], bases)
        if copy is None:
            check_model_source(name, model["source"])
        elif config["models"][copy]["source"]["sparsify"]["constraint"]["type"] != "ce_control":
            kind = config["models"][copy]["source"]["sparsify"]["constraint"]["type"]
            raise ConfigError(f"models.{name}.source.local is the dense control of {copy}, but {copy} is "
                              f"post-trained under constraint.type {kind}, which trains no control: set its "
                              "constraint.type to ce_control, or remove this model")
        arm = model["arm"]
        if arm["pmin"] > arm["pmax"]:
            raise ConfigError(f"models.{name}.arm: pmin ({arm['pmin']}) is above pmax ({arm['pmax']})")
    for name, dataset in config["datasets"].items():
        check_arithmetic_range(name, dataset["source"])
        if "path" in dataset["source"] and read_dataset is not None:  # a user's file: read it now, as its job will
            read_dataset(name, dataset)
    check_raw_template(config["prompt"]["raw_template"])
    check_fewshot(config["models"], config["datasets"], config["prompt"])


def _check_names(config: dict, chosen: dict) -> None:
    """Datasets, conditions and models named outside their own sections must exist."""
    models, datasets, conditions = list(config["models"]), list(config["datasets"]), list(config["conditions"])
    if config["grading"]["baseline"] not in conditions:
        raise ConfigError(f"grading.baseline is '{config['grading']['baseline']}', not in conditions: {conditions}; "
                          "set it to the condition every other one is compared with (the plain prompt)")
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
    unknown = [m for m in config["pruning"]["edges"]["models"] or [] if m not in models]
    if unknown:  # a configured model that is not swept has no edge circuits (plan.selections)
        raise ConfigError(f"pruning.edges.models names {unknown}, not in models: {models}")
    top = config["attention"]["top_changed"]
    missing = [c for c in top["between"] if c not in conditions]
    if top["k"] and chosen["attention_datasets"] and missing:
        raise ConfigError(f"attention.top_changed.between names {missing}, not in conditions: "
                          f"{conditions}; set it to two configured conditions or k: 0")
    _check_model_datasets(config, chosen)
    _check_mediation(config)
    _check_arm_seeds(config["conditions"])


def _check_arm_seeds(conditions: dict) -> None:
    """arm_seed sets ARM's seed: a condition without ARM has none to set."""
    for name, spec in conditions.items():
        if spec.get("arm_seed") is not None and not spec["arm"]:
            raise ConfigError(f"conditions.{name} sets arm_seed without arm: true; add arm: true (ARM on that "
                              "condition with this seed) or remove arm_seed")


def _check_mediation(config: dict) -> None:
    """mediation's datasets, conditions, baseline and models must be configured, the treated
    conditions other than the baseline."""
    settings, conditions = config["mediation"], list(config["conditions"])
    for key, names, known in (("datasets", settings["datasets"], list(config["datasets"])),
                              ("conditions", settings["conditions"], conditions),
                              ("models", settings["models"] or [], list(config["models"])),
                              ("baseline", [settings["baseline"]] if settings["conditions"] else [], conditions)):
        unknown = [name for name in names if name not in known]
        if unknown:
            raise ConfigError(f"mediation.{key} names {unknown}, not configured ({known})")
    if settings["baseline"] in settings["conditions"]:
        raise ConfigError(f"mediation.conditions holds its baseline '{settings['baseline']}': a condition is "
                          "compared with the baseline, not with itself")


def _check_model_datasets(config: dict, chosen: dict) -> None:
    """``models.*.datasets`` name datasets, and a composite figure's panels models run on theirs."""
    datasets = list(config["datasets"])
    for name, spec in config["models"].items():
        unknown = [d for d in spec.get("datasets") or [] if d not in datasets]
        if unknown:
            raise ConfigError(f"models.{name}.datasets names {unknown}, not in datasets: {datasets}")
    runs_on = model_datasets(config)
    for figure in chosen["figures"]:
        for panel in figure["panels"]:
            if panel["dataset"] not in runs_on[panel["model"]]:
                raise ConfigError(f"attention.figures '{figure['name']}': model '{panel['model']}' is not run on "
                                  f"'{panel['dataset']}' (models.{panel['model']}.datasets: "
                                  f"{runs_on[panel['model']]}); name another model or dataset")


def _check_models(config: dict, chosen: dict, models_dir: Path, rebuilding: frozenset[str]) -> None:
    """Against each model: its family (one attnlab's anatomy knows), chat template, layers and
    heads, from the prepared folder (which must be whole) or, before it is prepared, from the
    source's own metadata (``source_config``)."""
    arm_used = any(spec["arm"] for spec in config["conditions"].values())
    for name, model in config["models"].items():
        prepared = models_dir / name
        if prepared.exists() and not _rebuilt(prepared, rebuilding):
            _check_whole(prepared)
            check_chat_template(name, model["prompt_format"], prepared_has_chat_template(prepared))
            metadata, where = prepared_model_config(prepared), f"{prepared}/config.json"
        else:
            metadata, where = _config_before_preparing(config["models"], name), "its source's metadata"
        if not metadata:
            continue
        _check_family(name, metadata, where, model_stages(config, chosen, name))
        shape = config_shape(metadata)
        try:
            if chosen["attention_datasets"]:
                check_heads(config["attention"]["heads"], *shape, name)
            check_heads(figure_panels(chosen["figures"], name), *shape, name, "attention.figures")
            if arm_used:
                check_layer(model["arm"]["layer"], shape[0], name, f"models.{name}.arm.layer")
            if chosen["mlp_datasets"]:
                check_layer(config["mlp"]["layer"], shape[0], name, "mlp.layer")
        except ConfigError as error:
            raise type(error)(f"{error} (layers and heads read from {where})") from None


def model_stages(config: dict, chosen: dict, name: str) -> list[str]:
    """The stages (``anatomy.families.STAGES``) this config runs on model ``name``."""
    bases = {spec["source"]["sparsify"]["base"] for spec in config["models"].values() if "sparsify" in spec["source"]}
    runs_on = model_datasets(config)[name]
    wanted = {"generation": bool(runs_on), "extraction": bool(set(chosen["attention_datasets"]) & set(runs_on)),
              "head patching": name in chosen["pruning_models"],
              "edge circuits": name in chosen["edge_models"] and any(
                  task in config["pruning"]["tasks"] for task in config["pruning"]["edges"]["tasks"]),
              "MLP analysis and ARM": bool(set(chosen["mlp_datasets"]) & set(runs_on)) or (bool(runs_on) and any(
                  spec["arm"] for spec in config["conditions"].values())),
              "sparse post-training": name in bases or "sparsify" in config["models"][name]["source"]}
    return [stage for stage, used in wanted.items() if used]


KERNEL_STAGES = ("extraction", "head patching", "edge circuits", "sparse post-training")  # attention through attnlab's


def _check_kernels(name: str, family, stages: list[str]) -> None:
    """A family the fused kernels cannot compute: refused where ATTNLAB_FUSED_ATTENTION=on asks for
    them, else said once before any job (on a GPU its layers run the eager attention blocks)."""
    if not family.kernels_lack or not set(stages) & set(KERNEL_STAGES):
        return
    lacking = ", ".join(family.kernels_lack)
    if fused_mode() == "on":
        raise ConfigError(f"model '{name}' ({family.name}) needs {lacking}, which the fused attention kernels "
                          "lack, and ATTNLAB_FUSED_ATTENTION=on asks for them: set it to auto (its layers then "
                          "run the eager attention blocks) or off")
    log.warning("model '%s' (%s): the fused attention kernels lack %s; on a GPU its layers run the eager "
                "attention blocks (the same numbers, slower, a block of scores per layer in memory)",
                name, family.name, lacking)


def _check_family(name: str, metadata: dict, where: str, stages: list[str]) -> None:
    """A model whose family the anatomy does not know is refused before any job runs."""
    try:
        family = family_of(text_config(metadata).get("model_type", "unknown"), f"model '{name}'", stages or ["none"])
    except UnknownFamily as error:
        raise ConfigError(f"{error} (model_type read from {where})") from None
    _check_kernels(name, family, stages)


def rebuild_requests(argv: list[str], dag_settings=None) -> frozenset[str]:
    """What this Snakemake run is told to rebuild: its --forcerun/-R targets and rules, "all" for
    --forceall/-F. Read from Snakemake's DAG settings where they are set, else from its command
    line (while the Snakefile is parsed they are not set yet)."""
    if dag_settings is not None:
        return frozenset(dag_settings.forcerun) | ({"all"} if dag_settings.forceall else set())
    requested, collecting = set(), False
    for token in argv[1:]:
        if token in ("-F", "--forceall"):
            requested.add("all")
        if token.startswith("-"):
            collecting = token in ("-R", "--forcerun")
            if token.startswith("--forcerun="):
                requested.update(token.split("=", 1)[1].split())
        elif collecting:
            requested.add(token)
    return frozenset(requested)


def _rebuilt(folder: Path, rebuilding: frozenset[str]) -> bool:
    """Whether this run rebuilds the prepared model ``folder`` (-R/--forcerun on it or its rule, -F)."""
    wanted = {os.path.normpath(item) for item in rebuilding}
    return bool(wanted & {"all", "prepare_model", "sparsify_model", os.path.normpath(folder)})


def _check_whole(folder: Path) -> None:
    problems = damaged_model_files(folder)
    if problems:
        raise ConfigError(f"the prepared model folder {folder} is damaged: {'; '.join(problems)}. "
                          f"Rebuild it: snakemake -R {folder} (with your usual --cores and "
                          "--configfile), or delete the folder")


def _config_before_preparing(models: dict, name: str) -> dict | None:
    """A model's config from its source (``source_config``); a sparse copy has its base's."""
    source = models[name]["source"]
    if "sparsify" in source:
        source = models[source["sparsify"]["base"]]["source"]
    try:
        return source_config(source)
    except (OSError, ValueError, KeyError):  # unreadable metadata: checked once the model is prepared
        return None
