from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.heads_vs_density(
    sweep_paths=dict(zip(snakemake.params.sweep_keys, snakemake.input.sweeps)),
    curve_paths=dict(zip(snakemake.params.sweep_keys, snakemake.input.curves)),
    per_prompt_paths=dict(zip(snakemake.params.sweep_keys, snakemake.input.per_prompt)),
    summary_paths=dict(zip(snakemake.params.copies, snakemake.input.summaries)),
    pairs=snakemake.params.pairs,
    n_prompts=snakemake.params.n_prompts,
    bootstrap=snakemake.params.bootstrap,
    table_path=snakemake.output.table,
    figure_path=snakemake.output.figure,
    dpi=snakemake.params.dpi,
    unit=snakemake.params.unit,
)
