from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.log_request("sparsify_model", snakemake)
steps.sparsify_model(
    name=snakemake.wildcards.model,
    base_dir=snakemake.input.base,
    settings=snakemake.params.settings,
    outputs=dict(snakemake.output.items()),
    checkpoint=snakemake.params.checkpoint,
    threads=snakemake.threads,
)
