from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.accuracy_paired(list(snakemake.input), snakemake.output[0], baseline=snakemake.params.baseline,
                      confidence=snakemake.params.confidence, config=snakemake.params.config)
