"""Attention figures: received attention against position, one line per condition, per head
and as composite figures; the λ heat map."""

from __future__ import annotations

import textwrap

import numpy as np
import pandas as pd

from attnlab.extraction.analysis import align, inserted_share, mean_and_band, runs_of
from attnlab.plots.base import _save, fitted_suptitle, plt

ALIGNED_TITLE = "inserted tokens removed (meaningful tokens aligned)"
SHADING_NOTE = "shaded: each condition's inserted tokens (dark: in every prompt, light: in some prompts)"
ATTENTION_LABEL = "attention received\n(mean over later tokens)"
BAND_NOTE = "95% bootstrap band over prompts"


def _draw_conditions(ax, per_condition: dict[str, dict], remove_inserted: bool, drop_first: bool,
                     per_prompt: int) -> None:
    """One line per condition (mean over prompts, 95% percentile-bootstrap band), optionally a
    few single prompts;
    the full sequence (``remove_inserted`` False) also shades each condition's inserted tokens.
    Colours follow the order of ``per_condition``, so they match from panel to panel."""
    colours = plt.get_cmap("tab10")
    first = int(drop_first)
    for k, (condition, data) in enumerate(per_condition.items()):
        colour = colours(k % 10)
        aligned = align(data["values"], data["spans"], data["lengths"], remove_inserted=remove_inserted)
        mean, low, high = mean_and_band(aligned)
        x = np.arange(len(mean))[first:]
        ax.plot(x, mean[first:], color=colour, lw=1.2, label=f"{condition} (n={len(aligned)})")
        ax.fill_between(x, low[first:], high[first:], color=colour, alpha=0.2, lw=0)
        for row in aligned[:per_prompt]:
            ax.plot(x, row[first:len(mean)], color=colour, lw=0.4, alpha=0.3)
    if not remove_inserted:
        _shade_inserted(ax, per_condition)
    _note_prompt_counts(ax, per_condition)


def _note_prompt_counts(ax, per_condition: dict[str, dict]) -> None:
    """n on the panel itself (a legend is drawn on some panels only): one number when every
    condition has the same prompts, else one per condition."""
    counts = {condition: len(data["lengths"]) for condition, data in per_condition.items()}
    if len(set(counts.values())) == 1:
        text = f"n = {next(iter(counts.values()))} prompts"
    else:
        text = "n = " + ", ".join(f"{count} ({condition})" for condition, count in counts.items()) + " prompts"
    ax.text(0.01, 0.98, text, transform=ax.transAxes, ha="left", va="top",
            fontsize=8, bbox={"facecolor": "white", "alpha": 0.7, "lw": 0, "pad": 1})


def _shade_inserted(ax, per_condition: dict[str, dict]) -> None:
    """Each condition's inserted positions in its colour, from every prompt's span (not one
    prompt's): dark where all prompts have an inserted token, light where only some do
    (a place that varies by prompt, as with question_random)."""
    colours = plt.get_cmap("tab10")
    for k, data in enumerate(per_condition.values()):
        share = inserted_share(data["spans"], int(data["lengths"].max()))
        for flags, alpha in ((share >= 1, 0.2), ((share > 0) & (share < 1), 0.07)):
            for start, end in runs_of(flags):
                ax.axvspan(start - 0.5, end - 0.5, color=colours(k % 10), alpha=alpha, lw=0)


def _label_position_axes(ax, drop_first: bool) -> None:
    ax.set_xlabel("token position (0-based)" + ("; position 0, the attention sink, not shown" if drop_first else ""))
    ax.set_ylabel(ATTENTION_LABEL)
    ax.grid(alpha=0.3)


def plot_attention_head(per_condition: dict[str, dict], model: str, dataset: str, layer: int,
                        head: int, out_path, drop_first: bool = True, per_prompt: int = 0,
                        dpi: int = 150) -> None:
    """Attention received vs position, one line per condition (mean over prompts, 95% band).

    Top: inserted tokens removed, so the meaningful tokens align across
    conditions. Bottom: the full sequence with each condition's inserted tokens shaded.
    """
    fig, axes = plt.subplots(2, 1, figsize=(11, 7))
    for ax, remove in zip(axes, (True, False)):
        _draw_conditions(ax, per_condition, remove, drop_first, per_prompt)
        _label_position_axes(ax, drop_first)
    axes[0].set_title(ALIGNED_TITLE)
    axes[1].set_title(f"full sequence; {SHADING_NOTE}")
    axes[0].legend(fontsize=8, loc="upper right")
    fitted_suptitle(fig, f"{model} on {dataset}: Layer {layer + 1}, Head {head + 1} "
                    f"(1-based; layer index {layer}, head index {head}); mean over prompts, {BAND_NOTE}")
    fig.tight_layout()
    _save(fig, out_path, dpi)


def _panel_title(panel: dict) -> str:
    return (f"{panel['model']}: Layer {panel['layer'] + 1}, Head {panel['head'] + 1}\n"
            f"(layer index {panel['layer']}, head index {panel['head']}; {panel['dataset']})")


def _zoom_on_inserted(ax, per_condition: dict[str, dict]) -> None:
    """Limit the x axis to where any condition inserts tokens (plus a margin), and the y axis
    to what is drawn there: the inserted tokens' values are often far from the rest."""
    width = max(int(data["lengths"].max()) for data in per_condition.values())
    inserted = np.flatnonzero(np.any([inserted_share(data["spans"], width) > 0
                                      for data in per_condition.values()], 0))
    if not len(inserted):
        return
    margin = max(3, (inserted[-1] - inserted[0]) // 5)
    low, high = inserted[0] - margin - 0.5, inserted[-1] + margin + 0.5
    ax.set_xlim(low, high)
    drawn = [line.get_xydata() for line in ax.get_lines()]
    drawn += [path.vertices for band in ax.collections for path in band.get_paths()]
    points = np.concatenate(drawn)
    y = points[(points[:, 0] >= low) & (points[:, 0] <= high), 1]
    y = y[np.isfinite(y)]
    if len(y):
        pad = 0.05 * (y.max() - y.min()) or 0.05 * abs(y.max()) or 0.01
        ax.set_ylim(y.min() - pad, y.max() + pad)


def plot_attention_figure(panels: list[dict], name: str, view: str, zoom: bool, out_path,
                          drop_first: bool = True, per_prompt: int = 0, dpi: int = 150) -> None:
    """A composite figure: panels side by side, each one model x layer x head with the same
    conditions overlaid (``panel["per_condition"]``, drawn as in the single-head figure); with
    ``zoom``, a second row shows each panel's full sequence zoomed on the inserted tokens."""
    rows = 2 if zoom else 1
    fig, axes = plt.subplots(rows, len(panels), figsize=(1.2 + 4.8 * len(panels), 0.9 + 3.4 * rows),
                             squeeze=False)
    for column, panel in enumerate(panels):
        top = axes[0, column]
        _draw_conditions(top, panel["per_condition"], view == "aligned", drop_first, per_prompt)
        top.set_title(_panel_title(panel), fontsize=9)
        top.legend(fontsize=7, loc="upper right")
        if zoom:
            bottom = axes[1, column]
            _draw_conditions(bottom, panel["per_condition"], False, drop_first, per_prompt)
            _zoom_on_inserted(bottom, panel["per_condition"])
            bottom.set_title("zoomed on the inserted tokens", fontsize=9)
    for ax in axes.flat:
        _label_position_axes(ax, drop_first=False)  # the sink note goes in the title: panels are narrow
    for ax in axes[:, 1:].flat:
        ax.set_ylabel("")
    shown = ALIGNED_TITLE if view == "aligned" else f"full sequence; {SHADING_NOTE}"
    sink = "; position 0 (the attention sink) not shown" if drop_first else ""
    lines = [f"{name}: attention received vs position, mean over prompts, {BAND_NOTE}{sink}",
             f"{'top row: ' if zoom else ''}{shown}"]
    # Wrapped to the figure's width (about 18 characters an inch at this size): one or two
    # narrow panels would otherwise cut the title at both ends.
    columns = int(18 * fig.get_figwidth())
    fig.suptitle("\n".join(textwrap.fill(line, columns) for line in lines), fontsize=10)
    fig.tight_layout()
    _save(fig, out_path, dpi)


def plot_lambda_heatmap(table: pd.DataFrame, model: str, dataset: str, out_path, dpi: int = 150) -> None:
    """Mean λ (attention mass kept on original tokens) per layer x head, a panel per condition."""
    conditions = list(dict.fromkeys(table["condition"]))
    # constrained: the title's lines (wrapped to a one-condition figure's width) get their own room
    fig, axes = plt.subplots(1, len(conditions), figsize=(2.2 + 2.4 * len(conditions), 5), squeeze=False,
                             layout="constrained")
    for ax, condition in zip(axes[0], conditions):
        grid = table[table["condition"] == condition].pivot(index="layer", columns="head", values="lambda_mean")
        image = ax.imshow(grid.to_numpy(), vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        ax.set_title(condition)
        ax.set_xlabel("head (0-based)")
    axes[0][0].set_ylabel("layer (0-based)")
    fig.colorbar(image, ax=axes[0].tolist(), label="mean λ over question tokens")
    fitted_suptitle(fig, f"{model} on {dataset}: λ = attention mass on non-inserted tokens")
    _save(fig, out_path, dpi)
