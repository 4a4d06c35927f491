rule plot_accuracy:
    """Grouped bars per dataset: one group per model, one bar per condition."""
    input:
        accuracy_summaries,
    output:
        report(
            "results/figures/accuracy/{dataset}.{ext}",
            caption="../report/accuracy.rst",
            category="Accuracy",
            subcategory="{dataset}",
        ),
    params:
        models=MODELS,
        conditions=CONDITIONS,
        dpi=config["plots"]["dpi"],
    log:
        "results/logs/plot_accuracy/{dataset}.{ext}.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/plot_accuracy.py"
