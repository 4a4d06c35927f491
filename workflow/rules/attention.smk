rule extract_attention:
    """Every layer and head of one model x dataset x condition into one HDF5."""
    input:
        model="resources/models/{model}",
        prompts="results/prompts/{model}/{dataset}/{condition}.parquet",
    output:
        "results/attention/{model}/{dataset}/{condition}.h5",
    params:
        settings=extraction_settings,
        attrs=grade_keys,
        arm=arm_settings,
    threads: model_threads
    log:
        "results/logs/extract_attention/{model}/{dataset}/{condition}.log",
    benchmark:
        "results/benchmarks/extract_attention/{model}/{dataset}/{condition}.tsv"
    resources:
        gpu=1,
        batch_size=extraction_batch,
        **fitted("extract_attention", extraction_batch),
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/extract_attention.py"


rule plot_attention_head:
    """Attention received vs position for one configured head, a line per condition."""
    input:
        attention_files,
    output:
        report(
            "results/figures/attention/{model}/{dataset}/layer{layer}_head{head}.{ext}",
            caption="../report/attention_head.rst",
            category="Attention",
            subcategory="{model}",
        ),
    params:
        conditions=CONDITIONS,
        plot=config["attention"]["plot"],
        dpi=config["plots"]["dpi"],
    log:
        "results/logs/plot_attention_head/{model}/{dataset}/layer{layer}_head{head}.{ext}.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/plot_attention_head.py"


rule plot_attention_figure:
    """One configured composite figure (attention.figures), from the existing attention files."""
    input:
        composite_figure_files,
    output:
        report(
            "results/figures/attention/composite/{figure}.{ext}",
            caption="../report/attention_figure.rst",
            category="Attention",
            subcategory="composite figures",
        ),
    params:
        figure=composite_figure,
        plot=config["attention"]["plot"],
        dpi=config["plots"]["dpi"],
    log:
        "results/logs/plot_attention_figure/{figure}.{ext}.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/plot_attention_figure.py"


rule rank_attention_heads:
    """Heads ranked by how much their received attention changes between two conditions."""
    input:
        attention_files,
    output:
        table="results/tables/attention/{model}/{dataset}/head_changes.csv",
        figures=report(
            directory("results/figures/attention/{model}/{dataset}/top_changed"),
            patterns=[f"{{name}}.{EXT}"],
            caption="../report/attention_top.rst",
            category="Attention",
            subcategory="{model}",
        ),
    params:
        conditions=CONDITIONS,
        top=config["attention"]["top_changed"],
        ext=EXT,
        plot=config["attention"]["plot"],
        dpi=config["plots"]["dpi"],
    log:
        "results/logs/rank_attention_heads/{model}/{dataset}.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/rank_attention_heads.py"


rule lambda_summary:
    """Mean λ per condition x layer x head, as a table and a heatmap."""
    input:
        attention_files,
    output:
        table="results/tables/attention/{model}/{dataset}/lambda.csv",
        figure=report(
            f"results/figures/attention/{{model}}/{{dataset}}/lambda.{EXT}",
            caption="../report/lambda.rst",
            category="Attention",
            subcategory="{model}",
        ),
    params:
        conditions=CONDITIONS,
        dpi=config["plots"]["dpi"],
    log:
        "results/logs/lambda_summary/{model}/{dataset}.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/lambda_summary.py"
