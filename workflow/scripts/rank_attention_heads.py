import sys

sys.path.insert(0, f"{snakemake.scriptdir}/../../src")  # attnlab, installed or not
from attnlab import steps  # noqa: E402

steps.setup_logging(snakemake.log[0])
steps.rank_attention_heads(
    paths=dict(zip(snakemake.params.conditions, snakemake.input)),
    table_path=snakemake.output.table,
    figure_dir=snakemake.output.figures,
    model=snakemake.wildcards.model,
    dataset=snakemake.wildcards.dataset,
    top=snakemake.params.top,
    plot=snakemake.params.plot,
    ext=snakemake.params.ext,
    dpi=snakemake.params.dpi,
)
