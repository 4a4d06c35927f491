"""Typed settings of the workflow's steps: frozen dataclasses built where a step starts
(``steps``) from the slice of the validated config its rule passes (``slice_of``, called in
common.smk). The keys a step reads are declared once, as the fields of its dataclass; the
schema (config/schema.yaml) holds their defaults, ranges and meaning.

Post-training's settings are ``attnlab.sparsify.settings.SparsifySettings``, ARM's
``attnlab.interventions.mlp.ArmSettings``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


def slice_of(cls, config: dict, leave_out: set[str] = frozenset()) -> dict:
    """What ``cls`` reads from ``config``, in field order (a rule's params: Snakemake reruns a
    job when they change, so a key the step does not read never reruns it); ``leave_out``: fields
    left to their defaults."""
    names = [f.name for f in dataclasses.fields(cls) if f.name not in leave_out]
    missing = [name for name in names if name not in config]
    if missing:
        raise KeyError(f"{cls.__name__} reads {missing}, which the config section lacks "
                       f"(has: {sorted(config)}); was the config validated (attnlab.config.validate.check)?")
    return {name: config[name] for name in names}


def scoring_params(pruning: dict, task: str, ablations: list[str]) -> dict:
    """One task's scoring job's settings; mean_pool only where a mean is taken, so a new pool
    reruns no job that never reads it."""
    pool = pruning["mean_pool"] if "mean" in ablations else None
    return slice_of(Scoring, {**pruning, **pruning["tasks"][task], "ablations": ablations, "mean_pool": pool})


def sweep_params(pruning: dict, ablation: str) -> dict:
    """One ablation's sweep settings; mean_pool only under mean ablation (as scoring_params)."""
    return slice_of(Sweep, {**pruning, "ablation": ablation,
                            "mean_pool": pruning["mean_pool"] if ablation == "mean" else None})


@dataclass(frozen=True)
class Generation:
    """Greedy generation of one model x dataset cell (``plan.cell_generation``)."""

    max_new_tokens: int
    batch_size: int
    device: str
    dtype: str
    seed: int
    stop_strings: list[str]
    engine: str


@dataclass(frozen=True)
class Extraction:
    """attention: the reduction of every layer and head into one HDF5 file per cell."""

    max_prompts: int | None
    batch_size: int
    device: str
    dtype: str
    full_map_layers: list[int]


@dataclass(frozen=True)
class MlpAnalysis:
    """mlp: statistics of one layer's MLP activation."""

    layer: int
    near_zero: float
    histogram: dict[str, Any]
    max_prompts: int | None
    batch_size: int
    device: str
    dtype: str


@dataclass(frozen=True)
class Mediation:
    """mediation: one treated condition against the baseline on the same items."""

    max_items: int | None
    arm_seeds: list[int]
    heads: str
    patched_layers: list[int] | None
    batch_size: int
    device: str
    dtype: str


@dataclass(frozen=True)
class Scoring:
    """pruning: one task's prompts and every head's score under each ablation (not the sweep's grid)."""

    seed: int
    ablations: list[str]  # plan.pruning_ablations: every configured one, the primary first
    ranking: str
    exact: bool
    rank_share: float  # of the n prompts, the share heads are ranked on (0: all, and counted on all)
    batch_size: int
    device: str
    n: int  # the task's clean/corrupted pairs (pruning.tasks.<task>.n)
    mean_pool: int | None  # mean ablation's reference: prompts drawn apart from the n (None: no mean)

    @property
    def runs_exact(self) -> bool:
        """Whether exact patching scores the heads beside attribution."""
        return self.exact or self.ranking == "exact"


@dataclass(frozen=True)
class Sweep:
    """pruning: the top-k sweep's grid, the threshold it refines the grid around, and the
    bootstrap over prompts that gives each count its interval."""

    seed: int
    ablation: str  # this sweep's, one of the configured ones (the rule's {ablation})
    ranking: str
    sweep_other_ranking: bool  # also sweep the ranking not configured (its count beside, in sweep.json)
    mean_pool: int | None  # mean ablation's reference: prompts drawn apart from the task's (None: not mean)
    batch_size: int
    device: str
    all_k_up_to: int
    log_points: int
    search: str  # rounds (counting.count_heads) or bisection (crossing_search)
    coarse_points: int  # bisection: the coarse grid (the rounds' grid: the fine one near the threshold)
    threshold: float
    bootstrap: dict[str, Any]  # n_resamples, confidence
    mib_sizes: bool = True  # also measure MIB's circuit sizes (circuits.areas)


@dataclass(frozen=True)
class EdgeSweep:
    """pruning.edges with the pruning settings it shares: EAP-IG's steps, the sweep's grid and its
    refinement, the threshold and the bootstrap."""

    seed: int
    steps: int
    batch_size: int
    score_chunk: int | None  # tokens per scoring pass (None: a mini-batch's in one)
    cache_gb: float | None  # corrupted recordings kept between evaluations (None: all)
    device: str
    log_points: int
    search: str  # rounds (curves.refined_sweep, counting.count_heads) or bisection (crossing_search)
    coarse_points: int  # bisection: the coarse grid (log_points: the fine grid near the threshold)
    refine_points: int
    interval_points: int
    n_counted: int | None  # the first n of the head sweep's counted prompts (None: all)
    threshold: float
    bootstrap: dict[str, Any]  # n_resamples, confidence
    mib_sizes: bool = True  # also measure MIB's circuit sizes (circuits.areas)
    method: str = "eap_ig"  # eap_ig, acdc or edge_pruning: what orders the edges (edge_params)
    faithfulness: str = "kl"  # acdc, edge_pruning: kl or metric (patching.faithfulness)
    acdc: dict[str, Any] | None = None  # threshold, max_minutes
    edge_pruning: dict[str, Any] | None = None  # sparsity, steps, warmup, lr, lambda_lr, read_at


# each method's own settings in pruning.edges; EAP-IG's are the section's top level (steps, score_chunk)
METHOD_KEYS = {"eap_ig": (), "acdc": ("faithfulness", "acdc"), "edge_pruning": ("faithfulness", "edge_pruning")}


def edge_ranking(edges: dict) -> str:
    """How ``pruning.edges``' method orders the edges, as a figure says it."""
    method = edges.get("method", "eap_ig")
    if method == "acdc":
        return f"ACDC ({edges['faithfulness']}, threshold {edges['acdc']['threshold']:g}), by the growth at removal"
    if method == "edge_pruning":
        return f"Edge Pruning ({edges['faithfulness']}, sparsity {edges['edge_pruning']['sparsity']:g}), by gate"
    return f"EAP-IG ({edges['steps']} steps), by |score|"


def edge_params(pruning: dict) -> dict:
    """An edge job's settings (``EdgeSweep``): the method's own only, so that a method's keys never
    rerun another method's jobs (EAP-IG's jobs read none of ACDC's or Edge Pruning's)."""
    settings = {**pruning, **pruning["edges"]}
    method = settings.get("method", "eap_ig")
    unread = {key for keys in METHOD_KEYS.values() for key in keys} - set(METHOD_KEYS[method])
    return slice_of(EdgeSweep, settings, leave_out=unread | ({"method"} if method == "eap_ig" else set()))


@dataclass(frozen=True)
class GroundTruth:
    """groundtruth, with pruning's seed and device: scoring every method of a compiled-program
    model against the circuit derived from its program."""

    seed: int
    device: str
    batch_size: int
    eap_ig_steps: list[int]  # edge scores at each step count (1: plain EAP), ROC AUC for each
    control_n: int  # negative-control pairs
    tolerance: float  # a negative control passes when every effect is at most this
    acdc: dict[str, Any] | None = None  # ACDC's threshold and faithfulness (None: not scored)
    edge_pruning: dict[str, Any] | None = None  # Edge Pruning's schedule and faithfulness (None: not scored)
