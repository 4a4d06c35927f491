"""The library's layering (docs/pipeline.md, "The library's layout"): every import of one library
module by another, at the top or inside a function, points to the same layer or a lower one."""

from test_imports import import_graph

# bottom first; a module's layer is its longest prefix's here
LAYERS = (
    ("parse time, no torch", ("attnlab.config", "attnlab.cost", "attnlab.anatomy.families")),
    ("base", ("attnlab.io", "attnlab.anatomy", "attnlab.tokenization")),
    ("attention and models", ("attnlab.attention", "attnlab.models", "attnlab.conversion_cache", "attnlab.released")),
    ("interventions", ("attnlab.interventions",)),
    ("the patching engine", ("attnlab.patching",)),
    ("reasoning", ("attnlab.reasoning",)),
    ("extraction", ("attnlab.extraction",)),
    ("circuits", ("attnlab.circuits",)),
    ("mechanism", ("attnlab.mechanism",)),
    ("sparse post-training", ("attnlab.sparsify",)),
    ("ground truth", ("attnlab.groundtruth",)),
    ("plots", ("attnlab.plots",)),
    ("steps", ("attnlab.steps",)),
)


def layer_of(module: str) -> int:
    """The index in LAYERS of ``module``'s longest matching prefix (``attnlab`` itself: the top)."""
    best, found = -1, len(LAYERS)
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} -> {target} ({LAYERS[layer_of(module)][0]} imports {LAYERS[layer_of(target)][0]})"
                  for module, targets in graph.items() for target in targets
                  if module != "attnlab" and layer_of(target) > layer_of(module))


def test_every_import_points_to_the_same_layer_or_below():
    assert upward_imports(import_graph()) == []


def test_every_module_has_a_stated_layer_and_every_layer_modules():
    graph = import_graph()
    assert [module for module in graph if module != "attnlab" and layer_of(module) == len(LAYERS)] == []
    assert {layer_of(module) for module in graph if module != "attnlab"} == set(range(len(LAYERS)))


def test_an_upward_import_is_found():
    graph = {"attnlab.config.plan": {"attnlab.steps.circuits"}, "attnlab.steps.circuits": {"attnlab.config.plan"}}
    assert upward_imports(graph) == ["attnlab.config.plan -> attnlab.steps.circuits (parse time, no torch imports steps)"]


def test_the_cost_model_sits_above_the_config_and_neither_imports_torch():
    """attnlab.cost reads the config's checks and plan; the config never reads the cost model (the
    schema, validation and plan stand without it). Snakemake imports both while it parses, so
    neither may reach torch, directly or through another module."""
    import subprocess
    import sys

    graph = import_graph()
    assert not [(module, target) for module, targets in graph.items() if module.startswith("attnlab.config")
                for target in targets if target.startswith("attnlab.cost")]
    assert any(target.startswith("attnlab.config") for target in graph["attnlab.cost.requests"])
    modules = sorted(module for module in graph if module.startswith(("attnlab.cost", "attnlab.config")))
    probe = f"import sys; import {', '.join(modules)}; print('torch' in sys.modules)"
    finished = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert finished.stdout.strip() == "False"
