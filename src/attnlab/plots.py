"""Figures. Matplotlib with the Agg backend: no display needed on clusters."""

from __future__ import annotations

import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from attnlab.io import atomic_path  # noqa: E402

GRADER_TITLES = {"math_verify": "math-verify", "lenient": "lenient (paper's grader)"}


def _save(fig, out_path, dpi: int) -> None:
    with atomic_path(out_path) as tmp:
        fig.savefig(tmp, dpi=dpi, format=str(out_path).rsplit(".", 1)[-1])
    plt.close(fig)


def plot_accuracy(table: pd.DataFrame, dataset: str, models: list[str], conditions: list[str],
                  out_path, dpi: int = 150) -> None:
    """Grouped bars: one group per model, one bar per condition, 95% CI error bars.

    One panel per grader, so the paper-compatible number sits beside math-verify's (its
    substring-only part hatched); below them, where each cell's answers came from and how
    many responses hit the token limit.
    """
    fig = plt.figure(figsize=(4 + 1.6 * len(models) * 2, 6.4))
    grid = fig.add_gridspec(2, 2, height_ratios=(3, 1.3))
    axes = [fig.add_subplot(grid[0, 0])]
    axes.append(fig.add_subplot(grid[0, 1], sharey=axes[0]))
    width = 0.8 / len(conditions)
    x = np.arange(len(models))
    offsets = [(k - (len(conditions) - 1) / 2) * width for k in range(len(conditions))]
    colours = plt.get_cmap("tab10")
    cells = {c: table.set_index(["model", "condition"]).reindex([(m, c) for m in models]) for c in conditions}
    for ax, grader in zip(axes, GRADER_TITLES):
        for k, condition in enumerate(conditions):
            _grade_bars(ax, x + offsets[k], cells[condition], grader, width, colours(k % 10), condition)
        ax.set_xticks(x, models)
        ax.set_title(_grader_title(grader))
        ax.set_ylabel("accuracy (%), greedy, 95% bootstrap CI")
        ax.set_ylim(0, 105)
        ax.grid(axis="y", alpha=0.3)
    _plot_answer_sources(fig.add_subplot(grid[1, :]), cells, models, x, offsets, width)
    n = int(table["n"].max()) if len(table) else 0
    fig.suptitle(f"Results on {dataset} (n = {n} per bar)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles + [_substring_patch()], labels + [SUBSTRING_LABEL], title="condition",
               loc="upper right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    _save(fig, out_path, dpi)


SUBSTRING_HATCH = "////"
SUBSTRING_LABEL = "hatched: lenient matches\nonly as a substring\n(pred in gold, not equal)"


def _substring_patch():
    """The legend entry of the hatching (a fresh artist each time: an artist has one figure)."""
    from matplotlib.patches import Patch

    return Patch(facecolor="white", edgecolor="black", hatch=SUBSTRING_HATCH, label=SUBSTRING_LABEL)


def _grader_title(grader: str) -> str:
    if grader == "lenient":
        return f"{GRADER_TITLES[grader]}\nhatched: substring-only matches"
    return GRADER_TITLES[grader]


def substring_share(cells: pd.DataFrame) -> np.ndarray:
    """Per cell, the % of items that only the lenient grader's substring rule calls correct
    (NaN for summaries written before the count was recorded)."""
    if "lenient_substring_only" not in cells:
        return np.full(len(cells), np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        return 100 * cells["lenient_substring_only"].to_numpy(float) / cells["n"].to_numpy(float)


def empty_reason(cell) -> str | None:
    """Why a cell has no accuracy worth drawing as a bar: no items, or no answer extracted from
    any of them (its 0% would read as "always wrong"); None for an ordinary cell."""
    n = cell.get("n", np.nan)
    if pd.isna(n) or n == 0:
        return "no items"
    if cell.get("extracted_none", 0) == 1:
        return f"no answer extracted ({n:.0f}/{n:.0f})"
    return None


def _grade_bars(ax, x, cells: pd.DataFrame, grader: str, width: float, colour, label: str) -> None:
    """One bar per cell with its 95% CI and value; on the lenient panel the part only a
    substring match gives is hatched; a cell with nothing to grade is an empty, dashed bar
    that names the reason, never a bare 0%."""
    reasons = [empty_reason(cell) for _, cell in cells.iterrows()]
    empty = np.array([reason is not None for reason in reasons])
    acc = np.where(empty, np.nan, cells[f"{grader}_acc"].to_numpy(float))
    err = np.nan_to_num(np.vstack([acc - cells[f"{grader}_ci_low"].to_numpy(float),
                                   cells[f"{grader}_ci_high"].to_numpy(float) - acc]))
    bars = ax.bar(x, np.nan_to_num(acc), width, yerr=err, capsize=3, label=label, color=colour)
    values = ["" if np.isnan(a) else f"{a:.0f}" for a in acc]
    if grader == "lenient":
        share = substring_share(cells)
        ax.bar(x, np.nan_to_num(share), width, bottom=np.nan_to_num(acc - share), fill=False,
               hatch=SUBSTRING_HATCH, edgecolor="black", lw=0)
        values = [v + (f"\n({s:.0f} pts substr.)" if v and s > 0 else "") for v, s in zip(values, share)]
    ax.bar_label(bars, labels=values, fontsize=7, padding=2)
    for xi, reason in zip(np.atleast_1d(x), reasons):
        if reason:
            ax.bar(xi, 100, width, fill=False, edgecolor=colour, ls="--", lw=1)
            ax.text(xi, 50, reason, rotation=90, ha="center", va="center", fontsize=7)


ANSWER_SOURCES = {"boxed": ("\\boxed{}", "#4c72b0"), "hash": ("####", "#55a868"),
                  "last_number": ("last-number fallback", "#dd8452"), "none": ("no answer", "#c44e52")}


def _plot_answer_sources(ax, cells: dict, models: list[str], x, offsets, width) -> None:
    """Per cell, stacked shares of answers taken from \\boxed{}, ####, the last number or none,
    with the number of responses that hit the token limit above each stack."""
    for offset, summary in zip(offsets, cells.values()):
        bottom = np.zeros(len(models))
        for how, (label, colour) in ANSWER_SOURCES.items():
            share = 100 * summary.get(f"extracted_{how}", pd.Series(np.nan, index=summary.index)).to_numpy()
            ax.bar(x + offset, share, width * 0.9, bottom=bottom, color=colour,
                   label=label if offset == offsets[0] else None)
            bottom += np.nan_to_num(share)
        # summaries written before the count was recorded carry only the share
        hits = summary["n_hit_token_limit"] if "n_hit_token_limit" in summary else summary["hit_token_limit"] * summary["n"]
        for xi, hits, n in zip(x + offset, hits, summary["n"]):
            ax.annotate(f"{hits:.0f}/{n:.0f}", (xi, 100), ha="center", va="bottom", fontsize=6)
    ax.set_xticks(x, models)
    ax.set_ylim(0, 118)
    ax.set_ylabel("answers (%)")
    ax.set_title("answer taken from (bars in the order above); label: responses that hit "
                 "the token limit / n", fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))


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
    from attnlab.attention_analysis import align, mean_and_band

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
    from attnlab.attention_analysis import inserted_share, runs_of

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
    fig.suptitle(f"{model} on {dataset}: Layer {layer + 1}, Head {head + 1} "
                 f"(1-based; layer index {layer}, head index {head}); mean over prompts, {BAND_NOTE}")
    fig.tight_layout()
    _save(fig, out_path, dpi)


def _panel_title(panel: dict) -> str:
    return (f"{panel['model']}: Layer {panel['layer'] + 1}, Head {panel['head'] + 1}\n"
            f"(layer index {panel['layer']}, head index {panel['head']}; {panel['dataset']})")


def _zoom_on_inserted(ax, per_condition: dict[str, dict]) -> None:
    """Limit the x axis to where any condition inserts tokens (plus a margin), and the y axis
    to what is drawn there: the inserted tokens' values are often far from the rest."""
    from attnlab.attention_analysis import inserted_share

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
    fig, axes = plt.subplots(1, len(conditions), figsize=(2.2 + 2.4 * len(conditions), 5), squeeze=False)
    for ax, condition in zip(axes[0], conditions):
        grid = table[table["condition"] == condition].pivot(index="layer", columns="head", values="lambda_mean")
        image = ax.imshow(grid.to_numpy(), vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        ax.set_title(condition)
        ax.set_xlabel("head (0-based)")
    axes[0][0].set_ylabel("layer (0-based)")
    fig.colorbar(image, ax=axes[0].tolist(), label="mean λ over question tokens")
    fig.suptitle(f"{model} on {dataset}: λ = attention mass on non-inserted tokens")
    _save(fig, out_path, dpi)


def plot_length_sweep(table: pd.DataFrame, families: dict[str, str | None], model: str,
                      dataset: str, out_path, dpi: int = 150) -> None:
    """Accuracy vs inserted length (tokens), one line per inserted kind, CI band.

    ``families`` maps each condition to its kind label (e.g. "repeat '/'"), or
    None for conditions that insert nothing; those are the length-0 point of
    every line.
    """
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    colours = plt.get_cmap("tab10")
    cells = table.set_index("condition")
    baseline = [c for c, family in families.items() if family is None and c in cells.index]
    labels = list(dict.fromkeys(f for f in families.values() if f is not None))
    for ax, grader in zip(axes, GRADER_TITLES):
        for k, label in enumerate(labels):
            members = baseline + [c for c, f in families.items() if f == label and c in cells.index]
            points = cells.loc[members].sort_values("inserted_tokens")
            x = points["inserted_tokens"].to_numpy()
            ax.plot(x, points[f"{grader}_acc"], "o-", color=colours(k % 10), label=label)
            ax.fill_between(x, points[f"{grader}_ci_low"], points[f"{grader}_ci_high"],
                            color=colours(k % 10), alpha=0.15, lw=0)
            if grader == "lenient":  # what is left without the substring-only matches
                dotted = ax.plot(x, points["lenient_acc"] - substring_share(points), ":",
                                 color=colours(k % 10))
        ax.set_title(GRADER_TITLES[grader])
        ax.set_xlabel("inserted tokens (under this model's tokenizer)")
        ax.set_ylabel("accuracy (%), greedy, 95% bootstrap CI")
        ax.grid(alpha=0.3)
    axes[0].legend(title="inserted kind", fontsize=8)
    if labels:
        axes[1].legend(dotted, ["dotted: without its substring-only matches"], fontsize=8)
    n = int(table["n"].max()) if len(table) else 0
    fig.suptitle(f"{model} on {dataset}: accuracy vs inserted length (n = {n} per point)")
    fig.tight_layout()
    _save(fig, out_path, dpi)


def plot_mlp_histograms(histograms: dict[str, pd.DataFrame], table: pd.DataFrame, baseline: str,
                        model: str, dataset: str, layer: int, near_zero: float, out_path,
                        dpi: int = 150) -> None:
    """One panel per condition: its histogram of a = act_fn(gate_proj(x)) over the question
    tokens overlaid on the baseline's, log-scale counts, near-zero band shaded."""
    others = [c for c in histograms if c != baseline] or [baseline]
    columns = min(3, len(others))
    rows = -(-len(others) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.4 * rows), squeeze=False,
                             sharex=True, sharey=True)
    stats = table.set_index("condition")

    def draw(ax, condition, colour, style):
        hist = histograms[condition]
        inner = hist.iloc[1:-1]  # the first and last rows count values outside the range
        share = stats.at[condition, "near_zero"]
        ax.stairs(inner["count"].to_numpy(), np.r_[inner["low"].to_numpy(), inner["high"].iloc[-1]],
                  color=colour, ls=style, lw=1.2, label=f"{condition} (near zero {100 * share:.1f}%)")

    for ax, condition in zip(axes.flat, others):
        draw(ax, baseline, "0.35", "--")
        if condition != baseline:
            draw(ax, condition, "tab:red", "-")
        ax.axvspan(-near_zero, near_zero, color="tab:blue", alpha=0.15, lw=0)
        ax.set_yscale("log")
        ax.set_title(f"{condition} vs {baseline}", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(others):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("a = act_fn(gate_proj(x))")
    for ax in axes[:, 0]:
        ax.set_ylabel("count (question tokens x units)")
    fig.suptitle(f"{model} on {dataset}: layer {layer} (0-based) MLP activations; "
                 f"shaded |a| < {near_zero:g}")
    fig.tight_layout()
    _save(fig, out_path, dpi)


PLACEMENT_ORDER = ("none", "system_start", "between", "question_random", "end")


def plot_placement(table: pd.DataFrame, dataset: str, models: list[str], out_path,
                   dpi: int = 150) -> None:
    """Accuracy by placement of the insertion: a row of panels per inserted kind and length
    that is configured away from the default placement, one column per grader, one bar per
    model; the plain prompt ("none") is the first group."""
    inserted = table[table["placement"] != "none"]
    moved = inserted.groupby(["family", "length"])["placement"].apply(lambda p: (p != "between").any())
    groups = [key for key, flag in moved.items() if flag]
    plain = table[table["placement"] == "none"]
    fig, axes = plt.subplots(max(1, len(groups)), 2, figsize=(11, 3.8 * max(1, len(groups))),
                             squeeze=False, sharey=True)
    colours = plt.get_cmap("tab10")
    width = 0.8 / len(models)
    for axes_row, (family, length) in zip(axes, groups):
        members = inserted[(inserted["family"] == family) & (inserted["length"] == length)]
        cells = pd.concat([plain, members]).drop_duplicates(["model", "placement"])
        cells = cells.set_index(["model", "placement"])
        present = [p for p in PLACEMENT_ORDER if p in cells.index.get_level_values(1)]
        x = np.arange(len(present))
        for ax, grader in zip(axes_row, GRADER_TITLES):
            for k, model in enumerate(models):
                _grade_bars(ax, x + (k - (len(models) - 1) / 2) * width,
                            cells.reindex([(model, p) for p in present]), grader, width,
                            colours(k % 10), model)
            ax.set_xticks(x, [p.replace("_", "\n") for p in present])
            ax.set_title(f"{family}, {length} tokens: {_grader_title(grader)}", fontsize=9)
            ax.set_ylabel("accuracy (%), greedy, 95% bootstrap CI")
            ax.set_ylim(0, 105)
            ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    axes[0, 0].legend(handles + [_substring_patch()], labels + [SUBSTRING_LABEL], title="model", fontsize=8)
    n = int(table["n"].max()) if len(table) else 0
    fig.suptitle(f"{dataset}: accuracy by placement of the insertion (n = {n} per bar)")
    fig.tight_layout()
    _save(fig, out_path, dpi)
