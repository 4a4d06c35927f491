from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.lambda_summary(
    paths=dict(zip(snakemake.params.conditions, snakemake.input)),
    table_path=snakemake.output.table,
    figure_path=snakemake.output.figure,
    keys={"model": snakemake.wildcards.model, "dataset": snakemake.wildcards.dataset},
    dpi=snakemake.params.dpi,
)
