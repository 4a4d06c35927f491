from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.log_request("sweep_heads", snakemake)
steps.sweep_heads(
    model_dir=snakemake.input.model,
    task=snakemake.wildcards.task,
    settings=snakemake.params.settings,
    prompts_path=snakemake.input.prompts,
    scores_path=snakemake.input.scores,
    scoring_path=snakemake.input.scoring,
    outputs={"sweep": snakemake.output.sweep, "per_prompt": snakemake.output.per_prompt,
             "summary": snakemake.output.summary},
    threads=snakemake.threads,
    batch_size=snakemake.resources.batch_size,
    means_path=snakemake.input.means[0] if snakemake.input.means else None,
)
