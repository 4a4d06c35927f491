from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.log_request("score_heads", snakemake)
steps.score_heads(
    model_dir=snakemake.input.model,
    task=snakemake.wildcards.task,
    settings=snakemake.params.settings,
    prompts_path=snakemake.output.prompts,
    scores_paths=dict(zip(snakemake.params.settings["ablations"], snakemake.output.scores)),
    summary_path=snakemake.output.summary,
    threads=snakemake.threads,
    batch_size=snakemake.resources.batch_size,
    means_path=snakemake.output.means[0] if snakemake.output.means else None,
)
