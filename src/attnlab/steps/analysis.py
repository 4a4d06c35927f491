"""Attention extraction and its figures; the MLP analysis."""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import pandas as pd

from attnlab import io
from attnlab.config.settings import Extraction, MlpAnalysis
from attnlab.steps.common import _arm, _model_and_prompts, log, log_cost_estimate


def extract_attention(model_dir: str, prompts_path: str, out_path: str, settings: dict,
                      attrs: dict, threads: int, arm: dict | None = None,
                      batch_size: int | None = None) -> None:
    from attnlab.extraction.extract import extract, write_attention
    from attnlab.interventions import intervened

    settings = Extraction(**settings)
    model, prompts, device, dtype, batch_size = _model_and_prompts(model_dir, prompts_path, settings,
                                                                   threads, batch_size)
    log.info("extracting %d prompts on %s (%s), batch size %d", len(prompts), device, dtype, batch_size)
    log_cost_estimate("extraction", model_dir, {"prompts": len(prompts), "batch": min(batch_size, len(prompts)),
                                                "tokens": int(prompts["n_prompt_tokens"].max())}, dtype, device)
    started = time.perf_counter()
    with intervened(model, arm=_arm(arm)):
        extraction = extract(model, prompts, batch_size, settings.full_map_layers)
    elapsed = time.perf_counter() - started
    log.info("%d tokens in %.1f s (%.0f tokens/s)", prompts["n_prompt_tokens"].sum(), elapsed,
             prompts["n_prompt_tokens"].sum() / max(elapsed, 1e-9))
    write_attention(out_path, extraction, prompts, {
        **attrs, "arm": arm or {}, **_tokenizer_provenance(model_dir), "dtype": str(dtype),
        "device": str(device)})


def _tokenizer_provenance(model_dir: str) -> dict:
    """Where the tokenizer was loaded from and a hash of its vocabulary and rules: its class
    ("TokenizersBackend" for every model under transformers 5) cannot tell two apart."""
    tokenizer_config = io.read_json(f"{model_dir}/tokenizer_config.json")
    tokenizer_json = os.path.join(model_dir, "tokenizer.json")
    digest = "no tokenizer.json"
    if os.path.exists(tokenizer_json):
        with open(tokenizer_json, "rb") as handle:
            digest = hashlib.sha256(handle.read()).hexdigest()
    return {"tokenizer": str(model_dir), "tokenizer_sha256": digest,
            "tokenizer_class": tokenizer_config.get("tokenizer_class", "unknown")}


def plot_attention_head(paths: dict[str, str], out_path: str, model: str, dataset: str,
                        layer: int, head: int, plot: dict, dpi: int) -> None:
    from attnlab.extraction.analysis import read_head
    from attnlab.plots.attention import plot_attention_head as plot_head

    per_condition = {condition: read_head(path, layer, head) for condition, path in paths.items()}
    plot_head(per_condition, model, dataset, layer, head, out_path, plot["drop_first"],
              plot["per_prompt"], dpi)


def plot_attention_figure(figure: dict, paths: list[str], out_path: str, plot: dict, dpi: int) -> None:
    """One composite figure; ``paths`` are the files ``plan.figure_files`` names, in its order."""
    from attnlab.config.plan import figure_files
    from attnlab.extraction.analysis import read_head
    from attnlab.plots.attention import plot_attention_figure as draw

    files = dict(zip(figure_files(figure), paths))
    panels = [{**panel, "per_condition": {
        condition: read_head(files[panel["model"], panel["dataset"], condition], panel["layer"],
                             panel["head"], key="attention.figures")
        for condition in figure["conditions"]}} for panel in figure["panels"]]
    draw(panels, figure["name"], figure["view"], figure["zoom"], out_path, plot["drop_first"],
         plot["per_prompt"], dpi)


def rank_attention_heads(paths: dict[str, str], table_path: str, figure_dir: str, model: str,
                         dataset: str, top: dict, plot: dict, ext: str, dpi: int) -> None:
    """Heads whose received attention changes most between two conditions, and their plots."""
    from pathlib import Path

    from attnlab.extraction.analysis import head_change_scores

    first, second = top["between"]
    scores = head_change_scores(paths[first], paths[second], plot["drop_first"])
    scores.insert(0, "between", f"{first} vs {second}")
    io.write_csv(scores, table_path)
    with io.atomic_path(figure_dir, directory=True) as tmp:
        for rank, row in enumerate(scores.head(top["k"]).itertuples(), start=1):
            plot_attention_head(paths, str(Path(tmp) / f"rank{rank}_layer{row.layer}_head{row.head}.{ext}"),
                                model, dataset, row.layer, row.head, plot, dpi)


def lambda_summary(paths: dict[str, str], table_path: str, figure_path: str, keys: dict,
                   dpi: int) -> None:
    from attnlab.extraction.analysis import lambda_table
    from attnlab.plots.attention import plot_lambda_heatmap

    table = lambda_table(paths)
    for key, value in reversed(list(keys.items())):
        table.insert(0, key, value)
    io.write_csv(table, table_path)
    plot_lambda_heatmap(table, keys["model"], keys["dataset"], figure_path, dpi)


def mlp_activations(model_dir: str, prompts_path: str, stats_path: str, histogram_path: str,
                    settings: dict, threads: int, arm: dict | None = None,
                    batch_size: int | None = None) -> None:
    """Statistics and a histogram of one layer's MLP activation over the question tokens."""
    from attnlab import anatomy
    from attnlab.interventions import intervened
    from attnlab.mechanism.recording import record_activations

    settings = MlpAnalysis(**settings)
    model, prompts, device, dtype, batch_size = _model_and_prompts(model_dir, prompts_path, settings,
                                                                   threads, batch_size)
    bins = settings.histogram
    edges = np.linspace(bins["low"], bins["high"], bins["bins"] + 1)
    log.info("layer %d MLP activations of %d prompts on %s (%s)", settings.layer, len(prompts),
             device, dtype)
    log_cost_estimate("mlp_activations", model_dir, {"prompts": len(prompts), "batch": min(batch_size, len(prompts)),
                                                     "tokens": int(prompts["n_prompt_tokens"].max()),
                                                     "layers_run": settings.layer + 1}, dtype, device)
    with intervened(model, arm=_arm(arm)):
        stats, histogram = record_activations(model, prompts, settings.layer, settings.near_zero,
                                              edges, batch_size)
    stats.insert(0, "id", prompts["id"].values)
    stats.insert(1, "activation", anatomy.of(model).family.activation_formula())  # what ``a`` is, for the figure
    outside = histogram["count"].iloc[[0, -1]].sum() / histogram["count"].sum()
    log.info("near-zero share %.4f, L1 %.2f, Gini %.3f; %.2f%% of values outside the histogram range",
             stats["near_zero"].mean(), stats["l1"].mean(), stats["gini"].mean(), 100 * outside)
    io.write_csv(stats, stats_path)
    io.write_csv(histogram, histogram_path)


def mlp_summary(stats_paths: dict[str, str], histogram_paths: dict[str, str], table_path: str,
                figure_path: str, keys: dict, baseline: str, layer: int, near_zero: float,
                dpi: int) -> None:
    from attnlab.interventions.mlp import summarise_statistics
    from attnlab.plots.base import plot_mlp_histograms

    stats = {c: pd.read_csv(path) for c, path in stats_paths.items()}
    histograms = {c: pd.read_csv(path) for c, path in histogram_paths.items()}
    table = summarise_statistics(stats, baseline)
    activation = next(iter(stats.values())).get("activation", pd.Series(["act_fn(gate_proj(x))"])).iloc[0]
    for key, value in reversed(list({**keys, "layer": layer, "activation": activation,
                                     "near_zero_threshold": near_zero}.items())):
        table.insert(0, key, value)
    io.write_csv(table, table_path)
    plot_mlp_histograms(histograms, table, baseline, keys["model"], keys["dataset"], layer,
                        near_zero, figure_path, dpi, activation)
