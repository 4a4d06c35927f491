rule edge_circuit:
    """Every edge's EAP-IG score on the prompts heads were ranked on, then the top n edges kept
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
        mem_mb=lambda wildcards, attempt: 16000 * attempt,
        runtime=lambda wildcards, attempt: 60 * attempt,
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
        models=PRUNING_MODELS,
        compare=PRUNING["compare"],
        threshold=PRUNING["threshold"],
        bootstrap=pruning_bootstrap(),
        dpi=config["plots"]["dpi"],
    log:
        "results/logs/plot_edges/{task}.{ext}.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/plot_edges.py"
