"""Figures of accuracy, length and placement sweeps and the MLP analysis; the shared figure
helpers. Matplotlib with the Agg backend: no display needed on clusters. Attention figures:
``plots.attention``; circuit and post-training figures: ``plots.circuits``."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from attnlab.io import atomic_path  # noqa: E402

GRADER_TITLES = {"math_verify": "math-verify", "lenient": "lenient (paper's grader)"}


def _save(fig, out_path, dpi: int) -> None:
    """Write the figure atomically. Text that leaves the canvas or overlaps other text is named
    in the log; with ATTNLAB_STRICT_FIGURES set (the tests) it fails the job instead."""
    import logging
    import os

    problems = text_collisions(fig)
    if problems:
        message = f"{out_path}: text collides or is cut off: " + "; ".join(problems)
        if os.environ.get("ATTNLAB_STRICT_FIGURES"):
            plt.close(fig)
            raise RuntimeError(message)
        logging.getLogger(__name__).warning(message)
    with atomic_path(out_path) as tmp:
        fig.savefig(tmp, dpi=dpi, format=str(out_path).rsplit(".", 1)[-1])
    plt.close(fig)


def fitted_suptitle(fig, text: str, **kwargs):
    """``fig.suptitle``, each line of ``text`` wrapped until the title fits the figure's width
    (a long model or dataset name would otherwise cut it at both edges)."""
    import textwrap

    renderer = fig.canvas.get_renderer()
    lines = text.split("\n")
    columns = max(len(line) for line in lines)
    while True:
        title = fig.suptitle("\n".join(textwrap.fill(line, columns) for line in lines), **kwargs)
        if title.get_window_extent(renderer).width <= 0.98 * fig.bbox.width or columns <= 20:
            return title
        columns = int(columns * 0.9)


def text_collisions(fig, tolerance: float = 1.0) -> list[str]:
    """Every drawn text that lies (more than ``tolerance`` pixels) outside the canvas, and every
    pair of drawn texts whose boxes (a text's background box included) overlap."""
    from matplotlib.text import Text

    drawn = []
    original = Text.draw

    def recording(text, renderer):
        original(text, renderer)
        if text.get_visible() and text.get_text().strip():
            box = text.get_window_extent(renderer)
            patch = text.get_bbox_patch()
            if patch is not None:
                box = type(box).union([box, patch.get_window_extent(renderer)])
            drawn.append((text.get_text().strip().replace("\n", " ")[:40], box))
    Text.draw = recording
    try:
        fig.canvas.draw()
    finally:
        Text.draw = original
    canvas = fig.bbox
    problems = [f"'{label}' outside the canvas" for label, box in drawn
                if box.x0 < canvas.x0 - tolerance or box.y0 < canvas.y0 - tolerance
                or box.x1 > canvas.x1 + tolerance or box.y1 > canvas.y1 + tolerance]
    for i, (first, a) in enumerate(drawn):
        for second, b in drawn[i + 1:]:
            width = min(a.x1, b.x1) - max(a.x0, b.x0)
            height = min(a.y1, b.y1) - max(a.y0, b.y0)
            if width > tolerance and height > tolerance:
                problems.append(f"'{first}' overlaps '{second}'")
    return problems


def plot_accuracy(table: pd.DataFrame, dataset: str, models: list[str], conditions: list[str],
                  out_path, dpi: int = 150, paired: pd.DataFrame | None = None) -> None:
    """Grouped bars: one group per model, one bar per condition, 95% Wilson intervals.

    One panel per grader, so the paper-compatible number sits beside math-verify's (its
    substring-only part hatched); under each, every condition's paired difference from the
    baseline (``paired``: ``attnlab.reasoning.paired``'s rows of this dataset); below them, where each
    cell's answers came from and how many responses hit the token limit.
    """
    rows = 3 if paired is not None and len(paired) else 2
    fig = plt.figure(figsize=(4 + 1.6 * len(models) * 2, 6.4 + 2.0 * (rows == 3)))
    grid = fig.add_gridspec(rows, 2, height_ratios=(3, 1.4, 1.3) if rows == 3 else (3, 1.3))
    axes = [fig.add_subplot(grid[0, 0])]
    axes.append(fig.add_subplot(grid[0, 1], sharey=axes[0]))
    width = 0.8 / len(conditions)
    x = np.arange(len(models))
    offsets = [(k - (len(conditions) - 1) / 2) * width for k in range(len(conditions))]
    colours = plt.get_cmap("tab10")
    cells = {c: table.set_index(["model", "condition"]).reindex([(m, c) for m in models]) for c in conditions}
    on_end = False
    for ax, grader in zip(axes, GRADER_TITLES):
        for k, condition in enumerate(conditions):
            on_end |= _grade_bars(ax, x + offsets[k], cells[condition], grader, width, colours(k % 10), condition)
        ax.set_xticks(x, models)
        ax.set_title(_grader_title(grader))
        ax.set_ylabel("accuracy (%), greedy, 95% Wilson CI")
        ax.grid(axis="y", alpha=0.3)
    _accuracy_axis(axes[0], on_end)  # the panels share their y axis
    if rows == 3:
        for column, grader in enumerate(GRADER_TITLES):
            _plot_paired(fig.add_subplot(grid[1, column]), paired, grader, models, conditions, x, offsets, colours)
    _plot_answer_sources(fig.add_subplot(grid[rows - 1, :]), cells, models, x, offsets, width)
    n = int(table["n"].max()) if len(table) else 0
    fitted_suptitle(fig, f"Results on {dataset} (n = {n} per bar)")
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


def _grade_bars(ax, x, cells: pd.DataFrame, grader: str, width: float, colour, label: str) -> bool:
    """One bar per cell with its 95% CI and value; on the lenient panel the part only a
    substring match gives is hatched; a cell with nothing to grade is an empty, dashed bar
    that names the reason, never a bare 0%. Returns whether its labels stand on end."""
    reasons = [empty_reason(cell) for _, cell in cells.iterrows()]
    empty = np.array([reason is not None for reason in reasons])
    acc = np.where(empty, np.nan, cells[f"{grader}_acc"].to_numpy(float))
    err = np.nan_to_num(np.vstack([acc - cells[f"{grader}_ci_low"].to_numpy(float),
                                   cells[f"{grader}_ci_high"].to_numpy(float) - acc]))
    bars = ax.bar(x, np.nan_to_num(acc), width, yerr=err, capsize=3, label=label, color=colour)
    values = ["" if np.isnan(a) else f"{a:.0f}" for a in acc]
    upright = True
    if grader == "lenient":
        share = substring_share(cells)
        ax.bar(x, np.nan_to_num(share), width, bottom=np.nan_to_num(acc - share), fill=False,
               hatch=SUBSTRING_HATCH, edgecolor="black", lw=0)
        values = [v + (f" ({s:.0f} pts substr.)" if v and s > 0 else "") for v, s in zip(values, share)]
        upright = not any(v.endswith("substr.)") for v in values)
    if upright:
        ax.bar_label(bars, labels=values, fontsize=7, padding=2)
    else:  # a label with its substring note is wider than a bar: stood on end above the CI
        for xi, top, value in zip(np.atleast_1d(x), np.nan_to_num(acc + err[1]), values):
            ax.text(xi, top + 2, value, rotation=90, ha="center", va="bottom", fontsize=7)
    for xi, reason in zip(np.atleast_1d(x), reasons):
        if reason:
            ax.bar(xi, 100, width, fill=False, edgecolor=colour, ls="--", lw=1)
            ax.text(xi, 50, reason, rotation=90, ha="center", va="center", fontsize=7)
    return not upright


def _accuracy_axis(ax, room_for_labels: bool) -> None:
    """0-100 %, with room above for labels stood on end."""
    ax.set_ylim(0, 140 if room_for_labels else 105)
    ax.set_yticks(range(0, 101, 20))


def _plot_paired(ax, paired: pd.DataFrame, grader: str, models: list[str], conditions: list[str], x, offsets,
                 colours) -> None:
    """Each condition's paired difference from the baseline (points, Newcombe's interval) under
    its bar; a star where McNemar's exact test is significant at 0.05 after Holm's correction."""
    rows = paired[paired["grader"] == grader].set_index(["model", "condition"])
    for k, condition in enumerate(conditions):
        for xi, model in zip(x + offsets[k], models):
            if (model, condition) not in rows.index:
                continue
            row = rows.loc[(model, condition)]
            ax.errorbar(xi, row["difference_pts"], yerr=[[row["difference_pts"] - row["ci_low_pts"]],
                                                         [row["ci_high_pts"] - row["difference_pts"]]],
                        fmt="o", color=colours(k % 10), ms=4, capsize=2)
            if row["holm_p"] < 0.05:
                ax.annotate("*", (xi, row["ci_high_pts"]), ha="center", va="bottom", fontsize=11)
    ax.axhline(0, color="0.3", lw=0.8)
    ax.margins(y=0.3)  # room for the stars under the title
    ax.set_xticks(x, models)
    baseline = paired["baseline"].iloc[0]
    ax.set_ylabel(f"Δ vs {baseline} (pts)", fontsize=8)
    ax.set_title(f"Δ vs {baseline}, same items, 95% Newcombe CI\n* McNemar p < 0.05, Holm", fontsize=7)
    ax.grid(axis="y", alpha=0.3)


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
    ax.set_title("answer taken from (bars in the order above)\nlabel: responses that hit "
                 "the token limit / n", fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))


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
        ax.set_ylabel("accuracy (%), greedy, 95% Wilson CI")
        ax.grid(alpha=0.3)
    axes[0].legend(title="inserted kind", fontsize=8)
    if labels:
        axes[1].legend(dotted, ["dotted: without its substring-only matches"], fontsize=8)
    n = int(table["n"].max()) if len(table) else 0
    fitted_suptitle(fig, f"{model} on {dataset}: accuracy vs inserted length (n = {n} per point)")
    fig.tight_layout()
    _save(fig, out_path, dpi)


def plot_mlp_histograms(histograms: dict[str, pd.DataFrame], table: pd.DataFrame, baseline: str,
                        model: str, dataset: str, layer: int, near_zero: float, out_path,
                        dpi: int = 150, activation: str = "act_fn(gate_proj(x))") -> None:
    """One panel per condition: its histogram of a = ``activation`` (the family's MLP activation,
    ``anatomy.Family.activation_formula``) over the question tokens overlaid on the baseline's,
    log-scale counts, near-zero band shaded."""
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
        ax.set_xlabel(f"a = {activation}")
    for ax in axes[:, 0]:
        ax.set_ylabel("count (question tokens x units)")
    fitted_suptitle(fig, f"{model} on {dataset}: layer {layer} (0-based) MLP activations; "
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
    on_end = False
    for axes_row, (family, length) in zip(axes, groups):
        members = inserted[(inserted["family"] == family) & (inserted["length"] == length)]
        cells = pd.concat([plain, members]).drop_duplicates(["model", "placement"])
        cells = cells.set_index(["model", "placement"])
        present = [p for p in PLACEMENT_ORDER if p in cells.index.get_level_values(1)]
        x = np.arange(len(present))
        for ax, grader in zip(axes_row, GRADER_TITLES):
            for k, model in enumerate(models):
                on_end |= _grade_bars(ax, x + (k - (len(models) - 1) / 2) * width,
                                      cells.reindex([(model, p) for p in present]), grader, width,
                                      colours(k % 10), model)
            ax.set_xticks(x, [p.replace("_", "\n") for p in present])
            ax.set_title(f"{family}, {length} tokens: {_grader_title(grader)}", fontsize=9)
            ax.set_ylabel("accuracy (%), greedy, 95% Wilson CI")
            ax.grid(axis="y", alpha=0.3)
    _accuracy_axis(axes[0, 0], on_end)  # every panel shares this y axis
    handles, labels = axes[0, 0].get_legend_handles_labels()
    # beside the panels, not on them: an empty bar's vertical reason may stand anywhere
    fig.legend(handles + [_substring_patch()], labels + [SUBSTRING_LABEL], title="model", fontsize=8,
               loc="upper right")
    n = int(table["n"].max()) if len(table) else 0
    fitted_suptitle(fig, f"{dataset}: accuracy by placement of the insertion (n = {n} per bar)")
    fig.tight_layout(rect=(0, 0, 0.84, 1))
    _save(fig, out_path, dpi)
