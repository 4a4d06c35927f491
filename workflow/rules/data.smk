rule prepare_dataset:
    """Any data source -> results/data/{dataset}.parquet (id, question, answer, source_*)."""
    output:
        "results/data/{dataset}.parquet",
    params:
        spec=dataset_spec,
    log:
        "results/logs/prepare_dataset/{dataset}.log",
    benchmark:
        "results/benchmarks/prepare_dataset/{dataset}.tsv"
    resources:
        mem_mb=4000,
        runtime=20,
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/prepare_dataset.py"


rule make_prompts:
    """Prompts per model x dataset x condition with token spans of each region."""
    input:
        model="resources/models/{model}",
        dataset="results/data/{dataset}.parquet",
    output:
        "results/prompts/{model}/{dataset}/{condition}.parquet",
    params:
        condition=condition_spec,
        prompt=config["prompt"],
        prompt_format=prompt_format,
    log:
        "results/logs/make_prompts/{model}/{dataset}/{condition}.log",
    benchmark:
        "results/benchmarks/make_prompts/{model}/{dataset}/{condition}.tsv"
    resources:
        mem_mb=4000,
        runtime=20,
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/make_prompts.py"
