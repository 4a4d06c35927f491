from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.placement_table(
    summary_paths=list(snakemake.input),
    placements=snakemake.params.placements,
    out_path=snakemake.output[0],
)
