import sys

sys.path.insert(0, f"{snakemake.scriptdir}/../../src")  # attnlab, installed or not
from attnlab import steps  # noqa: E402

steps.setup_logging(snakemake.log[0])
steps.prepare_fewshot(snakemake.wildcards.dataset, snakemake.params.spec, snakemake.input.evaluated,
                      snakemake.output[0], snakemake.params.seed)
