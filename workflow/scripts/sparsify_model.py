import sys

sys.path.insert(0, f"{snakemake.scriptdir}/../../src")  # attnlab, installed or not
from attnlab import steps  # noqa: E402

steps.setup_logging(snakemake.log[0])
steps.sparsify_model(
    name=snakemake.wildcards.model,
    base_dir=snakemake.input.base,
    settings=snakemake.params.settings,
    outputs=dict(snakemake.output.items()),
    checkpoint=snakemake.params.checkpoint,
    threads=snakemake.threads,
)
