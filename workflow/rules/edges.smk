rule edge_circuit:
    """Every edge ordered by pruning.edges.method (EAP-IG's scores, ACDC's circuit or Edge
    Pruning's masks) on the prompts heads were ranked on, then the top n edges kept
    (the rest patched from the corrupted run) on the prompts heads were counted on: the explained
    effect for each n, each prompt's metric, the edges to the threshold with their interval."""
    input:
        model="resources/models/{model}",
        prompts="results/pruning/{model}/{task}/prompts.json",
        scoring="results/pruning/{model}/{task}/scores.json",
    output:
        edges="results/circuits/{model}/{task}/edges.parquet",
        curve="results/circuits/{model}/{task}/curve.csv",
        per_prompt="results/circuits/{model}/{task}/per_prompt.parquet",
        summary="results/circuits/{model}/{task}/summary.json",
    params:
        settings=edge_settings,
    threads: model_threads
    priority: 1
    log:
        "results/logs/edge_circuit/{model}/{task}.log",
    benchmark:
        "results/benchmarks/edge_circuit/{model}/{task}.tsv"
    resources:
        gpu=1,
        **fitted("edge_circuit", edge_batch),
        batch_size=edge_batch,
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/edge_circuit.py"


rule plot_edges:
    """Explained effect vs edges kept, one curve per model (a model and its sparse copy on one
    axis), with each count's and N×'s interval."""
    input:
        unpack(edge_sweeps),
    output:
        report(
            "results/figures/circuits/{task}.{ext}",
            caption="../report/edges.rst",
            category="Edge circuits",
        ),
    params:
        models=EDGE_MODELS,
        compare=PRUNING["compare"],
        threshold=PRUNING["threshold"],
        ablation="corrupted",
        ranking=typed.edge_ranking(PRUNING["edges"]),
        bootstrap=pruning_bootstrap(),
        dpi=config["plots"]["dpi"],
        unit="edges",
    log:
        "results/logs/plot_edges/{task}.{ext}.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/plot_pruning.py"


rule plot_circuit:
    """The circuit at the first crossing of the threshold: components as nodes by layer, its
    edges by |score| (the strongest drawn where there are many)."""
    input:
        edges="results/circuits/{model}/{task}/edges.parquet",
        summary="results/circuits/{model}/{task}/summary.json",
    output:
        report(
            "results/figures/circuits/{model}/{task}.circuit.{ext}",
            caption="../report/circuit.rst",
            category="Edge circuits",
        ),
    params:
        dpi=config["plots"]["dpi"],
    log:
        "results/logs/plot_circuit/{model}/{task}.{ext}.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/plot_circuit.py"


rule edges_vs_density:
    """Edges each dense model needs against its sparse copies', by the copies' held-out density."""
    input:
        sweeps=list(EDGE_DENSITY["summary"].values()),
        curves=list(EDGE_DENSITY["curve"].values()),
        per_prompt=list(EDGE_DENSITY["per_prompt"].values()),
        summaries=list(DENSITY_SUMMARIES.values()),
    output:
        table="results/tables/edges_vs_density.csv",
        figure=report(
            f"results/figures/circuits/edges_vs_density.{EXT}",
            caption="../report/edges_vs_density.rst",
            category="Edge circuits",
        ),
    params:
        sweep_keys=list(EDGE_DENSITY["summary"]),
        copies=list(DENSITY_SUMMARIES),
        pairs=EDGE_PAIRS,
        n_prompts={task: PRUNING["tasks"][task]["n"] for task in EDGE_TASKS},
        bootstrap=pruning_bootstrap(),
        dpi=config["plots"]["dpi"],
        unit="edges",
    log:
        "results/logs/edges_vs_density.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/heads_vs_density.py"
