"""The mediation of one condition's effect, its figure, and the table gathering every cell's."""

from __future__ import annotations

import pandas as pd

from attnlab import io
from attnlab.config.settings import Mediation
from attnlab.steps.common import _batch_size, log, log_cost_estimate, log_replaced_rows


def mediate_condition(model_dir: str, inputs: dict, out_effects: str, out_summary: str, settings: dict,
                      keys: dict, threads: int, arm: dict | None = None, batch_size: int | None = None) -> None:
    """``inputs``: the baseline's and the treated condition's prompts, the treated generations and
    grades. Writes every component's effect per item (Parquet) and the shares (JSON)."""
    import torch

    from attnlab import anatomy
    from attnlab.interventions.mlp import ArmSettings
    from attnlab.mechanism.mediation import SHARE_DEFINITION, items_from_tables, mediate
    from attnlab.cost.requests import mediation_sizes
    from attnlab.models import load_model, pick_device, pick_dtype
    from attnlab.tokenization import load_tokenizer

    settings = Mediation(**settings)
    torch.set_num_threads(threads)
    device = pick_device(settings.device)
    model = load_model(model_dir, device, pick_dtype(settings.dtype, device))
    tokenizer = load_tokenizer(model_dir)
    items = items_from_tables(io.read_parquet(inputs["baseline"]), io.read_parquet(inputs["treated"]),
                              io.read_parquet(inputs["generations"]), pd.read_csv(inputs["grades"], dtype={"id": str}),
                              lambda ids: tokenizer.decode(ids, skip_special_tokens=False), settings.max_items)
    log.info("%s: %d items, continuations of %d tokens on average", keys, len(items),
             sum(len(item.continuation) for item in items) / max(1, len(items)))
    n_layers = anatomy.of(model).n_layers
    if settings.patched_layers is not None and any(layer >= n_layers for layer in settings.patched_layers):
        raise ValueError(f"mediation.patched_layers {settings.patched_layers}: {keys['model']} has layers 0..{n_layers - 1}; "
                         "name layers it has, or null for every layer")
    arm_settings = ArmSettings(**arm) if arm else None
    work = mediation_sizes(len(items), _batch_size(settings.batch_size, batch_size),
                           max(item.treated_length for item in items), max(len(item.continuation) for item in items),
                           len(settings.arm_seeds) if arm else 0,
                           settings.patched_layers)
    log_cost_estimate("mediation", model_dir, work, next(model.parameters()).dtype, device)
    result = mediate(model, items, _batch_size(settings.batch_size, batch_size), arm_settings,
                     tuple(settings.arm_seeds) if arm_settings else (), settings.heads, settings.patched_layers)
    effects = result["effects"].merge(result["totals"], on="id")
    io.write_parquet(effects, out_effects)
    totals = result["totals"]["total_effect"]
    io.write_json({**keys, "items": len(items), "definition": SHARE_DEFINITION, "heads_method": settings.heads,
                   "patched_layers": settings.patched_layers,
                   "total_effect_mean": float(totals.mean()), "total_effect_sd": float(totals.std()),
                   "total_effect_low": result["total_interval"][0], "total_effect_high": result["total_interval"][1],
                   "shares": result["shares"].to_dict("records"), "top_heads": result["top_heads"].to_dict("records"),
                   "arm": _arm_summary(result["arm"]), "totals": result["totals"].to_dict("records")}, out_summary)


def _arm_summary(arm: pd.DataFrame) -> dict:
    """ARM's mean effect per seed, and their spread (the seeds' standard deviation and range)."""
    if arm.empty:
        return {}
    per_seed = arm.groupby("seed")["effect"].mean()
    return {"per_seed": {int(k): float(v) for k, v in per_seed.items()}, "mean": float(per_seed.mean()),
            "sd_over_seeds": float(per_seed.std()), "min": float(per_seed.min()), "max": float(per_seed.max())}


def mediation_table(summary_paths: list[str], out_path: str, config: str = "") -> None:
    """One row per model × dataset × condition × direction: the total effect and the shares a
    reader asks first (layer 0's attention and MLP, the top 10 heads, every head and MLP); each row
    names the ``config`` it ran under, and the log the rows of the last table it drops or rewrites."""
    rows = []
    for path in summary_paths:
        summary = io.read_json(path)
        shares = pd.DataFrame(summary["shares"])
        top = pd.DataFrame(summary["top_heads"])
        for direction in ("denoising", "noising"):
            picked = shares[shares["direction"] == direction].set_index("component")
            row = {key: summary[key] for key in ("model", "dataset", "condition", "baseline")}
            row.update(direction=direction, items=summary["items"], total_effect_mean=summary["total_effect_mean"],
                       total_effect_low=summary["total_effect_low"], total_effect_high=summary["total_effect_high"],
                       heads_method=summary.get("heads_method", "exact"))
            for component in ("L0.attention", "L0.mlp", "all_heads_mlps"):
                for column in ("share", "share_low", "share_high"):
                    row[f"{component}_{column}"] = float(picked.at[component, column])
            top_row = top[top["direction"] == direction].iloc[0]
            row.update(top10_heads=top_row["heads"], top10_share=top_row["share"],
                       top10_share_low=top_row["share_low"], top10_share_high=top_row["share_high"])
            row.update({f"arm_{k}": v for k, v in summary["arm"].items() if k != "per_seed"})
            rows.append(row)
    table = pd.DataFrame(rows)
    table.insert(0, "config", config)
    log_replaced_rows(table, out_path, ["model", "dataset", "condition", "direction"])
    io.write_csv(table, out_path)


def plot_mediation(summary_path: str, out_path: str, dpi: int) -> None:
    from attnlab.plots.mediation import plot_mediation as plot

    plot(io.read_json(summary_path), out_path, dpi)
