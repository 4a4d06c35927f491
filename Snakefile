# attnlab: attention-head experiments on causal language models.
# This file only wires things together; logic lives in src/attnlab/.
from snakemake.utils import min_version

min_version("9.0")


# `--configfile X` replaces the embedded default instead of being merged into
# it, so a run never picks up models or datasets it was not given.
if not workflow.overwrite_configfiles:

    configfile: f"{workflow.basedir}/config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/inference.smk"
include: "workflow/rules/attention.smk"
include: "workflow/rules/mlp.smk"
include: "workflow/rules/pruning.smk"
include: "workflow/rules/edges.smk"
include: "workflow/rules/groundtruth.smk"
include: "workflow/rules/mediation.smk"
include: "workflow/rules/plots.smk"


# Run where Snakemake runs, never as cluster jobs: gathering steps, and prepare_model,
# which downloads hub models (a login node has internet, compute nodes may not).
localrules:
    all,
    accuracy_table,
    accuracy_paired,
    groundtruth_table,
    mediation_table,
    placement_table,
    prepare_model,


rule all:
    input:
        all_targets(),
    default_target: True
