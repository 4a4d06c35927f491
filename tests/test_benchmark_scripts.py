"""benchmarks/ as packages (issue 82): every script imports as ``benchmarks.<folder>.<script>`` from
the checkout's root, as ``python -m`` runs it, and the shell scripts find the checkout from where
they sit."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# auto-circuit's worker imports auto_circuit and TransformerLens 3 at its top: they live in
# .venv-autocircuit only (make bench-edge-peers runs it there).
PEER_ONLY = {"benchmarks.peers.edges_worker"}


def benchmark_modules() -> list[str]:
    return sorted(".".join(path.relative_to(REPO).with_suffix("").parts)
                  for path in (REPO / "benchmarks").rglob("*.py") if "results" not in path.parts)


def test_every_benchmark_imports_as_a_module_of_its_folder():
    modules = [module for module in benchmark_modules() if module not in PEER_ONLY]
    assert "benchmarks.gpu.node" in modules and "benchmarks.tools.harness" in modules
    probe = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\nprint('ok')"
    finished = subprocess.run([sys.executable, "-c", probe, *modules], cwd=REPO, capture_output=True, text=True,
                              timeout=300)
    assert finished.returncode == 0 and finished.stdout.strip() == "ok", finished.stderr[-3000:]


def test_the_end_to_end_script_finds_the_checkout_two_folders_up(tmp_path):
    """Run from elsewhere with --help (snakemake prints its help twice and runs nothing): the
    script reaches the checkout's snakemake and writes its JSON into benchmarks/out/."""
    out = REPO / "benchmarks" / "out" / "end_to_end.json"
    out.unlink(missing_ok=True)
    env = {**os.environ, "SNAKEMAKE": str(Path(sys.executable).parent / "snakemake")}  # this environment's
    finished = subprocess.run(["bash", str(REPO / "benchmarks" / "throughput" / "end_to_end.sh"), "--help"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert json.loads(out.read_text())["second_run_jobs"] == 0
