from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.plot_length_sweep(
    summary_paths=list(snakemake.input),
    out_path=snakemake.output[0],
    model=snakemake.wildcards.model,
    dataset=snakemake.wildcards.dataset,
    families=snakemake.params.families,
    dpi=snakemake.params.dpi,
)
