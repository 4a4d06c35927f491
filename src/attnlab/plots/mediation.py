"""The mediation figure of one model × dataset × condition: each head's share of the effect (layer ×
head), each layer's MLP and residual stream, and the first layer's path beside every head and MLP
together; shares of the total effect with 95% bootstrap intervals over items."""

from __future__ import annotations

import numpy as np
import pandas as pd

from attnlab.plots.base import _save, fitted_suptitle, plt

GROUPS = {"L0.attention": "layer 0 attention\n(all its heads)", "L0.mlp": "layer 0 MLP",
          "top10_heads": "top 10 heads", "all_heads_mlps": "every head\nand MLP"}


def plot_mediation(summary: dict, out_path, dpi: int = 150) -> None:
    shares = pd.DataFrame(summary["shares"])
    top = pd.DataFrame(summary["top_heads"]).rename(columns={"component": "component"})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), gridspec_kw={"width_ratios": (1.1, 1.4, 1.0)})
    _head_map(fig, axes[0], shares[(shares["direction"] == "denoising") & (shares["kind"] == "head")],
              summary.get("heads_method", "exact"))
    _layer_bars(axes[1], shares)
    _path_bars(axes[2], shares, top)
    fitted_suptitle(fig, f"{summary['model']} on {summary['dataset']}: what carries {summary['condition']} − "
                         f"{summary['baseline']} ({summary['items']} items; mean total effect "
                         f"{summary['total_effect_mean']:+.3f} nats [{summary.get('total_effect_low', float('nan')):+.3f}, "
                         f"{summary.get('total_effect_high', float('nan')):+.3f}])")
    fig.text(0.01, 0.01, "share = mean effect / mean total effect over items; effect on the log-probability of "
                         "the treated run's answer, treated − baseline;\ndenoising: the baseline run given the "
                         "treated run's activation at the shared tokens; noising: the treated run given the "
                         "baseline's; bars: 95% bootstrap over items; top 10 heads: those of largest mean effect "
                         "in the total effect's direction, patched together", fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.07, 1, 0.93))
    _save(fig, out_path, dpi)


def _head_map(fig, ax, heads: pd.DataFrame, method: str) -> None:
    layers, n_heads = int(heads["layer"].max()) + 1, int(heads["head"].max()) + 1
    grid = np.full((layers, n_heads), np.nan)
    grid[heads["layer"].to_numpy(int), heads["head"].to_numpy(int)] = heads["share"].to_numpy(float)
    bound = max(float(np.nanmax(np.abs(grid))), 1e-9)
    image = ax.imshow(grid, aspect="auto", cmap="RdBu_r", vmin=-bound, vmax=bound, origin="lower")
    fig.colorbar(image, ax=ax, label="share of the total effect")
    ax.set_xlabel("head (0-based)")
    ax.set_ylabel("layer (0-based)")
    how = "exact patching" if method == "exact" else "attribution patching: a first-order estimate"
    ax.set_title(f"each head's share, denoising\n({how})", fontsize=9)


def _layer_bars(ax, shares: pd.DataFrame) -> None:
    offsets = {("mlp", "denoising"): -0.3, ("mlp", "noising"): -0.1, ("residual", "denoising"): 0.1,
               ("residual", "noising"): 0.3}
    colours = {"mlp": "tab:orange", "residual": "tab:gray"}
    for (kind, direction), offset in offsets.items():
        rows = shares[(shares["kind"] == kind) & (shares["direction"] == direction)].sort_values("layer")
        x = rows["layer"].to_numpy(float) + offset
        ax.bar(x, rows["share"], 0.2, color=colours[kind], alpha=1.0 if direction == "denoising" else 0.5,
               label=f"{kind}, {direction}")
        ax.errorbar(x, rows["share"], yerr=[rows["share"] - rows["share_low"], rows["share_high"] - rows["share"]],
                    fmt="none", ecolor="black", lw=0.6)
    ax.axhline(1, color="0.4", ls="--", lw=0.8)
    ax.axhline(0, color="0.4", lw=0.6)
    layers = sorted(shares.loc[shares["kind"] == "mlp", "layer"].unique())
    if len(layers) <= 12:
        ax.set_xticks(layers)
    ax.set_xlabel("layer (0-based)")
    ax.set_ylabel("share of the total effect")
    ax.set_title("each layer's MLP output and residual stream" + ("" if len(layers) > 12 else
                 f"\n(layers patched one at a time: {', '.join(map(str, layers))})"), fontsize=9)
    ax.legend(fontsize=7)


def _path_bars(ax, shares: pd.DataFrame, top: pd.DataFrame) -> None:
    rows = []
    for direction in ("denoising", "noising"):
        picked = shares[shares["direction"] == direction].set_index("component")
        for component in ("L0.attention", "L0.mlp", "all_heads_mlps"):
            rows.append((direction, component, *picked.loc[component, ["share", "share_low", "share_high"]]))
        t = top[top["direction"] == direction].iloc[0]
        rows.append((direction, "top10_heads", t["share"], t["share_low"], t["share_high"]))
    frame = pd.DataFrame(rows, columns=["direction", "component", "share", "low", "high"])
    order = list(GROUPS)
    for k, direction in enumerate(("denoising", "noising")):
        part = frame[frame["direction"] == direction].set_index("component").loc[order]
        x = np.arange(len(order)) + (k - 0.5) * 0.35
        ax.bar(x, part["share"], 0.35, label=direction, color="tab:blue", alpha=1.0 if k == 0 else 0.5)
        ax.errorbar(x, part["share"], yerr=[part["share"] - part["low"], part["high"] - part["share"]],
                    fmt="none", ecolor="black", lw=0.6)
    ax.axhline(1, color="0.4", ls="--", lw=0.8)
    ax.set_xticks(np.arange(len(order)), [GROUPS[c] for c in order], fontsize=7)
    ax.set_ylabel("share of the total effect")
    ax.set_title("the first layer's path (dashed: the total)", fontsize=9)
    ax.legend(fontsize=7)
