"""The house rules of the library's source, and of the tests, workflow scripts and benchmarks that
hold logic: no module over 400 lines, no function or method over 60 (from its ``def`` line to its
last, docstring included), so that each file is one concern and each function can be read at once.
And of the pages: benchmarks/ in a few packages with short READMEs, each page under its length,
and every path a page or the Makefile names there to open."""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY = REPO / "src" / "attnlab"
OTHERS = sorted(path for folder in ("tests", "workflow/scripts", "benchmarks") for path in (REPO / folder).rglob("*.py"))
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


# The rooms a newcomer opens first (issue 82): benchmarks/ in packages by concern, each with a
# short README of its current results; every page short enough to read; every path a page names
# there to open.
BENCHMARKS = REPO / "benchmarks"
BENCHMARK_EXTRAS = {"README.md", "results", "results-history.md"}  # beside the packages
NOT_COMMITTED = {"out", "__pycache__"}  # written by runs, ignored by git
MAX_BENCHMARK_PACKAGES = 6
MAX_BENCHMARK_README_LINES = 150
MAX_README_LINES, MAX_RESULTS_LINES, MAX_PAGE_LINES = 200, 300, 400


def benchmark_packages() -> list[Path]:
    return sorted(path for path in BENCHMARKS.iterdir() if path.is_dir() and path.name not in BENCHMARK_EXTRAS | NOT_COMMITTED)


def test_benchmarks_are_a_few_packages_each_with_a_short_readme():
    loose = sorted(path.name for path in BENCHMARKS.iterdir() if path.is_file() and path.name not in BENCHMARK_EXTRAS
                   and not path.name.startswith("results-history"))
    assert loose == [], "benchmarks/ holds packages by concern: move these into one"
    assert 0 < len(benchmark_packages()) <= MAX_BENCHMARK_PACKAGES
    for package in benchmark_packages():
        readme = package / "README.md"
        assert readme.is_file(), f"{package.name}/ has no README.md of its current results"
        assert len(readme.read_text().splitlines()) <= MAX_BENCHMARK_README_LINES, readme


def library_imports(path: Path) -> list[str]:
    """The modules ``path`` imports by absolute name, at its top or inside a function."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def test_benchmarks_import_only_down_into_the_library_their_own_package_and_the_shared_tools():
    """A benchmark reads attnlab, its own folder and benchmarks.tools (the shared harness); never
    another folder's script, the tests or the workflow's scripts, and attnlab never reads a benchmark."""
    wrong = []
    for path in BENCHMARKS.rglob("*.py"):
        own = f"benchmarks.{path.relative_to(BENCHMARKS).parts[0]}"
        for name in library_imports(path):
            if name.startswith("benchmarks.") and not name.startswith((own + ".", "benchmarks.tools.")):
                wrong.append(f"{path.relative_to(REPO)} imports {name}")
            if name.split(".")[0] in ("tests", "workflow", "conftest"):
                wrong.append(f"{path.relative_to(REPO)} imports {name}")
    for path in LIBRARY.rglob("*.py"):
        wrong += [f"{path.relative_to(REPO)} imports {name}" for name in library_imports(path)
                  if name.split(".")[0] == "benchmarks"]
    assert wrong == []


# Installed only in the peers' own virtualenvs (make bench-peers, make bench-edge-peers).
PEER_PACKAGES = {"transformer_lens", "nnsight", "auto_circuit"}


def unresolved_imports(paths) -> list[str]:
    """Every import of ``paths`` (inside functions too, which a module's import never runs) that
    names no standard-library module, installed package, peer package or module of this checkout."""
    import importlib.util
    import sys

    unresolved = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in ("benchmarks", "attnlab"):
                    parts = name.split(".")
                    root = REPO / "src" if top == "attnlab" else REPO
                    found = any((root / Path(*parts[:n])).with_suffix(".py").is_file() or (root / Path(*parts[:n])).is_dir()
                                for n in (len(parts), len(parts) - 1))
                else:
                    found = top in sys.stdlib_module_names | PEER_PACKAGES or importlib.util.find_spec(top) is not None
                if not found:
                    unresolved.append(f"{path.relative_to(REPO)}:{node.lineno} imports {name}")
    return unresolved


def test_every_import_of_a_benchmark_resolves_nested_ones_too():
    """A script renamed or moved leaves no import of its old name, even one that only runs on a GPU."""
    assert unresolved_imports(sorted(BENCHMARKS.rglob("*.py"))) == []


def doc_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(BENCHMARKS.glob("*.md")),
            *sorted(BENCHMARKS.glob("*/README.md"))]


def test_every_page_is_short_enough_to_read():
    limits = {REPO / "README.md": MAX_README_LINES, REPO / "docs" / "results.md": MAX_RESULTS_LINES}
    long = [f"{page.relative_to(REPO)}: {len(page.read_text().splitlines())} lines" for page in doc_pages()
            if len(page.read_text().splitlines()) > limits.get(page, MAX_PAGE_LINES)]
    assert long == []


def test_the_docs_index_lists_every_page():
    index = (REPO / "docs" / "README.md").read_text()
    assert [page.name for page in sorted((REPO / "docs").iterdir())
            if page.name != "README.md" and f"docs/{page.name}" not in index] == []


# A path a page names: under one of the checkout's folders, or a script run as python -m.
# Written by a run, not committed: benchmarks/out/, .ci/logs/ (results/ and resources/ are not
# matched). A name with a placeholder ({model}, <copy>, *) stands for many and is not checked.
FOLDERS = ("src", "tests", "workflow", "config", "docs", "benchmarks", "data", "profiles", "envs", ".ci")
NAMED_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./{}*<>\[\]-]*[\w*}>\]])" % "|".join(re.escape(f) for f in FOLDERS))
NAMED_MODULE = re.compile(r"(?<![\w./-])-m (benchmarks(?:\.\w+)+|attnlab(?:\.\w+)+)")
WRITTEN_BY_RUNS = ("benchmarks/out", ".ci/logs")


def named_paths(text: str) -> set[str]:
    paths = {match.group(1).rstrip(".") for match in NAMED_PATH.finditer(text)}
    paths = {path for path in paths if not set("{}*<>[]") & set(path) and not path.startswith(WRITTEN_BY_RUNS)}
    for match in NAMED_MODULE.finditer(text):
        module = match.group(1).replace(".", "/")
        paths.add(f"src/{module}.py" if module.startswith("attnlab") else f"{module}.py")
    return paths


def missing_paths(pages: list[Path]) -> list[str]:
    return sorted(f"{page.relative_to(REPO)} names {path}" for page in pages
                  for path in named_paths(page.read_text()) if not (REPO / path).exists())


def test_every_path_the_docs_and_the_makefile_name_exists():
    assert missing_paths([*doc_pages(), REPO / "Makefile"]) == []


NAMED_LIBRARY = re.compile(r"(?<![\w./-])attnlab(?:\.\w+)+(?![\w/-])")
FILE_SUFFIXES = ("yaml", "py", "md", "json", "txt")


def missing_modules(pages: list[Path]) -> list[str]:
    """Each ``attnlab.a.b.c`` a page names: a module or package of the library, or a name its
    parent module's text holds (only the last part may be an attribute; nothing is imported)."""
    missing = []
    for page in pages:
        for name in set(NAMED_LIBRARY.findall(page.read_text())):
            parts = name.split(".")
            if parts[-1] in FILE_SUFFIXES:
                continue  # a file such as envs/attnlab.yaml
            module = REPO / "src" / Path(*parts)
            if module.with_suffix(".py").is_file() or module.is_dir():
                continue
            holder = next((path for path in (module.parent.with_suffix(".py"), module.parent / "__init__.py")
                           if path.is_file()), None)
            if holder is None or not re.search(rf"\b{parts[-1]}\b", holder.read_text()):
                missing.append(f"{page.relative_to(REPO)} names {name}")
    return sorted(missing)


def test_every_library_module_the_docs_name_exists():
    assert missing_modules(doc_pages()) == []


def test_a_moved_path_is_found(tmp_path):
    page = REPO / "docs" / "a-page-written-by-this-test.md"
    page.write_text("Run `python -m benchmarks.tools.gone` on `docs/gone.md`; see `benchmarks/out/x.json`,"
                    " `results/tables/x.csv` and `docs/{stage}.md`; `docs/README.md` is here.\n")
    try:
        assert missing_paths([page]) == [f"docs/a-page-written-by-this-test.md names {path}"
                                         for path in ("benchmarks/tools/gone.py", "docs/gone.md")]
        page.write_text("`attnlab.config.cost` moved to `attnlab.cost.model`; `attnlab.cost.model.estimate`, "
                        "`envs/attnlab.yaml`.\n")
        assert missing_modules([page]) == ["docs/a-page-written-by-this-test.md names attnlab.config.cost"]
    finally:
        page.unlink()
