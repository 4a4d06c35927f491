from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.log_request("mlp_activations", snakemake)
steps.mlp_activations(
    model_dir=snakemake.input.model,
    prompts_path=snakemake.input.prompts,
    stats_path=snakemake.output.stats,
    histogram_path=snakemake.output.histogram,
    settings=snakemake.params.settings,
    arm=snakemake.params.arm,
    threads=snakemake.threads,
    batch_size=snakemake.resources.batch_size,
)
