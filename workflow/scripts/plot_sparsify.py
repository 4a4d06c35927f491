from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.plot_sparsify(
    inputs=dict(snakemake.input.items()),
    training_path=snakemake.output.training,
    density_path=snakemake.output.density,
    model=snakemake.wildcards.model,
    dpi=snakemake.params.dpi,
)
