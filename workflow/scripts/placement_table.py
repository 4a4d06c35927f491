import sys

sys.path.insert(0, f"{snakemake.scriptdir}/../../src")  # attnlab, installed or not
from attnlab import steps  # noqa: E402

steps.setup_logging(snakemake.log[0])
steps.placement_table(
    summary_paths=list(snakemake.input),
    placements=snakemake.params.placements,
    out_path=snakemake.output[0],
)
