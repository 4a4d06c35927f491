"""The sweep over components kept: the patching engine's metric with only the first k of a ranked
order kept (heads for ``patching.heads.Patcher``, edges for ``patching.edges.EdgeCircuits``), for
every k of a grid refined around the first crossing of the threshold (``curves.refined_sweep``)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from attnlab.circuits.curves import refined_sweep


def sweep(engine, order, ks: list[int], threshold: float | None = None) -> tuple[pd.DataFrame, dict[int, np.ndarray]]:
    """The curve of the mean metric over ``ks`` (refined around the first crossing of ``threshold``
    where one is given; an engine with ``refine_points``, the edges', refines in log-spaced rounds)
    and each prompt's metric at every k measured."""
    per_prompt: dict[int, np.ndarray] = {}

    def metric_at(k: int) -> float:
        mean, per_prompt[k] = engine.per_prompt(engine.kept(order, k))
        return mean
    curve = refined_sweep(metric_at, len(order), ks, threshold, refine_points=getattr(engine, "refine_points", None))
    return curve, per_prompt
