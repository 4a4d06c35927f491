"""Imports point down: no module of the library imports, directly or through others, a module
that imports it back (nested imports inside functions included)."""

import ast
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "src" / "attnlab"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in LIBRARY.rglob("*.py"):
        parts = list(path.relative_to(LIBRARY.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module -> the library modules it imports (``from package import module`` is the module)."""
    modules = _modules()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[name] |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    graph[name].add(target if target in modules else node.module)
        graph[name].discard(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first search meets, as the path that closes it."""
    state, path, found = {}, [], []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[node] = "done"
    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_library_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_intervention_parts_sit_below_the_context_that_composes_them():
    graph = import_graph()
    assert "attnlab.interventions" in graph["attnlab.patching.heads"]
    for part in ("attnlab.attention.sparse", "attnlab.interventions.mlp", "attnlab.attention.reduction", "attnlab.interventions.resume", "attnlab.interventions.readout",
                 "attnlab.interventions.edges"):
        assert part in graph["attnlab.interventions"]
        assert "attnlab.interventions" not in graph[part]


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_the_parts_below_the_context_never_import_it():
    """sparse, mlp, models, the attention function and edges (every module of the package) sit below
    attnlab.interventions: not even a nested import of it."""
    graph = import_graph()
    edges = [name for name in graph if name.startswith("attnlab.interventions.edges")]
    assert "attnlab.interventions.edges.patch" in edges  # the package's modules are seen
    for lower in ("attnlab.attention.sparse", "attnlab.interventions.mlp", "attnlab.models", "attnlab.attention.function", *edges):
        assert "attnlab.interventions" not in graph[lower], lower
