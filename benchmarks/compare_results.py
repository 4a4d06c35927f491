"""Compare two results/ folders file by file, for a change that must leave the numbers alone.

    python benchmarks/compare_results.py BEFORE/results AFTER/results

Logs and Snakemake benchmark files are skipped. Files are compared byte for byte; an HDF5
file that differs in bytes is compared by its datasets and attributes (its ``versions``
attribute aside). Prints every file that differs and a count per kind of file.
"""
import sys
from pathlib import Path

import h5py
import numpy as np

a, b = Path(sys.argv[1]), Path(sys.argv[2])
skip = ("logs/", "benchmarks/")
files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file() and not str(p.relative_to(a)).startswith(skip))
other = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file() and not str(p.relative_to(b)).startswith(skip))
print("only in first:", sorted(set(files) - set(other)), "only in second:", sorted(set(other) - set(files)))
kinds = {}
for rel in files:
    if rel not in set(other):
        continue
    x, y = (a / rel).read_bytes(), (b / rel).read_bytes()
    kind = rel.suffix
    same = x == y
    if not same and kind == ".h5":
        with h5py.File(a / rel) as f, h5py.File(b / rel) as g:
            names = []
            f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
            data_same = all(np.array_equal(f[n][()], g[n][()], equal_nan=True) for n in names)
            attrs = {k for k in set(f.attrs) | set(g.attrs) if k != "versions" and str(f.attrs.get(k)) != str(g.attrs.get(k))}
            same = data_same and not attrs
            if not same:
                print("H5 DIFF", rel, "datasets equal:", data_same, "attrs differing:", attrs)
    if not same and kind != ".h5":
        print("DIFF", rel)
    kinds.setdefault(kind, [0, 0])[0 if same else 1] += 1
print({k: f"{v[0]} identical, {v[1]} different" for k, v in kinds.items()})
