from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.plot_attention_figure(
    figure=snakemake.params.figure,
    paths=list(snakemake.input),
    out_path=snakemake.output[0],
    plot=snakemake.params.plot,
    dpi=snakemake.params.dpi,
)
