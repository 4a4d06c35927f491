"""Figures. Matplotlib with the Agg backend: no display needed on clusters."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from attnlab.io import atomic_path  # noqa: E402

GRADER_TITLES = {"math_verify": "math-verify", "lenient": "lenient (paper's grader)"}


def plot_accuracy(table: pd.DataFrame, dataset: str, models: list[str], conditions: list[str],
                  out_path, dpi: int = 150) -> None:
    """Grouped bars: one group per model, one bar per condition, 95% CI error bars.

    One panel per grader, so the paper-compatible number sits beside math-verify's.
    """
    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.6 * len(models) * 2, 4), sharey=True)
    width = 0.8 / len(conditions)
    x = np.arange(len(models))
    colours = plt.get_cmap("tab10")
    for ax, grader in zip(axes, GRADER_TITLES):
        for k, condition in enumerate(conditions):
            cells = table.set_index(["model", "condition"]).reindex(
                [(m, condition) for m in models])
            acc = cells[f"{grader}_acc"].to_numpy()
            err = np.vstack([acc - cells[f"{grader}_ci_low"].to_numpy(),
                             cells[f"{grader}_ci_high"].to_numpy() - acc])
            bars = ax.bar(x + (k - (len(conditions) - 1) / 2) * width, acc, width, yerr=err,
                          capsize=3, label=condition, color=colours(k % 10))
            ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
        ax.set_xticks(x, models)
        ax.set_title(GRADER_TITLES[grader])
        ax.set_ylabel("accuracy (%), greedy, 95% bootstrap CI")
        ax.set_ylim(0, 105)
        ax.grid(axis="y", alpha=0.3)
    n = int(table["n"].max()) if len(table) else 0
    fig.suptitle(f"Results on {dataset} (n = {n} per bar)")
    axes[-1].legend(title="condition", fontsize=8, loc="upper right")
    fig.tight_layout()
    with atomic_path(out_path) as tmp:
        fig.savefig(tmp, dpi=dpi, format=str(out_path).rsplit(".", 1)[-1])
    plt.close(fig)
