"""tests/mutations.md stays appliable: every file it names exists, every ``before`` text occurs
exactly once in its file, and every test it names is defined (issue 67: the list had gone stale
when the library moved into packages)."""

import re
from pathlib import Path

import pytest

from run_mutations import BEFORE, ENTRY  # the list's format, read as make mutations reads it

ROOT = Path(__file__).resolve().parents[1]
TEST = re.compile(r"`(tests/[\w/]+\.py)?::(\w+)(?:\[[^\]]*\])?`")


def _entries() -> list[tuple[str, str, str]]:
    """(label, file, the entry's text) for each entry of tests/mutations.md."""
    text = (ROOT / "tests" / "mutations.md").read_text()
    starts = list(ENTRY.finditer(text))
    ends = [match.start() for match in starts[1:]] + [len(text)]
    return [(match.group(1), match.group(2), text[match.start():end]) for match, end in zip(starts, ends)]


ENTRIES = _entries()


def test_the_list_is_read_whole():
    """Every ``before`` and ``caught by`` line of the file falls inside an entry read here."""
    text = (ROOT / "tests" / "mutations.md").read_text()
    assert len(ENTRIES) >= 70
    assert sum(len(BEFORE.findall(body)) for _, _, body in ENTRIES) == len(BEFORE.findall(text))
    assert sum(body.count("- caught by:") for _, _, body in ENTRIES) == text.count("- caught by:")
    assert all(BEFORE.search(body) and "- after: `" in body for _, _, body in ENTRIES)


@pytest.mark.parametrize("label, path, body", ENTRIES, ids=[f"{label}:{path}" for label, path, _ in ENTRIES])
def test_each_entry_names_a_file_holding_its_before_text_once_and_tests_that_exist(label, path, body):
    source = ROOT / path
    assert source.is_file(), f"entry {label}: {path} does not exist (moved? update tests/mutations.md)"
    code = source.read_text()
    for before in BEFORE.findall(body):
        assert code.count(before) == 1, f"entry {label}: `{before}` occurs {code.count(before)} times in {path}"
    module = None
    for named_module, name in TEST.findall(body):
        module = named_module or module  # "and `::test_b`" continues the module named before it
        assert module is not None, f"entry {label}: `::{name}` follows no named test module"
        tests = (ROOT / module).read_text() if (ROOT / module).is_file() else ""
        assert re.search(rf"^def {name}\(", tests, re.MULTILINE), f"entry {label}: {module}::{name} is not defined"
