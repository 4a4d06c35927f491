"""One function per workflow step: read inputs, call the library, write outputs.

The scripts under workflow/scripts/ are one call into this package each, so a step can be
run and tested without Snakemake. Each step builds its typed settings (``attnlab.config.settings``)
from the config slice its rule passes. Nothing here imports torch at import time: the
figure and table steps run without it.
"""

from attnlab.steps.analysis import (extract_attention, lambda_summary, mlp_activations, mlp_summary,
                                    plot_attention_figure, plot_attention_head, rank_attention_heads)
from attnlab.steps.areas import circuit_areas
from attnlab.steps.circuits import (heads_vs_density, plot_pruning, plot_sparsify, score_heads,
                                    sparsify_model, sweep_heads)
from attnlab.steps.common import LATER_COLUMNS, log_request, setup_logging
from attnlab.steps.edges import edge_circuit, plot_circuit
from attnlab.steps.groundtruth import groundtruth_score, groundtruth_table
from attnlab.steps.inputs import make_prompts, prepare_dataset, prepare_fewshot, prepare_model
from attnlab.steps.mediation import mediate_condition, mediation_table, plot_mediation
from attnlab.steps.reasoning import (accuracy_paired, accuracy_table, generate, grade, placement_table,
                                     plot_accuracy, plot_length_sweep, plot_placement)

__all__ = [
    "LATER_COLUMNS", "accuracy_paired", "accuracy_table", "circuit_areas", "edge_circuit", "extract_attention", "generate", "grade",
    "groundtruth_score", "groundtruth_table",
    "heads_vs_density", "lambda_summary", "log_request", "make_prompts", "mediate_condition", "mediation_table", "mlp_activations",
    "mlp_summary", "plot_mediation",
    "placement_table", "plot_accuracy", "plot_attention_figure", "plot_attention_head",
    "plot_circuit", "plot_length_sweep", "plot_placement", "plot_pruning",
    "plot_sparsify", "prepare_dataset", "prepare_fewshot", "prepare_model", "rank_attention_heads",
    "score_heads", "setup_logging", "sparsify_model", "sweep_heads",
]
