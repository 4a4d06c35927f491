from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.plot_accuracy(
    summary_paths=list(snakemake.input.summaries),
    paired_path=snakemake.input.paired,
    out_path=snakemake.output[0],
    dataset=snakemake.wildcards.dataset,
    models=snakemake.params.models,
    conditions=snakemake.params.conditions,
    dpi=snakemake.params.dpi,
)
