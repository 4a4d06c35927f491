"""Accuracy's intervals and the paired comparison with the plain prompt (attnlab.reasoning.paired), against
published values and hand-computed tables."""

import math
from statistics import NormalDist

import numpy as np
import pandas as pd
import pytest

from attnlab.reasoning.paired import PairedTable, holm, mcnemar_exact, newcombe_paired, paired_rows, wilson


def test_wilson_ends_against_published_values():
    """0 of 6 and 500 of 1,000 at 95% (Wilson 1927; e.g. Brown, Cai & DasGupta 2001, Newcombe 1998's
    examples): [0, 0.3903] and [0.4691, 0.5309]; never [0, 0] at zero correct."""
    assert wilson(0, 6) == pytest.approx((0.0, 0.3903), abs=1e-4)
    assert wilson(500, 1000) == pytest.approx((0.4691, 0.5309), abs=1e-4)
    assert wilson(6, 6) == pytest.approx((0.6097, 1.0), abs=1e-4)
    assert wilson(0, 6, 0.90)[1] == pytest.approx(0.3108, abs=1e-4)  # another level, another end


def _wilson_by_hand(k: int, n: int, z: float = NormalDist().inv_cdf(0.975)) -> tuple[float, float]:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


def test_the_paired_interval_and_test_on_a_hand_computed_table():
    """32 items: 3 correct under both, 8 under the treated condition only, 2 under the baseline
    only, 19 under neither. Difference (8 − 2)/32 = 18.75 points; Newcombe's method 10 from the
    Wilson intervals of 11/32 and 5/32 and the pairs' φ, each written out here; McNemar's exact p
    = 2 · P(X ≤ 2), X ~ Binomial(10, 1/2) = 2 · 56/1024."""
    table = PairedTable(both=3, treated_only=8, baseline_only=2, neither=19)
    (l1, u1), (l2, u2) = _wilson_by_hand(11, 32), _wilson_by_hand(5, 32)
    p1, p2 = 11 / 32, 5 / 32
    phi = (3 * 19 - 8 * 2) / math.sqrt(11 * 21 * 5 * 27)
    low = (p1 - p2) - math.sqrt((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2)
    high = (p1 - p2) + math.sqrt((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2)
    assert newcombe_paired(table) == pytest.approx((0.1875, low, high), abs=1e-9)
    assert mcnemar_exact(table) == pytest.approx(2 * (1 + 10 + 45) / 1024, abs=1e-12)
    assert mcnemar_exact(PairedTable(5, 0, 0, 5)) == 1.0  # no discordant pair: no evidence
    # identical conditions: a difference of 0 whose interval holds 0, however many items
    same = newcombe_paired(PairedTable(10, 0, 0, 22))
    assert same[0] == 0 and same[1] < 0 < same[2]


def test_holm_adjusts_step_down():
    assert holm([0.01, 0.04, 0.03, 0.2]).tolist() == pytest.approx([0.04, 0.09, 0.09, 0.2])
    assert holm([0.5, 0.9]).tolist() == pytest.approx([1.0, 1.0])


def test_paired_rows_pair_items_by_id_and_adjust_per_grader():
    rng = np.random.default_rng(0)
    ids = [f"i{k}" for k in range(20)]
    baseline = pd.DataFrame({"id": ids, "math_verify": rng.integers(0, 2, 20), "lenient": 1})
    treated = baseline.sample(frac=1.0, random_state=1).copy()  # another order: matched by id
    treated["math_verify"] = 1
    rows = paired_rows({"none": baseline, "mless": treated, "mful": baseline.copy()}, "none",
                       ("math_verify", "lenient"))
    mless = rows[(rows["condition"] == "mless") & (rows["grader"] == "math_verify")].iloc[0]
    wrong_before = int((baseline["math_verify"] == 0).sum())
    assert (mless["treated_only"], mless["baseline_only"]) == (wrong_before, 0)
    assert mless["difference_pts"] == pytest.approx(100 * wrong_before / 20)
    mful = rows[(rows["condition"] == "mful") & (rows["grader"] == "math_verify")].iloc[0]
    assert mful["difference_pts"] == 0 and mful["mcnemar_p"] == 1.0
    family = rows[rows["grader"] == "math_verify"]
    assert family["holm_p"].tolist() == pytest.approx(holm(family["mcnemar_p"]).tolist())
