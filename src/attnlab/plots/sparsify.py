"""The sparse post-training figures: training curves (density, KL, the CE change, the
multiplier; per corpus source) and the held-out density per layer x head."""

from __future__ import annotations

import pandas as pd

from attnlab.plots.base import _save, plt


def gate_bias_label(bias) -> str:
    """``b' = 1``, or ``b' per layer, -1 to 1`` for a copy calibrated per layer."""
    if isinstance(bias, list):
        return f"b' per layer, {min(bias):g} to {max(bias):g}"
    return f"b' = {bias:g}"


def plot_sparse_training(steps: pd.DataFrame, evals: pd.DataFrame, summary: dict, model: str,
                         out_path, dpi: int = 150) -> None:
    """Density, KL, the CE change and the multiplier against training tokens; held-out numbers for
    the mixture and, dashed, for each corpus source."""
    slack = summary["constraint"]["slack"]
    trained_bias = summary["gate_bias"]
    calibrated = evals[evals["gate_bias"] != trained_bias] if "gate_bias" in evals else evals.iloc[:0]
    evals = evals.drop(calibrated.index)
    inference_bias = gate_bias_label(summary.get("inference_gate_bias", trained_bias))
    calibrated_label = f"held-out at the calibrated {inference_bias}"
    sources = list(summary.get("heldout_by_source", {})) if len(summary.get("heldout_by_source", {})) > 1 else []
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    density, kl, ce, lam = axes.flat
    density.plot(steps["tokens"], steps["expected_density"], lw=1, alpha=0.6, label="training: E[open] = mean σ(s+b)")
    _heldout_lines(density, evals, calibrated, "density", sources, "held-out: open at inference, 1[s+b>0]",
                   calibrated_label)
    density.set_ylabel("share of causal edges open")
    density.set_ylim(0, 1.02)
    if "kl" in steps:  # measured on training batches under the KL bound alone
        kl.plot(steps["tokens"], steps["kl"], lw=1, alpha=0.6, label="training batch")
    _heldout_lines(kl, evals, calibrated, "kl", sources, "held-out", calibrated_label)
    if summary["constraint"]["type"] == "kl":
        kl.axhline(slack, ls="--", color="grey", lw=1, label=f"constraint: KL ≤ {slack:g}")
    kl.set_ylabel("KL(dense ‖ sparse), nats/token")
    _ce_change(ce, evals, calibrated, summary, sources, inference_bias)
    lam.plot(steps["tokens"], steps["multiplier"], lw=1.2)
    lam.set_yscale("log")
    lam.set_ylabel("multiplier λ")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("training tokens")
    at = (f"at the calibrated {inference_bias}" if len(calibrated)
          else f"at b = {trained_bias:g}")
    over = ""
    if summary.get("over_budget"):
        calibration = summary["calibration"]
        over = (f"\nOVER BUDGET: KL {calibration['grid'][0]['kl']:.3f} at the training bias on the calibration "
                f"text, above max_kl {calibration['max_kl']:g}; saved at that bias")
    fig.suptitle(f"{model}: sparse post-training of {summary['base']} (gate bias b = {trained_bias:g}, "
                 f"train {summary['train']}, constraint {summary['constraint']['type']})\n"
                 f"final held-out {at}: density {summary['heldout_density']:.3f}, KL {summary['heldout_kl']:.3f}, "
                 f"CE {summary['heldout_ce_sparse']:.3f} (dense {summary['heldout_ce_dense']:.3f}){over}"
                 + ("\nheld-out numbers of the mixture: each source's weighted by its weight" if sources else ""),
                 fontsize=9)
    fig.tight_layout()
    _save(fig, out_path, dpi)


def _heldout_lines(ax, evals: pd.DataFrame, calibrated: pd.DataFrame, column: str, sources: list[str],
                   label: str, calibrated_label: str) -> None:
    """The mixture's held-out ``column`` (and at a calibrated bias), and each source's dashed."""
    line, = ax.plot(evals["tokens"], evals[column], "o-", label=label)
    ax.plot(calibrated["tokens"], calibrated[column], "*", ms=11, color=line.get_color(), label=calibrated_label)
    for source in sources:
        ax.plot(evals["tokens"], evals[f"{column}[{source}]"], ".--", lw=1, label=f"held-out, {source}")


def _ce_change(ax, evals: pd.DataFrame, calibrated: pd.DataFrame, summary: dict, sources: list[str],
               inference_bias: str) -> None:
    """Held-out CE of the copy (and of the dense control) minus its base's: a ce constraint holds a
    training batch's to the slack."""
    slack, kind = summary["constraint"]["slack"], summary["constraint"]["type"]
    change = evals["ce_sparse"] - evals["ce_dense"]
    line, = ax.plot(evals["tokens"], change, "o-", label="sparse copy")
    ax.plot(calibrated["tokens"], calibrated["ce_sparse"] - calibrated["ce_dense"], "*", ms=11,
            color=line.get_color(), label=f"sparse at the calibrated {inference_bias}")
    for source in sources:
        ax.plot(evals["tokens"], evals[f"ce_sparse[{source}]"] - evals[f"ce_dense[{source}]"], ".--", lw=1,
                label=f"sparse copy, {source}")
    if "ce_control" in evals:
        ax.plot(evals["tokens"], evals["ce_control"] - evals["ce_dense"], "^--", label="dense control (fine-tuned alike)")
    if kind == "ce":
        ax.axhline(slack, ls="--", color="grey", lw=1, label=f"constraint on training batches: ≤ {slack:g}")
    ax.axhline(0, color="black", lw=0.6)
    ax.set_ylabel("held-out CE − base's CE, nats/token")


def plot_sparse_density(table: pd.DataFrame, summary: dict, model: str, out_path, dpi: int = 150) -> None:
    """Held-out share of open causal edges per layer x head."""
    grid = table.pivot(index="layer", columns="head", values="density")
    # at least room for the title and the colorbar's label, however few heads and layers
    fig, ax = plt.subplots(figsize=(max(5.0, 2.5 + 0.45 * grid.shape[1]), max(3.5, 1.5 + 0.18 * grid.shape[0])))
    image = ax.imshow(grid.to_numpy(), vmin=0, vmax=1, cmap="magma", aspect="auto", origin="lower")
    ax.set_xlabel("head (0-based)")
    ax.set_ylabel("layer (0-based)")
    fig.colorbar(image, ax=ax, label="share of causal edges open at inference")
    bias = summary.get("inference_gate_bias", summary["gate_bias"])
    gate = (f"1[s + b'_layer > 0], {gate_bias_label(bias)}" if isinstance(bias, list)
            else f"1[s + {bias:g} > 0]")
    ax.set_title(f"{model}: held-out density per head\ngate {gate}\n"
                 f"(mean {summary['heldout_density']:.3f}; "
                 f"{summary['heldout_tokens']} held-out tokens)", fontsize=9)
    fig.tight_layout()
    _save(fig, out_path, dpi)
