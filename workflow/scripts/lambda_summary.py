import sys

sys.path.insert(0, f"{snakemake.scriptdir}/../../src")  # attnlab, installed or not
from attnlab import steps  # noqa: E402

steps.setup_logging(snakemake.log[0])
steps.lambda_summary(
    paths=dict(zip(snakemake.params.conditions, snakemake.input)),
    table_path=snakemake.output.table,
    figure_path=snakemake.output.figure,
    keys={"model": snakemake.wildcards.model, "dataset": snakemake.wildcards.dataset},
    dpi=snakemake.params.dpi,
)
