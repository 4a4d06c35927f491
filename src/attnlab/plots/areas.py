"""Seed 004's figure: one panel per task, each model's explained-effect curve with its bootstrap
band, and under each panel the compared pairs' N× at the threshold and the differences of their
areas (MIB's CPR and CMD, ``circuits.areas``), each with its interval."""

from __future__ import annotations

import textwrap

import numpy as np
import pandas as pd

from attnlab.circuits.areas import MIB_SHARES
from attnlab.circuits.curves import interval_text
from attnlab.plots.base import _save, plt
from attnlab.plots.circuits import EFFECT_DEFINITIONS

AREA_DEFINITION = ("CPR = area under the explained effect against the share of heads kept, CMD = area of "
                   "|1 − effect| (MIB, Mueller et al. 2025), trapezoids over MIB's shares "
                   f"{', '.join(f'{share:.1%}' for share in MIB_SHARES)} (int(share × heads) kept); "
                   "[a, b]: 95% bootstrap intervals over the counted prompts, paired for models on the same "
                   "prompts; Δ = second − first of a pair")


def _fmt(value, digits: int = 2) -> str:
    return "?" if value is None or (isinstance(value, float) and np.isnan(value)) else f"{value:.{digits}f}"


def pair_lines(differences: pd.DataFrame, threshold: float) -> list[str]:
    """One line per compared pair on one task: its N× and its areas' differences."""
    lines = []
    for row in differences.itertuples(index=False):
        n_x = (f"N× at {threshold:g} = {_fmt(row.n_x)} {interval_text(row.n_x_low, row.n_x_high, 2)}"
               if row.n_x is not None and not pd.isna(row.n_x) else f"N× at {threshold:g}: a count is missing")
        areas = []
        for name in ("cpr", "cmd"):
            column = f"{name}_mib_difference"
            if column in differences and not pd.isna(getattr(row, column)):
                low, high = getattr(row, f"{column}_low"), getattr(row, f"{column}_high")
                areas.append(f"Δ{name.upper()} {getattr(row, column):+.3f} [{low:+.3f}, {high:+.3f}]")
        lines.append(f"{row.first} → {row.second}: {n_x}; " + ("; ".join(areas) or "MIB's sizes not measured"))
    return lines


def plot_task_panels(curves: dict[tuple[str, str], object], areas: pd.DataFrame, differences: pd.DataFrame,
                     threshold: float, ablation: str, out_path, dpi: int = 150) -> None:
    """``curves``: (model, task) -> the sweep as read (curve with its band, summary); ``areas``
    and ``differences``: the rows of areas.csv and area_differences.csv for these curves."""
    tasks = list(dict.fromkeys(task for _, task in curves))
    models = list(dict.fromkeys(model for model, _ in curves))
    # a row of blank axes under the panels holds each panel's pair lines, clear of its tick labels
    fig, grid = plt.subplots(2, max(len(tasks), 1), figsize=(5.2 * max(len(tasks), 1), 6.6), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1.1]})
    axes, below = grid[:1], grid[1]
    colours = plt.get_cmap("tab10")
    for ax, notes, task in zip(axes[0], below, tasks):
        for index, model in enumerate(models):
            swept = curves.get((model, task))
            if swept is None:
                continue
            curve, colour = swept.curve, colours(index % 10)
            row = areas[(areas["model"] == model) & (areas["task"] == task)]
            cpr = f", CPR {_fmt(row['cpr_mib'].iloc[0])}" if len(row) and not pd.isna(row["cpr_mib"].iloc[0]) else ""
            if {"effect_low", "effect_high"} <= set(curve):
                ax.fill_between(curve["heads_kept"], curve["effect_low"], curve["effect_high"], color=colour,
                                alpha=0.15, lw=0)
            needed = swept.summary.get("heads_to_reach_threshold")
            label = f"{model} ({needed if needed is not None else 'never'} heads{cpr})"
            ax.plot(curve["heads_kept"], curve["explained_effect"], color=colour, lw=1.4, label=label)
        ax.axhline(threshold, ls="--", color="grey", lw=1)
        ax.axhline(1.0, ls=":", color="grey", lw=0.8)
        ax.set_xscale("symlog", linthresh=10)
        ax.set_xlim(left=0)
        ax.set_title(task, fontsize=10)
        ax.set_xlabel("Number of Heads Kept")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
        lines = pair_lines(differences[differences["task"] == task], threshold) if len(differences) else []
        notes.axis("off")
        notes.text(0.0, 1.0, "\n".join(textwrap.fill(line, 70) for line in lines), transform=notes.transAxes,
                   fontsize=6.5, va="top")
    axes[0][0].set_ylabel("Explained Effect")
    fig.suptitle(f"Heads kept against explained effect, ablation = {ablation}\n{EFFECT_DEFINITIONS['heads']}",
                 fontsize=10)
    # about 20 characters of 6.5-point text to the inch; the panels start above the definition's lines
    definition = textwrap.fill(AREA_DEFINITION, int(18 * fig.get_figwidth()))
    fig.text(0.01, 0.01, definition, fontsize=6.5, va="bottom")
    lines_height = (definition.count("\n") + 1) * 6.5 * 1.3 / 72 / fig.get_figheight()
    fig.tight_layout(rect=(0, 0.02 + lines_height, 1, 0.92))
    _save(fig, out_path, dpi)
