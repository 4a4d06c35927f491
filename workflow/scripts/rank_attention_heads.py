from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.rank_attention_heads(
    paths=dict(zip(snakemake.params.conditions, snakemake.input)),
    table_path=snakemake.output.table,
    figure_dir=snakemake.output.figures,
    model=snakemake.wildcards.model,
    dataset=snakemake.wildcards.dataset,
    top=snakemake.params.top,
    plot=snakemake.params.plot,
    ext=snakemake.params.ext,
    dpi=snakemake.params.dpi,
)
