"""MIB's areas (CPR, CMD) over an explained-effect curve, against areas worked out by hand."""

import numpy as np
import pandas as pd
import pytest

from attnlab.circuits.areas import MIB_SHARES, AreaError, area_difference, curve_areas, grid_areas, mib_areas
from attnlab.config.plan import mib_sizes, with_mib_sizes
from attnlab.circuits.curves import resample_draws


def _rows(metrics: dict[int, list[float]]) -> pd.DataFrame:
    """Long per-prompt rows (heads_kept, prompt, metric) from {k: each prompt's metric}."""
    return pd.DataFrame([{"heads_kept": k, "prompt": p, "metric": m}
                         for k, values in metrics.items() for p, m in enumerate(values)])


def test_mib_sizes_are_the_floor_of_each_share_of_the_components():
    # MIB's evaluate_area_under_curve: int(pct * N) for N components
    assert mib_sizes(270) == [0, 0, 1, 2, 5, 13, 27, 54, 135, 270]
    assert mib_sizes(5644) == [5, 11, 28, 56, 112, 282, 564, 1128, 2822, 5644]
    assert with_mib_sizes([0, 10, 270], 270, True) == [0, 1, 2, 5, 10, 13, 27, 54, 135, 270]
    assert with_mib_sizes([0, 10, 270], 270, False) == [0, 10, 270]


def test_a_step_curve_by_hand():
    """1000 components; the effect is 0 up to 50 kept (5%) and 1 from 100 (10%) on: on MIB's
    shares the trapezoids are 0 up to 5%, (0.1 − 0.05) × (0 + 1) / 2 = 0.025 from 5% to 10%,
    and 1 × 0.9 after: CPR 0.925; |1 − f| gives 0.049 (0.1% to 5%) + 0.025: CMD 0.074."""
    n = 1000
    ks = np.array(sorted(set(mib_sizes(n)) | {0}))
    effects = np.where(ks >= 100, 1.0, 0.0)
    areas = mib_areas(ks, effects, n)
    assert areas["cpr"] == pytest.approx(0.925, abs=1e-12)
    assert areas["cmd"] == pytest.approx(0.049 + 0.025, abs=1e-12)
    # on the measured grid, x = k / n from 0: the same plus the sliver from 0 to 0.1% (f = 0 there)
    grid = grid_areas(ks, effects, n)
    assert grid["cpr"] == pytest.approx(0.925, abs=1e-12)
    assert grid["cmd"] == pytest.approx(0.05 + 0.025, abs=1e-12)


def test_a_linear_curve_by_hand():
    """f(p) = p: the trapezoid rule is exact on a line, so CPR = ∫ p dp over [0.001, 1] =
    (1 − 0.001²) / 2 and CMD = ∫ (1 − p) dp = 0.999 − CPR."""
    n = 1000
    ks = np.array(sorted(set(mib_sizes(n)) | {0}))
    effects = ks / n
    areas = mib_areas(ks, effects, n)
    assert areas["cpr"] == pytest.approx((1 - 0.001 ** 2) / 2, abs=1e-12)
    assert areas["cmd"] == pytest.approx(0.999 - (1 - 0.001 ** 2) / 2, abs=1e-12)
    assert grid_areas(ks, effects, n)["cpr"] == pytest.approx(0.5, abs=1e-12)


def test_an_overshooting_curve_counts_the_overshoot_in_its_cmd():
    """f = 0 below 50%, 1.5 at 50%, 1 at 100%: CPR = 0.3 × 1.5 / 2 + 0.5 × 2.5 / 2 = 0.85 (the
    overshoot adds to it); CMD counts |1 − 1.5| as much as a shortfall: 0.199 (0.1% to 20%, f = 0)
    + 0.3 × (1 + 0.5) / 2 + 0.5 × (0.5 + 0) / 2 = 0.774. A curve that stopped at 1 would have
    CMD 0.199 + 0.15 = 0.349."""
    n = 1000
    ks = np.array(sorted(set(mib_sizes(n)) | {0}))
    effects = np.select([ks == 1000, ks == 500], [1.0, 1.5], 0.0)
    areas = mib_areas(ks, effects, n)
    assert areas["cpr"] == pytest.approx(0.3 * 1.5 / 2 + 0.5 * 2.5 / 2, abs=1e-12)
    assert areas["cmd"] == pytest.approx(0.199 + 0.3 * 1.5 / 2 + 0.5 * 0.5 / 2, abs=1e-12)
    capped = mib_areas(ks, np.minimum(effects, 1.0), n)
    assert capped["cmd"] == pytest.approx(0.199 + 0.3 * 1.0 / 2, abs=1e-12)


def test_an_area_is_never_interpolated_over_a_size_not_measured():
    ks = np.array([0, 1, 2, 5, 13, 27, 54, 270])  # 135 (50% of 270) missing
    with pytest.raises(AreaError, match=r"\[135\] of 270 components.*pruning.mib_sizes"):
        mib_areas(ks, ks / 270, 270)
    with pytest.raises(AreaError, match="k = 0 and k = 270"):
        grid_areas(np.array([1, 270]), np.array([0.1, 1.0]), 270)
    # curve_areas says so and keeps the measured grid's areas
    rows = _rows({k: [k / 270, k / 270 + 0.01] for k in ks})
    out = curve_areas(rows, 270, resample_draws(2, 50, 0), 0.95)
    assert "135" in out["mib_missing"] and out["cpr_mib"] is None and out["cpr_discretisation"] is None
    assert out["cpr_grid"] == pytest.approx(0.5, abs=1e-12)


def test_curve_areas_point_interval_and_discretisation():
    """Two prompts whose metrics climb linearly with k at different slopes, normalised by their
    mean's m(0) and m(all): the point area is the mean curve's, the interval holds it, and the
    discretisation is |MIB's − the grid's|."""
    n = 20
    ks = sorted(set(mib_sizes(n)) | {0, 3, 7, 15})
    rows = _rows({k: [2 * k / n, (k / n) ** 2] for k in ks})
    out = curve_areas(rows, n, resample_draws(2, 200, 1), 0.95)
    mean = np.array([(2 * k / n + (k / n) ** 2) / 2 for k in ks])
    effects = (mean - mean[0]) / (mean[-1] - mean[0])
    x = np.array(ks) / n
    assert out["cpr_grid"] == pytest.approx(float(np.sum(np.diff(x) * (effects[1:] + effects[:-1]) / 2)), abs=1e-12)
    assert out["cpr_grid_low"] <= out["cpr_grid"] <= out["cpr_grid_high"]
    # the interval by hand: each resample's mean curve, normalised by its own ends, its trapezoid,
    # and the 2.5th and 97.5th order statistics of the 200 areas
    draws = resample_draws(2, 200, 1)
    matrix = np.array([[2 * k / n, (k / n) ** 2] for k in ks])
    by_hand = []
    for rows_drawn in draws:
        means = matrix[:, rows_drawn].mean(1)
        curve = (means - means[0]) / (means[-1] - means[0])
        by_hand.append(np.sum(np.diff(x) * (np.abs(1 - curve[1:]) + np.abs(1 - curve[:-1])) / 2))
    assert out["cmd_grid_low"] == pytest.approx(np.quantile(by_hand, 0.025, method="lower"), abs=1e-12)
    assert out["cmd_grid_high"] == pytest.approx(np.quantile(by_hand, 0.975, method="higher"), abs=1e-12)
    assert out["cpr_discretisation"] == pytest.approx(abs(out["cpr_mib"] - out["cpr_grid"]), abs=1e-15)
    assert out["points"] == len(ks) and out["components"] == n


def test_a_copy_identical_to_its_base_differs_by_exactly_zero():
    n = 270
    ks = sorted(set(mib_sizes(n)) | {0, 9, 100})
    rng = np.random.default_rng(0)
    rows = _rows({k: list(k / n + rng.normal(0, 0.2, 16)) for k in ks})
    draws = resample_draws(16, 300, 0)
    out = area_difference(rows, rows.copy(), (n, n), draws, draws, 0.95)
    for name in ("cpr", "cmd"):
        assert out[f"{name}_difference"] == 0
        assert out[f"{name}_difference_low"] == 0 and out[f"{name}_difference_high"] == 0


def test_a_difference_is_second_minus_first_and_paired_draws_narrow_it():
    """A copy whose every prompt's metric is its base's plus a curve-wide lift keeps the base's
    noise: paired resamples cancel it, independent ones do not."""
    n = 270
    ks = sorted(set(mib_sizes(n)) | {0})
    rng = np.random.default_rng(1)
    noise = rng.normal(0, 0.3, 24)
    base = _rows({k: list(k / n + noise * (k not in (0, n))) for k in ks})
    copy = _rows({k: list(min(1.0, 1.5 * k / n) + noise * (k not in (0, n))) for k in ks})
    draws = resample_draws(24, 400, 2)
    paired = area_difference(base, copy, (n, n), draws, draws, 0.95)
    assert paired["cpr_difference"] > 0  # the copy's curve lies above: second − first > 0
    independent = area_difference(base, copy, (n, n), draws, resample_draws(24, 400, 3), 0.95)
    assert (paired["cpr_difference_high"] - paired["cpr_difference_low"]
            < independent["cpr_difference_high"] - independent["cpr_difference_low"])
    assert paired["cpr_difference_low"] <= paired["cpr_difference"] <= paired["cpr_difference_high"]


def test_mib_shares_are_the_benchmarks():
    assert MIB_SHARES == (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class _CountingPatcher:
    """A stand-in patcher for ``steps.circuits._head_count``: the metric of each of 24 prompts
    climbs with the heads kept (a late climb, as real curves do), and every k measured is noted."""

    def __init__(self, n=270):
        self.measured, self.n = set(), n
        self.offsets = np.linspace(-0.2, 0.2, 24)

    def kept(self, order, k):
        return k

    def per_prompt(self, k):
        self.measured.add(k)
        values = (k / self.n) ** 0.5 + self.offsets * (0 < k < self.n)
        return float(values.mean()), values


@pytest.mark.parametrize("search", ["bisection", "rounds"])
def test_a_head_sweep_measures_every_mib_size(search):
    """With pruning.mib_sizes the sweep's grid holds MIB's sizes, whatever the search; without,
    it keeps its own points (make run's)."""
    from attnlab.circuits.counting import Bootstrap
    from attnlab.config.settings import Sweep
    from attnlab.steps.circuits import _head_count

    order = [(layer, head) for layer in range(30) for head in range(9)]
    measured = {}
    for enabled in (True, False):
        settings = Sweep(seed=0, ablation="corrupted", ranking="exact", sweep_other_ranking=False, mean_pool=None,
                         batch_size=8, device="cpu", all_k_up_to=10, log_points=12, search=search, coarse_points=6,
                         threshold=0.9, bootstrap={}, mib_sizes=enabled)
        patcher = _CountingPatcher()
        _head_count(patcher, order, settings, Bootstrap(100, 0.95, 0), list(range(24)), configured=True)
        measured[enabled] = patcher.measured
    assert set(mib_sizes(270)) <= measured[True]
    assert not set(mib_sizes(270)) <= measured[False]


@pytest.mark.parametrize("search", ["bisection", "rounds"])
def test_an_edge_sweep_measures_every_mib_size(search):
    from attnlab.circuits.counting import Bootstrap
    from attnlab.config.settings import EdgeSweep
    from attnlab.steps.edges import _swept_count

    n = 5644
    measured = {}
    for enabled in (True, False):
        settings = EdgeSweep(seed=0, steps=1, batch_size=8, score_chunk=None, cache_gb=None, device="cpu",
                             log_points=20, search=search, coarse_points=8, refine_points=4, interval_points=4,
                             n_counted=None, threshold=0.9, bootstrap={}, mib_sizes=enabled)
        patcher = _CountingPatcher(n)
        _swept_count(patcher, list(range(n)), settings, Bootstrap(100, 0.95, 0), list(range(24)))
        measured[enabled] = patcher.measured
    assert set(mib_sizes(n)) <= measured[True]
    assert not set(mib_sizes(n)) <= measured[False]


def test_circuit_areas_without_mibs_sizes_gives_the_grids_areas_and_says_why(tmp_path):
    """make run's sweeps keep their own points (pruning.mib_sizes: false): the tables keep MIB's
    columns, empty, with the reason, the grid's areas beside them, and the figure is drawn."""
    from attnlab import io, steps

    ks = [0, 3, 9, 30, 100, 270]  # no MIB size but 0 and 270
    inputs = {}
    for model, lift in (("a", 0.0), ("b", 0.1)):
        folder = tmp_path / model
        folder.mkdir()
        rows = _rows({k: [min(1.0, k / 100 + lift * (0 < k < 270)) + p / 10 * (k > 0) for p in range(3)] for k in ks})
        io.write_parquet(rows.assign(ranking="exact"), str(folder / "per_prompt.parquet"))
        means = rows.groupby("heads_kept")["metric"].mean()
        effect = (means - means[0]) / (means[270] - means[0])
        io.write_csv(pd.DataFrame({"heads_kept": ks, "explained_effect": effect.to_numpy(), "ranking": "exact"}),
                     str(folder / "sweep.csv"))
        io.write_json({"ranking": "exact", "heads": 270, "threshold": 0.9, "heads_to_reach_threshold": 100,
                       "heads_interval": [30, 270], "counted_prompts_digest": "same"}, str(folder / "sweep.json"))
        inputs[f"heads/{model}/ioi/corrupted"] = {"sweep": str(folder / "sweep.csv"), "per_prompt":
                                                 str(folder / "per_prompt.parquet"), "summary": str(folder / "sweep.json")}
    outputs = {"areas": str(tmp_path / "areas.csv"), "differences": str(tmp_path / "differences.csv"),
               "figures": {"corrupted": str(tmp_path / "tasks.png")}}
    steps.circuit_areas(inputs, [["a", "b"]], 0.9, {"n_resamples": 100, "confidence": 0.95, "seed": 0}, outputs, 60)
    areas, differences = pd.read_csv(outputs["areas"]), pd.read_csv(outputs["differences"])
    assert areas["cpr_mib"].isna().all() and areas["mib_missing"].str.contains("pruning.mib_sizes").all()
    assert areas["cpr_grid"].notna().all() and differences["cpr_grid_difference"].notna().all()
    assert differences["cpr_mib_difference"].isna().all() and (tmp_path / "tasks.png").stat().st_size > 10_000
