"""The inference gate bias b' of the saved copy, globally and per layer (docs/sparsify.md,
"Calibrated inference gate")."""

from __future__ import annotations

import logging
import math
import time

import torch

from attnlab.attention import sparse
from attnlab.interventions import intervened
from attnlab.sparsify.settings import Calibration, SparsifySettings
from attnlab.sparsify.heldout import gated_kl, kl_reference, logits_fit, reference_logits
from attnlab.sparsify.train import Trainer

log = logging.getLogger(__name__)


def calibrate_gate_bias(trainer: Trainer, ids: torch.Tensor, settings: SparsifySettings
                        ) -> tuple[sparse.GateBias, dict]:
    """The inference gate bias b' of the saved copy: from the training bias down in steps of
    ``step``, the lowest b' before KL(reference || sparse) on ``ids`` exceeds ``max_kl`` (or
    ``lowest`` is passed); the reference is the base, or under ce_control the dense control
    (``heldout.kl_reference``). Returns b' and the grid measured (gate bias, KL, density); with
    ``per_layer`` on, b' is then refined per layer (calibrate_per_layer) and returned as a list.

    Post-training lowers the weights' cost of gating far below the training bias (docs/results.md), so
    a lower threshold at inference can keep fewer edges within the same KL. The scan stops at
    the first b' over the limit: KL grows as b' falls, and it is not searched past a bump.
    """
    started = time.perf_counter()
    options = settings.calibrate_gate_bias
    trained = settings.gate_bias
    # KL from the base, or from the dense control under ce_control (kl_reference); its logits once
    # for the whole scan, when they fit in 2 GB (else per evaluation)
    against, reference = kl_reference(trainer)
    references = reference_logits(trainer, ids, reference) if logits_fit(trainer, ids) else None
    grid, best = [], trained
    for k in range(int((trained - options.lowest) / options.step + 1e-9) + 1):
        candidate = trained - k * options.step
        measured = _measure(trainer, candidate, ids, references)
        grid.append({"gate_bias": candidate, **measured})
        log.info("calibration: gate bias %g: KL from %s %.4f, density %.4f", candidate, against, measured["kl"],
                 measured["density"])
        if measured["kl"] > options.max_kl:
            break
        best = candidate
    calibration = {"max_kl": options.max_kl, "kl_from": against, "sequences": len(ids), "grid": grid,
                   "over_budget": grid[0]["kl"] > options.max_kl}
    if calibration["over_budget"]:
        log.warning("calibration: the KL at the training gate bias %g is already %.4f, over max_kl %g: "
                    "the copy keeps that bias and is saved over its KL budget (summary.json: over_budget); "
                    "train longer or with a smaller KL slack, or raise calibrate_gate_bias.max_kl",
                    trained, grid[0]["kl"], options.max_kl)
    if options.per_layer.enabled and not calibration["over_budget"]:  # else nothing can go lower
        best, calibration["per_layer"] = calibrate_per_layer(trainer, ids, references, best, options)
    sparse.set_gate_bias(trainer.student, best)
    calibration["seconds"] = time.perf_counter() - started
    return best, calibration


def calibrate_per_layer(trainer: Trainer, ids: torch.Tensor, references: list | None,
                        start: float, options: Calibration) -> tuple[list[float], dict]:
    """Per-layer inference gate biases at or below the global b' ``start`` (not in the paper).

    Closing edges costs very different KL per layer (in a trained copy, layers 3-9 next to
    nothing, layer 0 a lot; docs/results.md), so one threshold for every layer spends the KL budget
    badly. Greedy, for up to ``rounds`` rounds: each candidate layer is lowered alone by
    ``step`` on the first ``sensitivity_sequences`` calibration sequences, the layers that close
    edges are ranked by KL added per edge closed, and the longest prefix of that ranking whose
    joint lowering keeps KL on all of ``ids`` <= ``max_kl`` is lowered (bisection, taking KL to
    grow with the prefix). The next round's candidates are the layers just lowered; no bias
    goes below ``lowest``.
    """
    per_layer = options.per_layer
    step, layers = per_layer.step, trainer.student.config.get_text_config().num_hidden_layers
    current, candidates, rounds = [start] * layers, list(range(layers)), []
    probe = ids[:per_layer.sensitivity_sequences]
    probe_references = None if references is None else _first_rows(references, len(probe),
                                                                    trainer.settings.batch_size)
    for _ in range(per_layer.rounds):
        candidates = [layer for layer in candidates if current[layer] - step >= options.lowest - 1e-9]
        if not candidates:
            break
        costs = _layer_costs(trainer, current, candidates, step, probe, probe_references)
        closing = [c for c in costs if c["density_removed"] > 0]
        ranking = [c["layer"] for c in sorted(closing, key=lambda c: c["kl_added"] / c["density_removed"])]
        accepted, measured, tried = _longest_prefix(trainer, current, ranking, step, ids, references,
                                                    options.max_kl)
        rounds.append({"costs": costs, "ranking": ranking, "tried": tried, "lowered": ranking[:accepted],
                       **(measured or {})})
        if not accepted:
            break
        current, candidates = _lowered(current, ranking[:accepted], step), ranking[:accepted]
        log.info("calibration per layer: lowered layers %s by %g: KL %.4f, density %.4f",
                 rounds[-1]["lowered"], step, measured["kl"], measured["density"])
    return current, {"step": step, "sensitivity_sequences": len(probe), "rounds": rounds,
                     "gate_bias": current}


def _first_rows(references: list[torch.Tensor], rows: int, batch: int) -> list[torch.Tensor]:
    """The dense logits of the first ``rows`` sequences, per evaluation batch, cut from the
    whole set's (reference_logits) rather than recomputed."""
    return list(torch.cat(references[:math.ceil(rows / batch)])[:rows].split(batch))


def _layer_costs(trainer, current, candidates, step, probe, probe_references) -> list[dict]:
    """Per candidate layer, the KL added and the density removed by lowering it alone by ``step``."""
    before = _measure(trainer, current, probe, probe_references)
    costs = []
    for layer in candidates:
        measured = _measure(trainer, _lowered(current, [layer], step), probe, probe_references)
        costs.append({"layer": layer, "kl_added": measured["kl"] - before["kl"],
                      "density_removed": before["density"] - measured["density"]})
    return costs


def _longest_prefix(trainer, current, ranking, step, ids, references, max_kl):
    """The largest n such that lowering ranking[:n] by ``step`` keeps KL <= max_kl (bisection),
    with its measurement, and every (n, KL, density) tried."""
    low, high, best, tried = 0, len(ranking), None, []
    while low < high:
        middle = (low + high + 1) // 2
        measured = _measure(trainer, _lowered(current, ranking[:middle], step), ids, references)
        tried.append({"layers": middle, **measured})
        if measured["kl"] <= max_kl:
            low, best = middle, measured
        else:
            high = middle - 1
    return low, best, tried


def _lowered(biases: list[float], layers: list[int], step: float) -> list[float]:
    return [b - step if layer in layers else b for layer, b in enumerate(biases)]


def _measure(trainer: Trainer, bias: sparse.GateBias, ids: torch.Tensor, references) -> dict:
    """KL (from kl_reference's model) and density of the student on ``ids`` with its gates at
    ``bias`` (its own bias after)."""
    with intervened(trainer.student, gate_bias=bias):
        return gated_kl(trainer, ids, references, kl_reference(trainer)[1])


def bias_columns(bias: sparse.GateBias) -> dict:
    """eval.csv's gate bias columns: a per-layer bias is NaN in ``gate_bias`` (numeric) and
    listed in ``gate_bias_per_layer``."""
    if isinstance(bias, list):
        return {"gate_bias": math.nan, "gate_bias_per_layer": " ".join(f"{b:g}" for b in bias)}
    return {"gate_bias": bias}
