from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.plot_attention_head(
    paths=dict(zip(snakemake.params.conditions, snakemake.input)),
    out_path=snakemake.output[0],
    model=snakemake.wildcards.model,
    dataset=snakemake.wildcards.dataset,
    layer=int(snakemake.wildcards.layer),
    head=int(snakemake.wildcards.head),
    plot=snakemake.params.plot,
    dpi=snakemake.params.dpi,
)
