"""benchmarks/tools/compare_results.py, imported as a module (issue 67: it read sys.argv at import)."""

import importlib.util
import sys
from pathlib import Path

import h5py
import numpy as np

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "tools" / "compare_results.py"


def _module():
    spec = importlib.util.spec_from_file_location("compare_results", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _h5(path: Path, values, versions: str, unit: str = "nats") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        f.attrs["versions"] = versions
        f.create_dataset("layer_0/received", data=np.asarray(values, dtype=float)).attrs["unit"] = unit


def test_two_folders_compared_file_by_file(tmp_path, capsys):
    compare_results = _module()
    first, second = tmp_path / "a", tmp_path / "b"
    for folder, versions in ((first, "torch 2.13"), (second, "torch 2.11")):
        (folder / "logs").mkdir(parents=True)
        (folder / "logs" / "job.log").write_text(str(folder))  # logs differ and are skipped
        (folder / "table.csv").write_text("x,y\n1,2\n")
        _h5(folder / "same.h5", [1.0, np.nan], versions)  # other bytes, the same data
    _h5(first / "moved.h5", [1.0, 2.0], "v")
    _h5(second / "moved.h5", [1.0, 2.5], "v")
    _h5(first / "relabelled.h5", [1.0], "v")
    _h5(second / "relabelled.h5", [1.0], "v", unit="bits")
    (first / "only_here.json").write_text("{}")
    result = compare_results.compare(first, second)
    assert result.only_in_first == [Path("only_here.json")] and result.only_in_second == []
    assert result.different == ["moved.h5: datasets differing: ['layer_0/received']; attributes differing: []",
                                "relabelled.h5: datasets differing: []; attributes differing: ['layer_0/received.unit']"]
    assert result.kinds == {".csv": [1, 0], ".h5": [1, 2]}
    assert compare_results.main([str(first), str(second)]) == 1
    assert "DIFF moved.h5" in capsys.readouterr().out
    assert compare_results.main([str(first), str(first)]) == 0
    assert compare_results.main([str(first)]) == 2
