import sys

sys.path.insert(0, f"{snakemake.scriptdir}/../../src")  # attnlab, installed or not
from attnlab import steps  # noqa: E402

steps.setup_logging(snakemake.log[0])
steps.accuracy_table(list(snakemake.input), snakemake.output[0])
