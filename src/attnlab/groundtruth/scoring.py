"""Each circuit method against the truth: precision and recall of the circuit it counted, and the
ROC AUC of its scores as a classifier of truth membership (scikit-learn's, on |score|: a method's
effects can carry either sign).

A counted circuit is exactly what the method kept at its count: the top k of the order the sweep
used (heads: by the ranking's signed score, ties in head order; edges: by rank, |score| with ties
in edge order). Where every candidate or none is in the truth the AUC is undefined (None).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from sklearn.metrics import roc_auc_score, roc_curve


def method_row(method: str, unit: str, names: list, scores: np.ndarray, truth: set,
               kept: list | None = None) -> dict:
    """One method's row: candidates, truth size, AUC, and for a counted circuit ``kept`` its size,
    precision, recall and the components missed or added (names)."""
    member = np.array([name in truth for name in names])
    magnitude = np.abs(np.asarray(scores, dtype=float))
    defined = 0 < member.sum() < len(member)
    row = {"method": method, "unit": unit, "candidates": len(names), "truth": int(member.sum()),
           "auc": float(roc_auc_score(member, magnitude)) if defined else None,
           "counted": None, "precision": None, "recall": None, "missed": None, "added": None}
    if kept is not None:
        chosen = set(kept)
        found = chosen & truth
        row.update(counted=len(chosen), precision=len(found) / len(chosen) if chosen else None,
                   recall=len(found) / len(truth) if truth else None,
                   missed=" ".join(sorted(map(_name, truth - chosen))), added=" ".join(sorted(map(_name, chosen - truth))))
    return row


def roc_points(method: str, unit: str, names: list, scores: np.ndarray, truth: set) -> pd.DataFrame:
    """The ROC curve of |score| (false and true positive rates at each threshold)."""
    member = np.array([name in truth for name in names])
    if not 0 < member.sum() < len(member):
        return pd.DataFrame(columns=["method", "unit", "fpr", "tpr"])
    fpr, tpr, _ = roc_curve(member, np.abs(np.asarray(scores, dtype=float)))
    return pd.DataFrame({"method": method, "unit": unit, "fpr": fpr, "tpr": tpr})


def _name(component) -> str:
    if isinstance(component, tuple) and len(component) == 2 and all(isinstance(x, int) for x in component):
        return f"L{component[0]}.H{component[1]}"
    if isinstance(component, tuple):
        return "->".join(component)
    return str(component)
