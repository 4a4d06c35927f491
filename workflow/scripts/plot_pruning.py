from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.plot_pruning(
    inputs={model: {kind: snakemake.input[f"{kind}_{model}"] for kind in ("sweep", "summary", "per_prompt")}
            for model in snakemake.params.models},
    out_path=snakemake.output[0],
    task=snakemake.wildcards.task,
    compare=snakemake.params.compare,
    threshold=snakemake.params.threshold,
    ablation=snakemake.params.ablation,
    ranking=snakemake.params.ranking,
    bootstrap=snakemake.params.bootstrap,
    dpi=snakemake.params.dpi,
    unit=snakemake.params.unit,
    copies=snakemake.params.get("copies", []),  # plot_edges: none (its summaries keep no per-prompt gap)
)
