"""Check the numbers docs/results.md quotes against a results tree (yours or a fresh run's).

    python -m benchmarks.tools.check_quotes RESULTS_DIR [--section 1] [--quotes docs/results-quotes.yaml]

Each entry of docs/results-quotes.yaml is one quoted text (as it appears in docs/results.md), the
file under RESULTS_DIR that holds it, the row (CSV: column values) or keys (JSON: dotted paths),
and the digits the text rounds to (one for all, or one per number). The numbers of the text, in order, are compared with the file's
values rounded the same way; prints every quote that differs or whose file is missing, and exits 1
if any does. tests/test_claims.py checks that each quoted text is still in docs/results.md.
"""

import argparse
import json
import re
import sys
from pathlib import Path

import pandas as pd
import yaml

REPO = Path(__file__).resolve().parents[2]
NUMBER = re.compile(r"[−-]?\d+(?:,\d{3})*(?:\.\d+)?")


def quoted_numbers(text: str) -> list[float]:
    """The numbers of a quoted text, in order ("−6.8" and "1,576" read as -6.8 and 1576)."""
    return [float(found.replace("−", "-").replace(",", "")) for found in NUMBER.findall(text)]


def _csv_values(path: Path, quote: dict) -> list[float]:
    table = pd.read_csv(path)
    rows = table
    for column, value in quote["where"].items():
        rows = rows[rows[column].astype(str) == str(value)]
    if len(rows) != 1:
        raise LookupError(f"{len(rows)} rows of {path} match {quote['where']} (need exactly 1)")
    return [float(rows.iloc[0][column]) for column in quote["columns"]]


def _json_values(path: Path, quote: dict) -> list[float]:
    data = json.loads(path.read_text())
    values = []
    for dotted in quote["keys"]:
        node = data
        for part in dotted.split("."):
            node = node[int(part)] if isinstance(node, list) else node[part]
        values.append(float(node))
    return values


def file_values(results: Path, quote: dict) -> list[float]:
    path = results / quote["file"]
    read = _json_values if path.suffix == ".json" else _csv_values
    return [value * quote.get("scale", 1) for value in read(path, quote)]


def differences(results: Path, quotes: list[dict]) -> list[str]:
    """One line per quote that the results tree does not give back, rounded as quoted."""
    found = []
    for quote in quotes:
        where = f"§{quote['section']} {quote['text']!r} ({quote['file']})"
        try:
            values = file_values(results, quote)
        except (OSError, LookupError, KeyError, IndexError) as error:
            found.append(f"{where}: cannot read: {error}")
            continue
        wanted = quoted_numbers(quote["text"])
        digits = quote.get("digits", 1)
        digits = digits if isinstance(digits, list) else [digits] * len(values)
        got = [round(value, d) for value, d in zip(values, digits)]
        if len(got) != len(wanted) or any(abs(g - w) > 0.51 * 10 ** -d for g, w, d in zip(got, wanted, digits)):
            found.append(f"{where}: the tree gives {got}")
    return found


def load_quotes(path: Path, section: str | None = None) -> list[dict]:
    quotes = yaml.safe_load(path.read_text())
    return [q for q in quotes if section is None or str(q["section"]) == str(section)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a results/ folder")
    parser.add_argument("--section", help="only this section of docs/results.md (1, 5)")
    parser.add_argument("--quotes", type=Path, default=REPO / "docs" / "results-quotes.yaml")
    args = parser.parse_args()
    quotes = load_quotes(args.quotes, args.section)
    found = differences(args.results, quotes)
    for line in found:
        print(line)
    print(f"{len(quotes) - len(found)} of {len(quotes)} quoted numbers match {args.results}")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
