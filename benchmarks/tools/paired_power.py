"""Power of the paired accuracy test (McNemar's exact, two-sided) for the default's item count.

A paired design on n items, a condition against the baseline: each item is discordant with
probability psi (one condition right, the other wrong) and the difference in accuracy is
delta = P(treated only) - P(baseline only). The power is computed exactly, by enumerating the
number of discordant items and the split between the two directions (binomial), with scipy's
binomial test as the decision at level alpha; no simulation, no normal approximation.

psi comes from the default run (results/tables/accuracy_paired/arithmetic.csv): SmolLM2's
discordant share was 8/32 to 14/32 across conditions. Usage:

    python -m benchmarks.tools.paired_power            # the table docs/results.md quotes
"""

import argparse
import functools
import json

import numpy as np
from scipy import stats


@functools.lru_cache(maxsize=None)
def _rejects(discordant: int, alpha: float) -> np.ndarray:
    """For each treated-only count k in 0..discordant: does the exact test reject at alpha?"""
    return np.array([stats.binomtest(k, discordant, 0.5).pvalue <= alpha for k in range(discordant + 1)])


def power(n: int, delta: float, psi: float, alpha: float = 0.05) -> float:
    """P(reject) when P(discordant) = psi and P(treated only) - P(baseline only) = delta."""
    if not 0 < delta <= psi <= 1:
        raise ValueError(f"need 0 < delta <= psi <= 1, got delta={delta}, psi={psi}")
    treated_share = (psi + delta) / (2 * psi)  # P(treated only | discordant)
    total = 0.0
    for discordant in range(1, n + 1):
        k = np.arange(discordant + 1)
        split = stats.binom.pmf(k, discordant, treated_share)
        total += stats.binom.pmf(discordant, n, psi) * split[_rejects(discordant, alpha)].sum()
    return float(total)


def detectable(n: int, psi: float, target: float = 0.8, alpha: float = 0.05) -> float:
    """The smallest difference (step 0.005) detected with probability >= target."""
    for delta in np.arange(0.005, psi + 1e-9, 0.005):  # power grows with delta: the first hit
        if power(n, float(delta), psi, alpha) >= target:
            return float(round(delta, 3))
    return float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, nargs="+", default=[32, 48, 64, 96, 128, 192])
    parser.add_argument("--psi", type=float, nargs="+", default=[0.25, 0.44])
    parser.add_argument("--delta", type=float, default=0.15)
    parser.add_argument("--alpha", type=float, default=0.05)
    args = parser.parse_args()
    rows = [{"items": n, "psi": psi, "delta": args.delta, "alpha": args.alpha,
             "power": round(power(n, args.delta, psi, args.alpha), 3),
             "detectable_at_80pct": detectable(n, psi, alpha=args.alpha)}
            for psi in args.psi for n in args.items]
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
