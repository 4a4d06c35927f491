from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.circuit_areas(
    inputs=snakemake.params.inputs,
    pairs=snakemake.params.pairs,
    threshold=snakemake.params.threshold,
    bootstrap=snakemake.params.bootstrap,
    outputs={"areas": snakemake.output.areas, "differences": snakemake.output.differences,
             "figures": dict(zip(snakemake.params.ablations, snakemake.output.figures))},
    dpi=snakemake.params.dpi,
)
