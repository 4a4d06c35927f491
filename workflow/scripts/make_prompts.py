from attnlab import steps

steps.setup_logging(snakemake.log[0])
steps.make_prompts(
    model_dir=snakemake.input.model,
    dataset_path=snakemake.input.dataset,
    out_path=snakemake.output[0],
    condition_name=snakemake.wildcards.condition,
    condition=snakemake.params.condition,
    prompt_cfg=snakemake.params.prompt,
    prompt_format=snakemake.params.prompt_format,
    fewshot=snakemake.params.fewshot,
    fewshot_path=snakemake.input.get("fewshot"),
)
