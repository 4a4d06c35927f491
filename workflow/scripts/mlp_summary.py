from attnlab import steps

steps.setup_logging(snakemake.log[0])
conditions = snakemake.params.conditions
steps.mlp_summary(
    stats_paths={c: snakemake.input[f"stats_{c}"] for c in conditions},
    histogram_paths={c: snakemake.input[f"hist_{c}"] for c in conditions},
    table_path=snakemake.output.table,
    figure_path=snakemake.output.figure,
    keys={"model": snakemake.wildcards.model, "dataset": snakemake.wildcards.dataset},
    baseline=snakemake.params.baseline,
    layer=snakemake.params.layer,
    near_zero=snakemake.params.near_zero,
    dpi=snakemake.params.dpi,
)
