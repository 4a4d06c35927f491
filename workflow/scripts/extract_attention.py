from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.log_request("extract_attention", snakemake)
steps.extract_attention(
    model_dir=snakemake.input.model,
    prompts_path=snakemake.input.prompts,
    out_path=snakemake.output[0],
    settings=snakemake.params.settings,
    attrs=snakemake.params.attrs,
    arm=snakemake.params.arm,
    threads=snakemake.threads,
    batch_size=snakemake.resources.batch_size,
)
