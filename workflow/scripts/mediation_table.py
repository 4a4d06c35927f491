from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.mediation_table(list(snakemake.input), snakemake.output[0], config=snakemake.params.config)
