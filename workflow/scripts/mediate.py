from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.log_request("mediate", snakemake)
steps.mediate_condition(
    model_dir=snakemake.input.model,
    inputs={key: snakemake.input[key] for key in ("baseline", "treated", "generations", "grades")},
    out_effects=snakemake.output.effects,
    out_summary=snakemake.output.summary,
    settings=snakemake.params.settings,
    keys=snakemake.params.identity,
    threads=snakemake.threads,
    arm=snakemake.params.arm,
    batch_size=snakemake.resources.batch_size,
)
