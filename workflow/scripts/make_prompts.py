import sys

sys.path.insert(0, f"{snakemake.scriptdir}/../../src")  # attnlab, installed or not
from attnlab import steps  # noqa: E402

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
