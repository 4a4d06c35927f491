"""Where the test suite's time goes, read from a pytest log that has ``--durations`` lines (CI's:
``.ci/run`` writes ``.ci/logs/pytest-*.log`` with every duration; the committed profile:
``tests/durations.txt``).

    .venv/bin/python tests/slowest.py                      # the latest log in .ci/logs/
    .venv/bin/python tests/slowest.py LOG --top 30

Prints the top N phases (a test's setup holds the session fixtures it was first to need: a
workflow run, a model conversion), then the seconds per module and per phase, and the sum beside
the run's wall time (the difference: collection, and time pytest does not attribute to a test).
"""

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / ".ci" / "logs"
DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S.*)$")
WALL = re.compile(r"=+ .* in (\d+(?:\.\d+)?)s(?: \([^)]*\))? =+$")


def read_durations(text: str) -> list[tuple[float, str, str]]:
    """(seconds, phase, test id) for each ``--durations`` line."""
    return [(float(m.group(1)), m.group(2), m.group(3).strip()) for m in map(DURATION.match, text.splitlines()) if m]


def wall_time(text: str) -> float | None:
    """The run's own total (pytest's last line: '... in 1234.56s (0:20:34)')."""
    found = [float(m.group(1)) for m in map(WALL.match, text.splitlines()) if m]
    return found[-1] if found else None


def latest_log() -> Path:
    logs = sorted(LOGS.glob("pytest-*.log"), key=lambda path: path.stat().st_mtime)
    if not logs:
        sys.exit(f"no log in {LOGS}: run .ci/run (or make test with PYTEST_ADDOPTS='--durations=0'), "
                 "or name a log file")
    return logs[-1]


def report(text: str, top: int) -> str:
    rows = read_durations(text)
    if not rows:
        return "no --durations lines in this log (pytest ran without --durations=0?)"
    lines = [f"top {top} of {len(rows)} phases:"]
    lines += [f"{seconds:8.1f} s  {phase:<8} {test}" for seconds, phase, test in sorted(rows, reverse=True)[:top]]
    modules, phases = defaultdict(float), defaultdict(float)
    for seconds, phase, test in rows:
        modules[test.split("::")[0]] += seconds
        phases[phase] += seconds
    lines.append("\nby module:")
    lines += [f"{seconds:8.1f} s  {module}" for module, seconds in sorted(modules.items(), key=lambda x: -x[1])]
    total, wall = sum(phases.values()), wall_time(text)
    lines.append("\nby phase: " + ", ".join(f"{phase} {seconds:.0f} s" for phase, seconds in sorted(phases.items())))
    lines.append(f"sum of phases {total:.0f} s" + (f"; pytest's wall time {wall:.0f} s" if wall else ""))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", nargs="?", type=Path, help="a pytest log (default: the latest in .ci/logs/)")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    print(report((args.log or latest_log()).read_text(errors="replace"), args.top))


if __name__ == "__main__":
    main()
