from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.groundtruth_score(
    model_dir=snakemake.input.model,
    task=snakemake.wildcards.task,
    settings=snakemake.params.settings,
    inputs={name: snakemake.input[name] for name in ("prompts", "scores", "scoring", "sweep", "edges", "circuit")},
    outputs={name: snakemake.output[name] for name in ("table", "roc", "truth", "control")},
    threads=snakemake.threads,
    batch_size=snakemake.resources.batch_size,
)
