"""The ground-truth figure: each circuit method's ROC curve against the circuits known by
construction, one panel per method, one curve per compiled-program model."""

from __future__ import annotations

import textwrap

import pandas as pd

from attnlab.plots.base import _save, fitted_suptitle, plt

DEFINITION = ("ROC of |score| as a classifier of truth membership; truth: the heads / edges whose program-level "
              "interchange changes the read output on at least one of the task's pairs (docs/groundtruth.md)")


def plot_roc(curves: pd.DataFrame, table: pd.DataFrame, out_path, dpi: int = 150) -> None:
    """One panel per (unit, method) with each model's ROC curve and AUC in the legend; a method
    whose AUC is undefined for a model (every candidate or none in the truth) is listed as such."""
    methods = list(dict.fromkeys(zip(table["unit"], table["method"])))
    columns = min(3, len(methods))
    rows = -(-len(methods) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.8 * rows), squeeze=False)
    colours = plt.get_cmap("tab10")
    models = list(dict.fromkeys(table["model"]))
    for ax, (unit, method) in zip(axes.flat, methods):
        for k, model in enumerate(models):
            row = table[(table["model"] == model) & (table["method"] == method) & (table["unit"] == unit)]
            curve = curves[(curves["model"] == model) & (curves["method"] == method) & (curves["unit"] == unit)]
            auc = row["auc"].iloc[0] if len(row) else None
            label = f"{model}: AUC {auc:.3f}" if auc is not None and pd.notna(auc) else f"{model}: AUC undefined"
            if len(curve):
                # straight segments between scikit-learn's points: a run of tied scores is a diagonal,
                # whose area counts ties half, as the AUC does (steps would draw less)
                ax.plot(curve["fpr"], curve["tpr"], color=colours(k % 10), label=label)
            else:
                ax.plot([], [], color=colours(k % 10), label=label)
        ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=0.8)
        # a long method name (Edge Pruning's settings) wraps within its panel
        ax.set_title(textwrap.fill(f"{method} ({unit})", 44), fontsize=9)
        ax.set_xlabel("false positive rate", fontsize=8)
        ax.set_ylabel("true positive rate", fontsize=8)
        ax.legend(fontsize=6, loc="lower right")
    for ax in list(axes.flat)[len(methods):]:
        ax.set_visible(False)
    fitted_suptitle(fig, "Circuit methods against circuits known by construction (tracr-compiled programs)\n"
                    + DEFINITION, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.94))  # below the two-line title, panels' labels apart
    _save(fig, out_path, dpi)
