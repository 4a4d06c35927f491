"""tests/slowest.py reads a pytest log's --durations lines: where the suite's time went."""

from slowest import read_durations, report, wall_time

LOG = """tests/test_a.py ..                                                   [100%]
============================== slowest durations ===============================
120.50s setup    tests/test_a.py::test_one
3.25s call     tests/test_b.py::test_two[x-1]
0.75s call     tests/test_a.py::test_three
1.00s teardown tests/test_a.py::test_one
(12 durations < 0.5s hidden.)
========== 3 passed, 1 skipped, 2 warnings in 130.40s (0:02:10) ===========
"""


def test_every_duration_line_is_read_with_its_phase_and_test():
    assert read_durations(LOG) == [(120.5, "setup", "tests/test_a.py::test_one"),
                                   (3.25, "call", "tests/test_b.py::test_two[x-1]"),
                                   (0.75, "call", "tests/test_a.py::test_three"),
                                   (1.0, "teardown", "tests/test_a.py::test_one")]
    assert wall_time(LOG) == 130.4


def test_the_report_ranks_phases_and_sums_modules_and_phases():
    text = report(LOG, top=2)
    lines = text.splitlines()
    assert lines[1].split() == ["120.5", "s", "setup", "tests/test_a.py::test_one"]
    assert lines[2].split()[0] == "3.2" and len([line for line in lines if "::" in line]) == 2  # the top 2
    assert "   122.2 s  tests/test_a.py" in text and "     3.2 s  tests/test_b.py" in text
    assert "call 4 s, setup 120 s, teardown 1 s" in text
    assert text.endswith("sum of phases 126 s; pytest's wall time 130 s")
