from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.grade(
    prompts_path=snakemake.input.prompts,
    generations_path=snakemake.input.generations,
    items_path=snakemake.output.per_item,
    summary_path=snakemake.output.summary,
    keys=snakemake.params.cell,
    grading=snakemake.params.grading,
)
