from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.plot_edges(
    inputs={model: {kind: snakemake.input[f"{kind}_{model}"] for kind in ("curve", "summary", "per_prompt")}
            for model in snakemake.params.models},
    out_path=snakemake.output[0],
    task=snakemake.wildcards.task,
    compare=snakemake.params.compare,
    threshold=snakemake.params.threshold,
    bootstrap=snakemake.params.bootstrap,
    dpi=snakemake.params.dpi,
)
