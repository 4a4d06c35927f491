from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.prepare_fewshot(snakemake.wildcards.dataset, snakemake.params.spec, snakemake.input.evaluated,
                      snakemake.output[0], snakemake.params.seed)
