from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.groundtruth_table(
    tables=list(snakemake.input.tables),
    rocs=list(snakemake.input.rocs),
    controls=list(snakemake.input.controls),
    table_path=snakemake.output.table,
    figure_path=snakemake.output.figure,
    dpi=snakemake.params.dpi,
)
