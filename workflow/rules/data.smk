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


rule prepare_fewshot:
    """A seeded pool of worked examples for few-shot (base) models, never an evaluated question."""
    input:
        evaluated="results/data/{dataset}.parquet",
    output:
        "results/data/fewshot/{dataset}.parquet",
    params:
        spec=lambda wildcards: fewshot_spec(wildcards.dataset, config["datasets"][wildcards.dataset]),
        seed=config["prompt"]["fewshot_seed"],
    log:
        "results/logs/prepare_fewshot/{dataset}.log",
    benchmark:
        "results/benchmarks/prepare_fewshot/{dataset}.tsv"
    resources:
        mem_mb=4000,
        runtime=20,
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/prepare_fewshot.py"


rule make_prompts:
    """Prompts per model x dataset x condition with token spans of each region."""
    input:
        unpack(fewshot_input),
        model="resources/models/{model}",
        dataset="results/data/{dataset}.parquet",
    output:
        "results/prompts/{model}/{dataset}/{condition}.parquet",
    params:
        condition=condition_spec,
        prompt={key: config["prompt"][key] for key in ("system", "raw_template")},
        prompt_format=prompt_format,
        fewshot=lambda wildcards: FEWSHOT[wildcards.model],
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
