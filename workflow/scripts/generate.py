from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.log_request("generate", snakemake)
steps.generate(
    model_dir=snakemake.input.model,
    prompts_path=snakemake.input.prompts,
    out_path=snakemake.output[0],
    generation=snakemake.params.generation,
    arm=snakemake.params.arm,
    threads=snakemake.threads,
    batch_size=snakemake.resources.batch_size,
)
