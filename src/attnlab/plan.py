"""Parse-time decisions of what runs and what is compared (pure standard library).

Snakemake imports this while it parses the workflow, so it must stay free of
torch and of anything heavy; unit tests reach it directly.
"""

from __future__ import annotations


def comparison_pairs(compare, models: list[str]) -> list[tuple[str, str]]:
    """``pruning.compare`` as (first, second) pairs: one pair, a list of pairs, or the first two models."""
    if not compare:
        return [tuple(models[:2])] if len(models) > 1 else []
    if isinstance(compare[0], str):
        return [tuple(compare)]
    return [tuple(pair) for pair in compare]
