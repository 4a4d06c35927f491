from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.plot_placement(
    table_path=snakemake.input[0],
    out_path=snakemake.output[0],
    dataset=snakemake.wildcards.dataset,
    models=snakemake.params.models,
    dpi=snakemake.params.dpi,
)
