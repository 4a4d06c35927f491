from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.plot_mediation(snakemake.input[0], snakemake.output[0], snakemake.params.dpi)
