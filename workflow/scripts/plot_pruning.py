from attnlab import steps

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
