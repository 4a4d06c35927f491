"""The house rules of the library's source, and of the tests, workflow scripts and benchmarks that
hold logic: no module over 400 lines, no function or method over 60 (from its ``def`` line to its
last, docstring included), so that each file is one concern and each function can be read at once."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "src" / "attnlab"
# The two peer workers run inside the peer tools' own virtualenvs (make bench-peers,
# make bench-edge-peers), which a change here cannot run to check a split; they still break the
# rules (peers_worker.py 510 lines, its scoring_transformerlens 75; autocircuit_worker.py's main 126).
NOT_YET = {REPO / "benchmarks" / "peers" / "heads_worker.py", REPO / "benchmarks" / "peers" / "edges_worker.py"}
OTHERS = sorted(path for folder in ("tests", "workflow/scripts", "benchmarks")
                for path in (REPO / folder).rglob("*.py") if path not in NOT_YET)
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def too_long(path: Path) -> list[str]:
    """What in ``path`` breaks the rules: the module's length, each function's that does."""
    text = path.read_text()
    found = []
    if len(text.splitlines()) > MAX_MODULE_LINES:
        found.append(f"{path}: {len(text.splitlines())} lines")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1  # lineno: the def line, after any decorator
            if length > MAX_FUNCTION_LINES:
                found.append(f"{path}:{node.lineno} {node.name}: {length} lines")
    return found


@pytest.mark.parametrize("path", sorted(LIBRARY.rglob("*.py")), ids=lambda path: str(path.relative_to(LIBRARY)))
def test_modules_and_functions_stay_short(path):
    assert too_long(path) == []


@pytest.mark.parametrize("path", OTHERS, ids=lambda path: str(path.relative_to(REPO)))
def test_tests_scripts_and_benchmarks_stay_short(path):
    assert too_long(path) == []


def test_the_rules_catch_a_long_function_and_a_long_module(tmp_path):
    def function(lines: int) -> str:
        """A function of ``lines`` lines: its def line and lines − 1 of body."""
        return "def f():\n" + "".join(f"    x = {i}\n" for i in range(lines - 1))

    long_function, short_function, long_module = (tmp_path / name for name in ("long.py", "short.py", "module.py"))
    long_function.write_text(function(MAX_FUNCTION_LINES + 1))
    short_function.write_text(function(MAX_FUNCTION_LINES))
    long_module.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert too_long(long_function) == [f"{long_function}:1 f: {MAX_FUNCTION_LINES + 1} lines"]
    assert too_long(short_function) == []
    assert too_long(long_module) == [f"{long_module}: {MAX_MODULE_LINES + 1} lines"]
