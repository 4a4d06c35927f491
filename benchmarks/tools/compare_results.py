"""Compare two results/ folders file by file, for a change that must leave the numbers alone.

    python -m benchmarks.tools.compare_results BEFORE/results AFTER/results

Logs and Snakemake benchmark files are skipped. Files are compared byte for byte; an HDF5
file that differs in bytes is compared by its datasets and attributes (its ``versions``
attribute aside: the library versions that wrote it). Prints every file that differs and a
count per kind of file; exits 1 when any file differs or is in one folder only, else 0.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

SKIPPED = ("logs/", "benchmarks/")


@dataclass
class Comparison:
    only_in_first: list[Path] = field(default_factory=list)
    only_in_second: list[Path] = field(default_factory=list)
    different: list[str] = field(default_factory=list)  # one line per differing file, saying how
    kinds: dict[str, list[int]] = field(default_factory=dict)  # suffix -> [identical, different]

    @property
    def same(self) -> bool:
        return not (self.only_in_first or self.only_in_second or self.different)


def _files(folder: Path) -> set[Path]:
    return {p.relative_to(folder) for p in folder.rglob("*")
            if p.is_file() and not str(p.relative_to(folder)).startswith(SKIPPED)}


def h5_difference(first: Path, second: Path) -> str | None:
    """How two HDF5 files differ in datasets (names, values, NaN equal to NaN) or attributes
    (of the file, its groups and datasets; the file's ``versions`` aside), or None."""
    def items(f) -> dict[str, object]:
        found = {}
        f.visititems(lambda name, obj: found.__setitem__(name, obj))
        return found

    with h5py.File(first) as f, h5py.File(second) as g:
        f_items, g_items = items(f), items(g)
        if f_items.keys() != g_items.keys():
            return f"objects only in one file: {sorted(f_items.keys() ^ g_items.keys())}"
        datasets = [n for n, obj in f_items.items() if isinstance(obj, h5py.Dataset)]
        values = [n for n in datasets if not np.array_equal(f[n][()], g[n][()], equal_nan=True)]
        attrs = [f"/{k}" for k in set(f.attrs) | set(g.attrs)
                 if k != "versions" and str(f.attrs.get(k)) != str(g.attrs.get(k))]
        attrs += [f"{n}.{k}" for n in f_items for k in set(f[n].attrs) | set(g[n].attrs)
                  if str(f[n].attrs.get(k)) != str(g[n].attrs.get(k))]
    if values or attrs:
        return f"datasets differing: {sorted(values)}; attributes differing: {sorted(attrs)}"
    return None


def compare(first: Path, second: Path) -> Comparison:
    ours, theirs = _files(first), _files(second)
    result = Comparison(sorted(ours - theirs), sorted(theirs - ours))
    for rel in sorted(ours & theirs):
        difference = None
        if (first / rel).read_bytes() != (second / rel).read_bytes():
            difference = h5_difference(first / rel, second / rel) if rel.suffix == ".h5" else "bytes differ"
        if difference is not None:
            result.different.append(f"{rel}: {difference}")
        result.kinds.setdefault(rel.suffix, [0, 0])[difference is not None] += 1
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    result = compare(Path(args[0]), Path(args[1]))
    print("only in first:", [str(p) for p in result.only_in_first])
    print("only in second:", [str(p) for p in result.only_in_second])
    for line in result.different:
        print("DIFF", line)
    print({kind: f"{same} identical, {different} different" for kind, (same, different) in result.kinds.items()})
    return 0 if result.same else 1


if __name__ == "__main__":
    sys.exit(main())
