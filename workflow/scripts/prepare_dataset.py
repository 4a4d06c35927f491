from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.prepare_dataset(snakemake.wildcards.dataset, snakemake.params.spec, snakemake.output[0])
