rule plot_accuracy:
    """Grouped bars per dataset: one group per model, one bar per condition; below, each
    condition's paired difference from the baseline."""
    input:
        summaries=accuracy_summaries,
        paired="results/tables/accuracy_paired/{dataset}.csv",
    output:
        report(
            "results/figures/accuracy/{dataset}.{ext}",
            caption="../report/accuracy.rst",
            category="Accuracy",
            subcategory="{dataset}",
        ),
    params:
        models=models_on_dataset,
        conditions=CONDITIONS,
        dpi=config["plots"]["dpi"],
    log:
        "results/logs/plot_accuracy/{dataset}.{ext}.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/plot_accuracy.py"


rule plot_length_sweep:
    """Accuracy vs inserted length, one line per inserted kind (conditions at several lengths)."""
    input:
        cell_summaries,
    output:
        report(
            "results/figures/length_sweep/{model}/{dataset}.{ext}",
            caption="../report/length_sweep.rst",
            category="Accuracy",
            subcategory="length sweep",
        ),
    params:
        families=FAMILIES,
        dpi=config["plots"]["dpi"],
    log:
        "results/logs/plot_length_sweep/{model}/{dataset}.{ext}.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/plot_length_sweep.py"


rule placement_table:
    """Accuracy by where the insertion goes, next to the plain prompt."""
    input:
        placement_summaries,
    output:
        report(
            "results/tables/placement/{dataset}.csv",
            caption="../report/placement_table.rst",
            category="Accuracy",
            subcategory="placement",
        ),
    params:
        placements=PLACEMENTS,
    log:
        "results/logs/placement_table/{dataset}.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/placement_table.py"


rule plot_placement:
    """Accuracy by placement of the insertion, one panel per inserted kind and grader."""
    input:
        "results/tables/placement/{dataset}.csv",
    output:
        report(
            "results/figures/placement/{dataset}.{ext}",
            caption="../report/placement.rst",
            category="Accuracy",
            subcategory="placement",
        ),
    params:
        models=models_on_dataset,
        dpi=config["plots"]["dpi"],
    log:
        "results/logs/plot_placement/{dataset}.{ext}.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/plot_placement.py"
