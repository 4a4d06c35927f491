rule mediate:
    """What carries a condition's effect: every head, MLP and residual stream patched between it and
    the baseline on the same items, both directions; shares of the total effect (attnlab.mechanism.mediation)."""
    input:
        unpack(mediation_inputs),
    output:
        effects="results/mediation/{model}/{dataset}/{condition}.parquet",
        summary="results/mediation/{model}/{dataset}/{condition}.json",
    params:
        settings=mediation_settings,
        identity=mediation_keys,
        arm=mediation_arm,
    threads: model_threads
    log:
        "results/logs/mediate/{model}/{dataset}/{condition}.log",
    benchmark:
        "results/benchmarks/mediate/{model}/{dataset}/{condition}.tsv"
    resources:
        gpu=1,
        batch_size=mediation_batch,
        **fitted("mediate", mediation_batch),
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/mediate.py"


rule plot_mediation:
    """Each head's share, each layer's MLP and residual stream, the first layer's path."""
    input:
        "results/mediation/{model}/{dataset}/{condition}.json",
    output:
        report(
            f"results/figures/mediation/{{model}}/{{dataset}}/{{condition}}.{EXT}",
            caption="../report/mediation.rst",
            category="Mediation",
            subcategory="{model}",
        ),
    params:
        dpi=config["plots"]["dpi"],
    log:
        "results/logs/plot_mediation/{model}/{dataset}/{condition}.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/plot_mediation.py"


rule mediation_table:
    """One row per model x dataset x condition x direction: the total effect and the shares of the
    first layer's attention and MLP, the top 10 heads and every head and MLP together."""
    input:
        mediation_summaries(),
    output:
        report(
            "results/tables/mediation.csv",
            caption="../report/mediation_table.rst",
            category="Mediation",
            subcategory="all models",
        ),
    params:
        config=CONFIG_LABEL,
    log:
        "results/logs/mediation_table.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/mediation_table.py"
