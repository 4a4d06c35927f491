rule generate:
    """Batched greedy decoding; CUDA when present, else CPU."""
    input:
        model="resources/models/{model}",
        prompts="results/prompts/{model}/{dataset}/{condition}.parquet",
    output:
        "results/generations/{model}/{dataset}/{condition}.parquet",
    params:
        generation=generation_settings,
        arm=arm_settings,
    threads: model_threads
    log:
        "results/logs/generate/{model}/{dataset}/{condition}.log",
    benchmark:
        "results/benchmarks/generate/{model}/{dataset}/{condition}.tsv"
    resources:
        gpu=1,
        batch_size=generation_batch,
        **fitted("generate", generation_batch),
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/generate.py"


rule grade:
    """Extract answers; grade with math-verify and the paper's lenient grader."""
    input:
        prompts="results/prompts/{model}/{dataset}/{condition}.parquet",
        generations="results/generations/{model}/{dataset}/{condition}.parquet",
    output:
        per_item="results/grades/{model}/{dataset}/{condition}.csv",
        summary="results/grades/{model}/{dataset}/{condition}.json",
    params:
        cell=grade_keys,
        grading=config["grading"],
    log:
        "results/logs/grade/{model}/{dataset}/{condition}.log",
    benchmark:
        "results/benchmarks/grade/{model}/{dataset}/{condition}.tsv"
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/grade.py"


rule accuracy_table:
    """Accuracy per model x dataset x condition, both graders, Wilson score interval."""
    input:
        all_summaries(),
    output:
        report(
            "results/tables/accuracy.csv",
            caption="../report/accuracy_table.rst",
            category="Accuracy",
        ),
    params:
        config=CONFIG_LABEL,
    log:
        "results/logs/accuracy_table.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/accuracy_table.py"


rule accuracy_paired:
    """Each condition against grading.baseline on the same items, per model x grader, for one
    dataset: the paired difference (Newcombe's interval), McNemar's exact p, Holm-adjusted."""
    input:
        dataset_items,
    output:
        report(
            "results/tables/accuracy_paired/{dataset}.csv",
            caption="../report/accuracy_paired.rst",
            category="Accuracy",
            subcategory="{dataset}",
        ),
    params:
        baseline=config["grading"]["baseline"],
        confidence=config["grading"]["confidence"],
        config=CONFIG_LABEL,
    log:
        "results/logs/accuracy_paired/{dataset}.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/accuracy_paired.py"
