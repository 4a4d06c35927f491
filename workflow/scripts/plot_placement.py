import sys

sys.path.insert(0, f"{snakemake.scriptdir}/../../src")  # attnlab, installed or not
from attnlab import steps  # noqa: E402

steps.setup_logging(snakemake.log[0])
steps.plot_placement(
    table_path=snakemake.input[0],
    out_path=snakemake.output[0],
    dataset=snakemake.wildcards.dataset,
    models=snakemake.params.models,
    dpi=snakemake.params.dpi,
)
