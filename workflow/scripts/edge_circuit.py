from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.log_request("edge_circuit", snakemake)
steps.edge_circuit(
    model_dir=snakemake.input.model,
    task=snakemake.wildcards.task,
    settings=snakemake.params.settings,
    prompts_path=snakemake.input.prompts,
    scoring_path=snakemake.input.scoring,
    outputs={"edges": snakemake.output.edges, "curve": snakemake.output.curve,
             "per_prompt": snakemake.output.per_prompt, "summary": snakemake.output.summary},
    threads=snakemake.threads,
    batch_size=snakemake.resources.batch_size,
)
