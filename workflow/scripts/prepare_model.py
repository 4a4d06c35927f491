from attnlab import steps

steps.setup_logging(snakemake.log[0])
# The prompt format is read from the config, not passed as a param: it is only checked here
# (chat needs a chat template) and must not rerun the model's preparation when it changes.
prompt_format = snakemake.config["models"][snakemake.wildcards.model]["prompt_format"]
steps.prepare_model(snakemake.wildcards.model, snakemake.params.source, snakemake.output[0], prompt_format)
