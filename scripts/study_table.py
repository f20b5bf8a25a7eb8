"""Print a study's main README table, as markdown, from its results.csv.

A study folder (experiments/<study>/) keeps its numbers in results.csv: one row per run, method or
setting, with a `command` column that names what produced the row. table.json beside it says which
columns the README's main table shows, in order, and optionally which rows (`"where": {column: value}`,
or `{column: [value, ...]}` for any of several).
The README's table is this script's output pasted as is, so a table is regenerated, never typed;
tests/study/test_study_tables.py checks that the two agree.

    python scripts/study_table.py experiments/trees
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path

NUMERIC = re.compile(r"^[-+~<>]?[\d.]+(e-?\d+)?\s*(x|%|ms|s)?( \(.*\))?$|^-$")


def load(study: Path) -> tuple[list[str], list[dict[str, str]]]:
    """(the table's columns, its rows) from <study>/table.json and <study>/results.csv."""
    spec_path, csv_path = study / "table.json", study / "results.csv"
    for path in (spec_path, csv_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: a study keeps its numbers in results.csv and names "
                                    "its README table's columns in table.json ({\"columns\": [...]})")
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    with csv_path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        rows, header = list(reader), reader.fieldnames or []
    columns = spec["columns"]
    where = spec.get("where", {})
    missing = [c for c in [*columns, *where] if c not in header]
    if missing:
        raise KeyError(f"{csv_path}: no column {missing}; its columns are {header}. Fix table.json or the CSV.")
    rows = [r for r in rows if all(r[k] in (v if isinstance(v, list) else [v]) for k, v in where.items())]
    if not rows:
        raise ValueError(f"{csv_path}: no row matches {where}; the table would be empty")
    return columns, rows


def markdown(columns: list[str], rows: list[dict[str, str]]) -> str:
    """A markdown table; a column whose every cell reads as a number is right-aligned."""
    def align(c: str) -> str:
        return "---:" if all(NUMERIC.match(r[c].strip()) for r in rows) else "---"

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(align(c) for c in columns) + "|"]
    lines += ["| " + " | ".join(r[c] for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def table(study: str | Path) -> str:
    return markdown(*load(Path(study)))


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", help="a study folder, e.g. experiments/trees")
    text = table(parser.parse_args(argv).study)
    print(text)
    return text


if __name__ == "__main__":
    main()
