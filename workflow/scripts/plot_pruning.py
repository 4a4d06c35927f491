import sys

sys.path.insert(0, f"{snakemake.scriptdir}/../../src")  # attnlab, installed or not
from attnlab import steps  # noqa: E402

steps.setup_logging(snakemake.log[0])
steps.plot_pruning(
    sweep_paths=dict(zip(snakemake.params.models, snakemake.input)),
    out_path=snakemake.output[0],
    task=snakemake.wildcards.task,
    compare=snakemake.params.compare,
    threshold=snakemake.params.threshold,
    ablation=snakemake.params.ablation,
    ranking=snakemake.params.ranking,
    dpi=snakemake.params.dpi,
)
