rule mlp_activations:
    """One layer's MLP activations over the question tokens: per-prompt statistics and a histogram."""
    input:
        model="resources/models/{model}",
        prompts="results/prompts/{model}/{dataset}/{condition}.parquet",
    output:
        stats="results/mlp/{model}/{dataset}/{condition}.csv",
        histogram="results/mlp/{model}/{dataset}/{condition}.hist.csv",
    params:
        settings=mlp_settings,
        arm=arm_settings,
    threads: model_threads
    log:
        "results/logs/mlp_activations/{model}/{dataset}/{condition}.log",
    benchmark:
        "results/benchmarks/mlp_activations/{model}/{dataset}/{condition}.tsv"
    resources:
        gpu=1,
        batch_size=mlp_batch,
        **fitted("mlp_activations", mlp_batch),
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/mlp_activations.py"


rule mlp_summary:
    """Statistics per condition (mean, 95% CI over prompts) and histograms overlaid on the baseline."""
    input:
        unpack(mlp_files),
    output:
        table=report(
            "results/tables/mlp/{model}/{dataset}.csv",
            caption="../report/mlp_table.rst",
            category="MLP activations",
            subcategory="{model}",
        ),
        figure=report(
            f"results/figures/mlp/{{model}}/{{dataset}}.{EXT}",
            caption="../report/mlp.rst",
            category="MLP activations",
            subcategory="{model}",
        ),
    params:
        conditions=CONDITIONS,
        baseline=MLP["baseline"],
        layer=MLP["layer"],
        near_zero=MLP["near_zero"],
        dpi=config["plots"]["dpi"],
    log:
        "results/logs/mlp_summary/{model}/{dataset}.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/mlp_summary.py"
