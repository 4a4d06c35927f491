import sys

sys.path.insert(0, f"{snakemake.scriptdir}/../../src")  # attnlab, installed or not
from attnlab import steps  # noqa: E402

steps.setup_logging(snakemake.log[0])
steps.plot_length_sweep(
    summary_paths=list(snakemake.input),
    out_path=snakemake.output[0],
    model=snakemake.wildcards.model,
    dataset=snakemake.wildcards.dataset,
    families=snakemake.params.families,
    dpi=snakemake.params.dpi,
)
