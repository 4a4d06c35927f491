from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.plot_circuit(
    edges_path=snakemake.input.edges,
    summary_path=snakemake.input.summary,
    out_path=snakemake.output[0],
    model=snakemake.wildcards.model,
    dpi=snakemake.params.dpi,
)
