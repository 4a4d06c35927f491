"""Apply every entry of tests/mutations.md, one at a time, in a scratch copy of the tree, run the
tests it names and list the mutations that no test caught (``make mutations``; not part of CI).

Each entry's ``before`` text is replaced by its ``after`` text in the scratch copy, its named tests
run there (``-x``: the first failure is enough), and the file is restored before the next entry.
An entry whose tests all pass *survived*: the tests no longer catch that bug. An entry whose ``before``
text is not found once is *stale*. "caught by: the same test" reuses the previous entry's tests.

    .venv/bin/python tests/run_mutations.py              # every entry
    .venv/bin/python tests/run_mutations.py 91 92 c      # these labels only

Two entries run at once by default (``--jobs``), each in a scratch copy of its own. Exit status: 0
when every entry applied was caught, 1 otherwise. The scratch copy's own tests import
its src/ (PYTHONPATH), so the repository's checkout is never edited.
"""

import argparse
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRY = re.compile(r"^(\d+|[a-z])\. `([^`]+)`", re.MULTILINE)
BEFORE = re.compile(r"^\s+- before: `(.*)`$", re.MULTILINE)
AFTER = re.compile(r"^\s+- after: `(.*)`$", re.MULTILINE)
TEST = re.compile(r"`(tests/[\w/]+\.py)?::(\w+(?:\[[^\]]*\])?)`")
COPIED = ("src", "tests", "workflow", "config", "profiles", "envs", "data", "benchmarks", "docs", "Snakefile",
          "pyproject.toml", "README.md", "Makefile")  # the pages and the Makefile: the house tests read them


@dataclass
class Mutation:
    label: str
    path: str
    before: str
    after: str
    tests: list[str]


def read_entries(text: str) -> list[Mutation]:
    """Every entry of tests/mutations.md, its tests resolved (a bare ``::name`` continues the module
    named before it; an entry naming none takes the previous entry's)."""
    starts = list(ENTRY.finditer(text))
    ends = [match.start() for match in starts[1:]] + [len(text)]
    entries, previous = [], []
    for match, end in zip(starts, ends):
        body = text[match.start():end]
        caught = body.split("- caught by:", 1)[1] if "- caught by:" in body else ""
        tests, module = [], None
        for named_module, name in TEST.findall(caught):
            module = named_module or module
            tests.append(f"{module}::{name}")
        tests = tests or previous
        entries.append(Mutation(match.group(1), match.group(2), BEFORE.search(body).group(1),
                                AFTER.search(body).group(1), tests))
        previous = tests
    return entries


def scratch_copy(target: Path) -> Path:
    """The tree's files the tests read, copied (uncommitted edits included)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".pytest_cache", "out")
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, target / name, ignore=ignore)
        else:
            shutil.copy(source, target / name)
    return target


def run_one(mutation: Mutation, scratch: Path, timeout: int) -> tuple[str, float, str]:
    """(verdict, seconds, the tests' last lines): caught, survived, stale or timed out."""
    source = scratch / mutation.path
    original = source.read_text()
    if original.count(mutation.before) != 1:
        return "stale", 0.0, f"`{mutation.before}` occurs {original.count(mutation.before)} times"
    source.write_text(original.replace(mutation.before, mutation.after))
    environment = {**os.environ, "PYTHONPATH": f"{scratch / 'src'}{os.pathsep}{scratch / 'tests'}"}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutation.tests]
    started = time.monotonic()
    try:
        result = subprocess.run(command, cwd=scratch, env=environment, capture_output=True, text=True,
                                timeout=timeout)
        tail = "\n".join(result.stdout.strip().splitlines()[-3:])
        # exit 1: a test failed; 2: the mutated code broke collection (caught, said apart: an
        # entry whose "after" text cannot even import checks less than it seems); 0: every test
        # passed (survived); 4 or 5: a named test is missing, an error of the list itself
        verdict = {0: "survived", 1: "caught", 2: "caught (collection)"}.get(result.returncode,
                                                               f"error (pytest exit {result.returncode})")
    except subprocess.TimeoutExpired:
        verdict, tail = "timed out", f"after {timeout} s"
    finally:
        source.write_text(original)
    return verdict, time.monotonic() - started, tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("labels", nargs="*", help="entry labels to run (default: every entry)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per entry's tests")
    parser.add_argument("--jobs", type=int, default=2, help="entries run at once, each in its own scratch copy")
    args = parser.parse_args()
    entries = read_entries((ROOT / "tests" / "mutations.md").read_text())
    if args.labels:
        unknown = set(args.labels) - {entry.label for entry in entries}
        if unknown:
            parser.error(f"no entry labelled {sorted(unknown)} in tests/mutations.md")
        entries = [entry for entry in entries if entry.label in args.labels]
    # Converted models are shared by every entry's run (attnlab.conversion_cache).
    os.environ.setdefault("ATTNLAB_MODEL_CACHE", str(Path(tempfile.gettempdir()) / "attnlab-model-cache"))
    failed = []
    with tempfile.TemporaryDirectory(prefix="attnlab-mutations-") as folder:
        # one scratch copy per worker: an entry's edit is seen by its own tests alone
        scratches = queue.Queue()
        for worker in range(args.jobs):
            scratches.put(scratch_copy(Path(folder) / str(worker)))

        def run(entry):
            scratch = scratches.get()
            try:
                return entry, *run_one(entry, scratch, args.timeout)
            finally:
                scratches.put(scratch)
        with ThreadPoolExecutor(args.jobs) as pool:
            for entry, verdict, seconds, tail in pool.map(run, entries):
                print(f"{entry.label:>4}  {verdict:<10} {seconds:6.0f} s  {entry.path}", flush=True)
                if not verdict.startswith("caught"):
                    failed.append(entry.label)
                    print("      " + tail.replace("\n", "\n      "), flush=True)
    print(f"{len(entries) - len(failed)} of {len(entries)} caught" +
          (f"; not caught: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
