rule prepare_model:
    """Hub id, local folder or packaged GGUF -> a plain Hugging Face folder, once (a sparse copy's
    dense control once that copy's post-training has written it; a released sparse checkpoint,
    source.format, converted to a gated GPT-2: attnlab.released)."""
    input:
        unpack(control_training),
    output:
        directory("resources/models/{model}"),
    params:
        source=model_source,
    wildcard_constraints:
        model=_one_of(DENSE_MODELS),
    log:
        "results/logs/prepare_model/{model}.log",
    benchmark:
        "results/benchmarks/prepare_model/{model}.tsv"
    resources:
        mem_mb=model_memory(16000),
        runtime=60,
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/prepare_model.py"


rule sparsify_model:
    """Post-train the sparse copy of a configured model (edge-gated attention under a loss
    constraint); it then serves every later rule as resources/models/{model}."""
    input:
        base=sparse_base_dir,
    output:
        model=directory("resources/models/{model}"),
        steps="results/sparsify/{model}/steps.csv",
        evals="results/sparsify/{model}/eval.csv",
        density="results/sparsify/{model}/density.csv",
        summary="results/sparsify/{model}/summary.json",
    params:
        settings=sparsify_settings,
        # Not an output: it must survive a job killed by the scheduler so the rerun resumes.
        checkpoint="resources/sparsify/{model}/checkpoint.pt",
    wildcard_constraints:
        model=_one_of(SPARSE_BASES),
    # Every core: on 2 cores a training step took 20.5-24 s at 2 threads and 35-40 s at 1 thread
    # beside a base's scoring job (make sparse, 2026-11-28), and the base's own jobs end well before
    # a 1-thread post-training would, leaving a core idle.
    threads: 8
    # Every job of the copy waits for it: it goes before the base's own jobs (score_heads and
    # sweep_heads: 1), which then share the cores with the copy's rather than leave one idle.
    # Snakemake's MILP scheduler adds up the priorities of the jobs it starts together: at 2, two
    # 1-thread scoring jobs tied with it on 2 cores and went first (make sparse, 2026-11-28), so
    # it must outweigh a workstation's cores of priority-1 jobs (tests/test_scheduling.py).
    priority: 50
    log:
        "results/logs/sparsify_model/{model}.log",
    benchmark:
        "results/benchmarks/sparsify_model/{model}.tsv"
    resources:
        gpu=1,
        **fitted("sparsify_model", lambda wildcards, attempt: 1),  # its batch is the settings' own
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/sparsify_model.py"


rule plot_sparsify:
    """Training and held-out curves, and the held-out density of every layer x head."""
    input:
        steps="results/sparsify/{model}/steps.csv",
        evals="results/sparsify/{model}/eval.csv",
        density="results/sparsify/{model}/density.csv",
        summary="results/sparsify/{model}/summary.json",
    output:
        training=report(
            "results/figures/sparsify/{model}/training.{ext}",
            caption="../report/sparsify_training.rst",
            category="Sparse post-training",
            subcategory="{model}",
        ),
        density=report(
            "results/figures/sparsify/{model}/density.{ext}",
            caption="../report/sparsify_density.rst",
            category="Sparse post-training",
            subcategory="{model}",
        ),
    params:
        dpi=config["plots"]["dpi"],
    wildcard_constraints:
        model=_one_of(SPARSE_BASES),
    log:
        "results/logs/plot_sparsify/{model}.{ext}.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/plot_sparsify.py"
