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


def selected(names: list[str] | None, everything: list[str]) -> list[str]:
    """A configured selection (``attention.datasets``, ``pruning.models``): null means all,
    an empty list none."""
    return list(everything) if names is None else list(names)


def family(spec: dict) -> str | None:
    """What a condition inserts, regardless of length and placement; None when nothing.

    A text is named by its start and a hash of the whole, so two texts that share
    their first characters stay apart.
    """
    if spec["kind"] == "none" or spec.get("length", 0) == 0:
        return None
    if spec["kind"] == "repeat":
        return f"repeat '{spec['unit']}'"
    text = spec.get("text")
    if text is None:
        return "text: default"
    import hashlib

    short = text if len(text) <= 24 else f"{text[:24]}… #{hashlib.sha1(text.encode()).hexdigest()[:6]}"
    return f"text: {short}"


def is_plain(spec: dict) -> bool:
    """Nothing inserted and no ARM: the reference every sweep starts from."""
    return family(spec) is None and not spec["arm"]


def length_families(conditions: dict) -> dict[str, str | None]:
    """Conditions of the length sweep (default placement, no ARM; plain ones are length 0) -> family."""
    return {name: family(spec) for name, spec in conditions.items()
            if spec["placement"] == "between" and not spec["arm"] or is_plain(spec)}


def has_length_sweep(families: dict[str, str | None]) -> bool:
    """Some inserted family is configured at two or more lengths."""
    values = list(families.values())
    return any(values.count(f) > 1 for f in set(values) - {None})


def placements(conditions: dict) -> dict[str, dict]:
    """Every non-ARM condition with its family, length and placement ('none' when nothing is inserted)."""
    return {name: {"family": family(spec), "length": spec.get("length", 0),
                   "placement": spec["placement"] if family(spec) else "none"}
            for name, spec in conditions.items() if not spec["arm"]}


def has_placement_sweep(placements_: dict[str, dict]) -> bool:
    """Some insertion sits away from the default placement."""
    return any(p["placement"] not in ("between", "none") for p in placements_.values())
