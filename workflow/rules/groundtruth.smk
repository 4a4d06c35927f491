rule groundtruth_score:
    """A compiled-program model's circuit methods against the circuit derived from its program:
    each head ranking's and the edge circuit's counted circuit and AUC, EAP and EAP-IG's AUC at
    each step count, and the negative control's largest effect."""
    input:
        model="resources/models/{model}",
        prompts="results/pruning/{model}/{task}/prompts.json",
        scores=f"results/pruning/{{model}}/{{task}}/{PRIMARY_ABLATION}/scores.csv",
        scoring="results/pruning/{model}/{task}/scores.json",
        sweep=f"results/pruning/{{model}}/{{task}}/{PRIMARY_ABLATION}/sweep.json",
        edges="results/circuits/{model}/{task}/edges.parquet",
        circuit="results/circuits/{model}/{task}/summary.json",
    output:
        table="results/groundtruth/{model}/{task}.csv",
        roc="results/groundtruth/{model}/{task}.roc.csv",
        truth="results/groundtruth/{model}/{task}.truth.json",
        control="results/groundtruth/{model}/{task}.control.json",
    params:
        settings=groundtruth_settings,
    wildcard_constraints:
        model=_one_of(GROUNDTRUTH_MODELS),
        task="program",
    threads: model_threads
    log:
        "results/logs/groundtruth_score/{model}/{task}.log",
    benchmark:
        "results/benchmarks/groundtruth_score/{model}/{task}.tsv"
    resources:
        gpu=1,
        mem_mb=model_memory(4000),
        runtime=lambda wildcards, attempt: 30 * attempt,
        batch_size=groundtruth_batch,
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/groundtruth_score.py"


rule groundtruth_table:
    """Every compiled-program model's methods in one table (precision, recall, AUC, negative
    controls) and their ROC curves in one figure."""
    input:
        tables=expand("results/groundtruth/{model}/program.csv", model=GROUNDTRUTH_MODELS),
        rocs=expand("results/groundtruth/{model}/program.roc.csv", model=GROUNDTRUTH_MODELS),
        controls=expand("results/groundtruth/{model}/program.control.json", model=GROUNDTRUTH_MODELS),
    output:
        table="results/tables/groundtruth.csv",
        figure=report(
            f"results/figures/groundtruth/roc.{EXT}",
            caption="../report/groundtruth.rst",
            category="Ground truth",
        ),
    params:
        dpi=config["plots"]["dpi"],
    log:
        "results/logs/groundtruth_table.log",
    conda:
        "../../envs/attnlab.yaml"
    script:
        "../scripts/groundtruth_table.py"
