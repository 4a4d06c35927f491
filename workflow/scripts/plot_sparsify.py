import sys

sys.path.insert(0, f"{snakemake.scriptdir}/../../src")  # attnlab, installed or not
from attnlab import steps  # noqa: E402

steps.setup_logging(snakemake.log[0])
steps.plot_sparsify(
    inputs=dict(snakemake.input.items()),
    training_path=snakemake.output.training,
    density_path=snakemake.output.density,
    model=snakemake.wildcards.model,
    dpi=snakemake.params.dpi,
)
