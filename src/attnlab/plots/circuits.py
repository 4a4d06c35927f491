"""Figures of the circuit side: explained-effect curves with their N× and fragile flags, the
sparse post-training (curves, density per head) and heads needed against density."""

from __future__ import annotations

import textwrap

import numpy as np
import pandas as pd

from attnlab.circuits.curves import (FRAGILITY_DEFINITION, GRID_COUNT, GRID_NOTE, count_text, crossing, fragility,
                                    heads_ratio, interval_text)
from attnlab.circuits.task_gap import KEPT_GAP_FLOOR, KEPT_GAP_LABEL
from attnlab.config.plan import comparison_pairs
from attnlab.plots.base import _save, fitted_suptitle, plt


EFFECT_DEFINITIONS = {
    "heads": "explained effect = (m(k) − m(0)) / (m(all) − m(0)), MLPs intact",
    "edges": "explained effect = (m(n) − m(0)) / (m(all) − m(0)); an edge not kept carries its sender's "
             "corrupted activation",
}


def plot_pruning(sweeps: dict[str, pd.DataFrame], task: str, compare: list[str] | None,
                 threshold: float, ablation: str, ranking: str, out_path, dpi: int = 150,
                 summaries: dict[str, dict] | None = None, ratios: dict[tuple, dict] | None = None,
                 unit: str = "heads", pair_notes: dict[tuple, str] | None = None) -> None:
    """Explained effect vs number of heads (``unit``: or edges) kept, one curve per model, with an "N×" label;
    a count that rests on a late jump, a curve that overshoots 1 or falls back below the
    threshold is marked on its curve and the N× label says "fragile" with the reason.
    ``summaries`` (each model's sweep.json) give the counts' intervals and the prompts they rest
    on, ``ratios`` (keyed by compared pair, from ``counting.ratio_between``) the N×'s, and
    ``pair_notes`` (same keys) a line under a pair's N× (a copy's kept gap, ``task_gap``); a curve
    with ``effect_low``/``effect_high`` columns is drawn with its band."""
    summaries, ratios, pair_notes = summaries or {}, ratios or {}, pair_notes or {}
    fig, ax = plt.subplots(figsize=(7.5, 5))
    colours = plt.get_cmap("tab10")
    needed, flags, bounds = {}, {}, []
    for k, (model, sweep) in enumerate(sweeps.items()):
        count, flags[model] = crossing(sweep, threshold), fragility(sweep, threshold)
        needed[model] = count["heads_to_reach_threshold"]
        if needed[model] is not None and not count["heads_to_reach_exact"]:
            bounds.append(model)
        fragile = "; fragile" if flags[model]["fragile"] else ""
        text = count_text(needed[model], count["heads_to_reach_exact"])
        if "heads_interval" in summaries.get(model, {}):
            text += " " + interval_text(*summaries[model]["heads_interval"])
        label = f"{model} ({text} {unit} to {threshold:g}{fragile})"
        colour = colours(k % 10)
        if {"effect_low", "effect_high"} <= set(sweep):
            ax.fill_between(sweep["heads_kept"], sweep["effect_low"], sweep["effect_high"], color=colour,
                            alpha=0.15, lw=0)
        ax.plot(sweep["heads_kept"], sweep["explained_effect"], color=colour, lw=1.5, label=label)
        if needed[model] is not None:
            ax.plot([needed[model]], [threshold], "o", color=colour)
        _mark_fragility(ax, sweep, needed[model], threshold, flags[model], colour, slot=k, unit=unit)
    ax.axhline(threshold, ls="--", color="grey", lw=1)
    labels = []
    for first, second in comparison_pairs(compare, list(sweeps)):
        if needed.get(first) and needed.get(second):
            labels.append(_ratio_label(first, second, needed, threshold, ratios.get((first, second)), unit)
                          + _fragile_note({m: flags[m] for m in (first, second)}).replace(" heads", f" {unit}"))
        if pair_notes.get((first, second)):  # said with or without an N×: a copy that lost the task may reach none
            labels.append(textwrap.fill(pair_notes[(first, second)], 80, initial_indent="    ",
                                        subsequent_indent="     "))
    if bounds:
        labels.append(textwrap.fill(f"{GRID_NOTE} ({', '.join(bounds)}): N× from such counts is not exact", 80))
    ax.set_xscale("symlog", linthresh=10)
    ax.set_xlim(left=0)
    ax.set_xlabel(f"Number of {unit.title()} Kept")
    ax.set_ylabel("Explained Effect")
    title = f"{task}: ablation = {ablation}, ranking = {ranking}\n" + EFFECT_DEFINITIONS[unit]
    ax.set_title("\n".join(textwrap.fill(line, 90) for line in title.split("\n")), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    notes = [FRAGILITY_DEFINITION.replace("heads", unit)]
    if summaries:
        notes.insert(0, _prompts_note(summaries))
    _text_below(fig, "\n".join(labels), "\n".join(textwrap.fill(note, 130) for note in notes))
    _save(fig, out_path, dpi)


def _text_below(fig, labels: str, notes: str) -> None:
    """The N× statements (9 pt) and the definitions (6.5 pt) under the axes, the figure grown to
    hold them: inside the axes they covered the curves' own marks."""
    def height(text: str, size: float) -> float:  # inches
        return (text.count("\n") + 1) * size * 1.3 / 72 if text else 0.0
    below = height(labels, 9) + height(notes, 6.5) + 0.15
    fig.set_size_inches(fig.get_figwidth(), fig.get_figheight() + below)
    total = fig.get_figheight()
    fig.text(0.01, 0.03 / total, notes, fontsize=6.5, va="bottom")
    if labels:
        fig.text(0.01, (0.08 + height(notes, 6.5)) / total, labels, fontsize=9, va="bottom")
    fig.tight_layout(rect=(0, (below + 0.05) / total, 1, 1))


def _prompts_note(summaries: dict[str, dict]) -> str:
    """What the counts and intervals rest on: prompts ranked on and counted on, the bootstrap."""
    parts = []
    for model, summary in summaries.items():
        ranked, counted = summary.get("n_prompts_ranked_on"), summary.get("n_prompts_counted_on")
        if summary.get("rank_share"):
            parts.append(f"{model}: ranked on {ranked} prompts, counted on {counted} others")
        elif counted is not None:
            parts.append(f"{model}: ranked and counted on the same {counted} prompts")
    first = next(iter(summaries.values()))
    confidence, resamples = first.get("interval_confidence"), first.get("bootstrap_resamples")
    band = (f"; [a, b] and bands: {confidence:.0%} bootstrap intervals over the counted prompts "
            f"({resamples} resamples; paired for models on the same prompts)" if confidence else "")
    return "; ".join(parts) + band


def _ratio_label(first: str, second: str, needed: dict, threshold: float, interval: dict | None = None,
                 unit: str = "heads") -> str:
    """"N× fewer heads (edges) for B than A", with the N×'s interval when there is one."""
    ratio = needed[first] / needed[second]
    spread = "" if interval is None else f", N× {interval_text(interval['low'], interval['high'], 2)}"
    if ratio >= 1:
        return f"{ratio:.1f}× fewer {unit} for {second} than {first} at {threshold:g}{spread}"
    # "0.7× fewer" would read as fewer: say more, and keep the paper's N× beside it
    return f"{1 / ratio:.1f}× more {unit} for {second} than {first} (N× = {ratio:.2f}{spread})"


def _fragile_note(flags: dict[str, dict]) -> str:
    """'' when both counts stand; else the reasons, per model, on a line of their own."""
    reasons = [f"{model}: {', '.join(flag['fragile_reasons'])}" for model, flag in flags.items() if flag["fragile"]]
    if not reasons:
        return ""
    return "\n" + textwrap.fill(f"(fragile: {'; '.join(reasons)})", 80, initial_indent="    ",
                                 subsequent_indent="     ")


def _mark_fragility(ax, sweep: pd.DataFrame, needed: int | None, threshold: float, flags: dict,
                    colour, slot: int = 0, unit: str = "heads") -> None:
    """Mark on the curve what makes its count fragile: the late climb (thick), the overshoot's
    peak (▲) and the lowest point after falling back below the threshold (▼). The ``slot``-th
    curve's labels sit one text line from the one before's (curves often peak together)."""
    lift = 9 * slot
    if flags["late_jump"]:
        climb = sweep[(sweep["heads_kept"] >= flags["jump_from_heads"]) & (sweep["heads_kept"] <= needed)]
        ax.plot(climb["heads_kept"], climb["explained_effect"], color=colour, lw=5, alpha=0.35)
        ax.annotate(f"late jump +{flags['jump_rise']:.2f}\nover {flags['jump_width_heads']} {unit}",
                    (needed, threshold), xytext=(-6, 8 + 2 * lift), textcoords="offset points", ha="right",
                    fontsize=7, color=colour, zorder=4)
    if flags["overshoots"]:
        ax.plot([flags["overshoot_at_heads"]], [flags["max_explained_effect"]], "^", color=colour, zorder=4)
        # at the top of the axes, one line per curve: two curves' peaks often lie a few points apart
        ax.annotate(f"overshoot +{flags['overshoot']:.2f}", (flags["overshoot_at_heads"], flags["max_explained_effect"]),
                    xytext=(flags["overshoot_at_heads"], 0.98 - 0.05 * slot), textcoords=ax.get_xaxis_transform(),
                    ha="right", va="top", fontsize=7, color=colour, zorder=4)
    if flags["cross_back_at_heads"] is not None:
        ax.plot([flags["cross_back_at_heads"]], [flags["cross_back_min"]], "v", color=colour, zorder=4)


def _count_bars(ax, line: pd.DataFrame, colour) -> None:
    """Each count's interval as an error bar; where the upper end is never (some resamples never
    reach the threshold) an arrow points up from the count. A count never reached has none."""
    if "heads_low" not in line:
        return
    reached = line.dropna(subset=["heads_to_reach_threshold"])
    counts = reached["heads_to_reach_threshold"].astype(float)
    low = reached["heads_low"].astype(float).fillna(counts)
    high = reached["heads_high"].astype(float)
    bounded = high.notna()
    # a first crossing need not lie inside its resamples' percentile interval: clip, never negative
    ax.errorbar(reached["heldout_density"][bounded], counts[bounded],
                yerr=[(counts - low)[bounded].clip(lower=0), (high - counts)[bounded].clip(lower=0)],
                fmt="none", ecolor=colour, capsize=2, lw=0.8)
    for density, count in zip(reached["heldout_density"][~bounded], counts[~bounded]):
        ax.annotate("", (density, count), xytext=(0, 18), textcoords="offset points",
                    arrowprops={"arrowstyle": "<-", "color": colour, "lw": 0.8})


def _log_density_axis(ax, densities: pd.Series) -> None:
    """A log x axis labelled at its decades, or, where the densities span less than one (the
    minor labels 9.5×10⁻¹, 9.6×10⁻¹, … would print over each other), at the lowest and highest."""
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())
    low, high = float(densities.min()), float(densities.max())
    decades = np.floor(np.log10(high)) - np.ceil(np.log10(low)) + 1  # powers of ten in [low, high]
    if decades < 2:
        ax.set_xticks(sorted({low, high}))
        ax.xaxis.set_major_formatter(FormatStrFormatter("%.3g"))


def plot_heads_vs_density(table: pd.DataFrame, base: str, out_path, dpi: int = 150,
                          unit: str = "heads") -> None:
    """Heads (``unit``: or edges, the table's columns still named heads_*) to the threshold
    against held-out density (log), one panel per task and ablation (a row of tasks per ablation:
    the counts of several ablations at one density would print their labels over each other),
    one line per dense model x ranking x prompt count; the dense model sits at density 1 and each
    copy is labelled N× against it. A curve that never reaches the threshold has no point (NaN).
    A copy the table says lost the task (``task_lost``: it keeps less than
    ``task_gap.KEPT_GAP_FLOOR`` of its base's clean − corrupted gap) is drawn hollow.
    ``base`` names the dense model where the table has no ``base`` column."""
    from matplotlib.lines import Line2D

    if "base" not in table:
        table = table.assign(base=base)
    tasks, ablations = list(dict.fromkeys(table["task"])), list(dict.fromkeys(table["ablation"]))
    fig, axes = plt.subplots(len(ablations), len(tasks), figsize=(max(8.0, 4.2 * len(tasks)), 4.6 * len(ablations)),
                             squeeze=False)
    counted = "n_prompts_counted_on" if "n_prompts_counted_on" in table else "n_prompts"
    several = table["base"].nunique() > 1
    for row, ablation in zip(axes, ablations):
        for ax, task in zip(row, tasks):
            panel = table[(table["task"] == task) & (table["ablation"] == ablation)]
            for (family, ranking, n), line in panel.groupby(["base", "ranking", counted], sort=False):
                line = line.sort_values("heldout_density")
                prefix = f"{family}: " if several else ""
                drawn = ax.plot(line["heldout_density"], line["heads_to_reach_threshold"], marker="o",
                                label=f"{prefix}{ablation}, {ranking}, counted on {n} prompts")
                _count_bars(ax, line, drawn[0].get_color())
                _mark_lost_tasks(ax, line, drawn[0].get_color())
                _label_copies(ax, line)
            _log_density_axis(ax, table["heldout_density"])
            ax.set_title(f"{task}, {ablation} ablation" if len(ablations) > 1 else task)
            ax.set_xlabel("held-out density (share of causal edges open)")
            ax.set_ylabel(f"{unit} to {table['threshold'].iloc[0]:g} explained effect")
        handles = row[0].get_legend_handles_labels()[0]
        if "task_lost" in table and table["task_lost"].fillna(False).astype(bool).any():
            handles.append(Line2D([], [], ls="none", marker="o", mfc="white", mec="black", label=KEPT_GAP_LABEL))
        row[0].legend(handles=handles, fontsize=6)
    dense_name = "the dense model" if several else base if base else table["base"].iloc[0]
    fitted_suptitle(fig, f"{unit.title()} needed vs density; labels: N× = {unit} {dense_name} needs / {unit} the "
                    "copy needs (> 1: the copy needs fewer); density on held-out text at the copy's "
                    "inference gate bias" + _density_caveats(table, unit), fontsize=8)
    fig.tight_layout()  # it makes room for the suptitle's lines
    _save(fig, out_path, dpi)


def _mark_lost_tasks(ax, line: pd.DataFrame, colour) -> None:
    """Each copy that lost the task (``task_lost``), drawn hollow over its point."""
    if "task_lost" not in line:
        return
    lost = line[line["task_lost"].fillna(False).astype(bool)]
    ax.plot(lost["heldout_density"], lost["heads_to_reach_threshold"], ls="none", marker="o", mfc="white",
            mec=colour, zorder=3)


def _label_copies(ax, line: pd.DataFrame) -> None:
    """Each copy's N× against the dense model of its line, with its interval and why it is not
    to be taken at face value (fragile; a count off a grid)."""
    exact = line.get("heads_to_reach_exact", pd.Series(True, index=line.index)).astype(bool)
    dense = line[line["heldout_density"] >= 1]
    for index, row in line[line["heldout_density"] < 1].iterrows():
        ratio = heads_ratio(dense["heads_to_reach_threshold"].iloc[0] if len(dense) else None,
                            row["heads_to_reach_threshold"])
        if np.isnan(ratio):
            continue
        bound = not (exact[dense.index].all() and exact[index])  # either count off a grid
        notes = [note for note, on in (("fragile", row.get("heads_fewer_fragile", False)), ("grid", bound)) if on]
        spread = ""
        if pd.notna(row.get("heads_fewer_low")) and pd.notna(row.get("heads_fewer_high")):
            spread = " " + interval_text(row["heads_fewer_low"], row["heads_fewer_high"], 2)
        ax.annotate(f"{ratio:.2g}×{spread}" + (f" ({', '.join(notes)})" if notes else ""),
                    (row["heldout_density"], row["heads_to_reach_threshold"]),
                    fontsize=6, xytext=(4, 2), textcoords="offset points")


def _density_caveats(table: pd.DataFrame, unit: str) -> str:
    """The title's notes on the flags and intervals the table carries."""
    caveats = ("; (fragile): either count rests on a late jump, an overshoot past 1 or a curve "
               "falling back below the threshold (heads_vs_density.csv says which)"
               if "heads_fewer_fragile" in table else "")
    if "heads_to_reach_exact" in table and not table["heads_to_reach_exact"].all():
        caveats += f"; (grid): either count is the {GRID_COUNT} (heads_to_reach_exact, unmeasured_below)"
    if "heads_fewer_low" in table:
        caveats += ("; bars and [a, b]: bootstrap intervals over the prompts counted on (heads_low/high, "
                    "heads_fewer_low/high; paired where both models were counted on the same prompts; an arrow up: "
                    "some resamples never reach the threshold), given the ranking")
    if "task_lost" in table:
        caveats += (f"; hollow: the copy keeps less than {KEPT_GAP_FLOOR:.0%} of its base's clean − corrupted gap on "
                    "the counted prompts (kept_gap, task_lost), so its count is of what is left of the task")
    return caveats.replace("heads", unit)  # the columns of {unit}_vs_density.csv


def _component_positions(layers: int, heads: int, kv_heads: int) -> dict[str, tuple[float, float]]:
    """Where each component sits: one row per layer's attention (its heads; key/value heads a
    little below, under the query heads they serve), one per layer's MLP (right), the embeddings
    at the bottom and the logits at the top."""
    middle = (heads - 1) / 2
    places = {"embed": (middle, -1.0), "logits": (middle, 2.0 * layers)}
    group = heads // kv_heads
    for layer in range(layers):
        for head in range(heads):
            places[f"L{layer}.H{head}"] = (head, 2.0 * layer)
        for kv in range(kv_heads):
            places[f"L{layer}.KV{kv}"] = (kv * group + (group - 1) / 2, 2.0 * layer - 0.4)
        places[f"L{layer}.MLP"] = (heads + 0.5, 2.0 * layer + 1)
    return places


def _component(name: str) -> str:
    """The node a sender or receiver belongs to: L3.H2.q -> L3.H2, L3.KV1.k -> L3.KV1."""
    return name.rsplit(".", 1)[0] if name.endswith((".q", ".k", ".v")) else name


def plot_circuit(edges: pd.DataFrame, kept: int, dims: tuple[int, int, int], title: str, out_path,
                 dpi: int = 150, max_drawn: int = 400) -> None:
    """The circuit of the ``kept`` edges of largest |score| (``edges``: every edge with score and
    rank), drawn over the model's components (``dims``: layers, heads, key/value heads); at most
    ``max_drawn`` of them, the strongest, and the title says so."""
    from matplotlib.collections import LineCollection

    layers, heads, kv_heads = dims
    places = _component_positions(layers, heads, kv_heads)
    circuit = edges.sort_values("rank").head(kept)
    drawn = circuit.head(max_drawn)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * heads + 3), max(6.0, 0.32 * layers + 2)))
    xy = np.array(list(places.values()))
    ax.scatter(xy[:, 0], xy[:, 1], s=6, color="0.85", zorder=1)
    used = set(drawn["sender_name"]) | {_component(name) for name in drawn["receiver_name"]}
    on = np.array([places[name] for name in used])
    if len(on):
        ax.scatter(on[:, 0], on[:, 1], s=14, color="black", zorder=3)
    segments = [(places[row.sender_name], places[_component(row.receiver_name)]) for row in drawn.itertuples()]
    strength = drawn["score"].abs().to_numpy()
    widths = 0.2 + 2.8 * strength / strength.max() if len(strength) and strength.max() > 0 else 0.5
    colours = np.where(drawn["score"].to_numpy() >= 0, "tab:blue", "tab:red")
    ax.add_collection(LineCollection(segments, linewidths=widths, colors=colours, alpha=0.45, zorder=2))
    ax.set_yticks([-1, *[2 * layer for layer in range(0, layers, max(1, layers // 10))], 2 * layers])
    ax.set_yticklabels(["embed", *[f"L{layer}" for layer in range(0, layers, max(1, layers // 10))], "logits"])
    ax.set_xticks(list(range(heads)) + [heads + 0.5])
    ax.set_xticklabels([f"H{head}" for head in range(heads)] + ["MLP"], fontsize=7)
    ax.set_xlim(-1, heads + 1.5)
    ax.set_ylim(-2, 2 * layers + 1)
    shown = f"all {kept:,}" if kept <= max_drawn else f"the {max_drawn:,} of largest |score| of {kept:,}"
    fitted_suptitle(fig, f"{title}\n{shown} edges drawn; width ∝ |EAP-IG score|, blue: positive "
                    "(carries the clean effect), red: negative; key/value heads under their query heads",
                    fontsize=8)
    fig.tight_layout()
    _save(fig, out_path, dpi)
