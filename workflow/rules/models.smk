rule prepare_model:
    """Hub id, local folder or packaged GGUF -> a plain Hugging Face folder, once."""
    output:
        directory("resources/models/{model}"),
    params:
        source=model_source,
    log:
        "results/logs/prepare_model/{model}.log",
    benchmark:
        "results/benchmarks/prepare_model/{model}.tsv"
    resources:
        mem_mb=lambda wildcards, attempt: 16000 * attempt,
        runtime=60,
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/prepare_model.py"
