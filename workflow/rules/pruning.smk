rule score_heads:
    """Task prompts for this tokenizer, the share heads are ranked on, then every head's exact
    patching and attribution scores on that share, under each configured ablation (one job: the
    prompts and the model load are shared)."""
    input:
        model="resources/models/{model}",
    output:
        prompts="results/pruning/{model}/{task}/prompts.json",
        scores=expand("results/pruning/{{model}}/{{task}}/{ablation}/scores.csv", ablation=ABLATIONS),
        summary="results/pruning/{model}/{task}/scores.json",
        # mean ablation's reference over the held-apart pool, taken once here for the mean sweep
        means=[MEANS_FILE] if "mean" in ABLATIONS else [],
    params:
        settings=scoring_settings,
    threads: model_threads
    # Scoring and the long sweeps start as soon as their model is ready, so that locally
    # they run beside the many short generation jobs rather than alone at the end.
    priority: 1
    log:
        "results/logs/score_heads/{model}/{task}.log",
    benchmark:
        "results/benchmarks/score_heads/{model}/{task}.tsv"
    resources:
        gpu=1,
        **fitted("score_heads", pruning_batch),  # one job scores every ablation: minutes for each
        batch_size=pruning_batch,
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/score_heads.py"


rule sweep_heads:
    """On the prompts heads were not ranked on, keep the top-k heads, ablate the rest under one
    ablation: the metric and explained effect for each k, each prompt's metric, the count with its
    interval, and the unpatched model's clean and corrupted metric on each counted prompt."""
    input:
        model="resources/models/{model}",
        prompts="results/pruning/{model}/{task}/prompts.json",
        scores="results/pruning/{model}/{task}/{ablation}/scores.csv",
        scoring="results/pruning/{model}/{task}/scores.json",
        means=sweep_means,
    output:
        sweep="results/pruning/{model}/{task}/{ablation}/sweep.csv",
        per_prompt="results/pruning/{model}/{task}/{ablation}/per_prompt.parquet",
        summary="results/pruning/{model}/{task}/{ablation}/sweep.json",
    params:
        settings=sweep_settings,
    threads: model_threads
    priority: 1
    log:
        "results/logs/sweep_heads/{model}/{task}/{ablation}.log",
    benchmark:
        "results/benchmarks/sweep_heads/{model}/{task}/{ablation}.tsv"
    resources:
        gpu=1,
        **fitted("sweep_heads", pruning_batch),
        batch_size=pruning_batch,
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/sweep_heads.py"


rule plot_pruning:
    """Explained effect vs heads kept under one ablation, one curve per model, with the Nx label
    and intervals, and the gap a sparse copy keeps of its base's."""
    input:
        unpack(pruning_sweeps),
    output:
        report(
            "results/figures/pruning/{ablation}/{task}.{ext}",
            caption="../report/pruning.rst",
            category="Head pruning",
        ),
    params:
        models=PRUNING_MODELS,
        compare=PRUNING["compare"],
        threshold=PRUNING["threshold"],
        ablation=wildcard_ablation,
        ranking=PRUNING["ranking"],
        bootstrap=pruning_bootstrap(),
        dpi=config["plots"]["dpi"],
        unit="heads",
        copies=GAP_PAIRS,
    log:
        "results/logs/plot_pruning/{ablation}/{task}.{ext}.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/plot_pruning.py"


rule heads_vs_density:
    """Heads each dense model needs against its sparse copies', by the copies' held-out density."""
    input:
        sweeps=list(DENSITY_SWEEPS.values()),
        curves=list(DENSITY_CURVES.values()),
        per_prompt=list(DENSITY_PER_PROMPT.values()),
        summaries=list(DENSITY_SUMMARIES.values()),
    output:
        table="results/tables/heads_vs_density.csv",
        figure=report(
            f"results/figures/pruning/heads_vs_density.{EXT}",
            caption="../report/heads_vs_density.rst",
            category="Head pruning",
        ),
    params:
        sweep_keys=list(DENSITY_SWEEPS),
        copies=list(DENSITY_SUMMARIES),
        pairs=SPARSE_PAIRS,
        n_prompts={task: PRUNING["tasks"][task]["n"] for task in TASKS},
        bootstrap=pruning_bootstrap(),
        dpi=config["plots"]["dpi"],
        unit="heads",
    log:
        "results/logs/heads_vs_density.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/heads_vs_density.py"


rule circuit_areas:
    """MIB's areas (CPR, CMD) of every swept curve, heads and edges, with bootstrap intervals; for
    every compared pair the differences of the areas, the N× and the kept gap, with intervals; and
    per ablation one figure with a panel per task (seed 004's)."""
    input:
        [path for paths in AREA_INPUTS.values() for path in paths.values()],
    output:
        areas="results/tables/areas.csv",
        differences="results/tables/area_differences.csv",
        figures=report(
            [f"results/figures/pruning/{ablation}/tasks.{EXT}" for ablation in ABLATIONS],
            caption="../report/areas.rst",
            category="Head pruning",
        ),
    params:
        inputs=AREA_INPUTS,
        pairs=AREA_PAIRS,
        ablations=ABLATIONS,  # in the order of output.figures
        threshold=PRUNING["threshold"],
        bootstrap=pruning_bootstrap(),
        dpi=config["plots"]["dpi"],
    log:
        "results/logs/circuit_areas.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/circuit_areas.py"
