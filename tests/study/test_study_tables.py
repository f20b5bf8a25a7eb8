"""Every study in experiments/ keeps a short README whose main table is scripts/study_table.py's output
from the study's results.csv: the table is regenerated from the numbers, never typed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[2]
STUDIES = sorted(p.parent for p in (ROOT / "experiments").glob("*/README.md"))
README_LINES = 80


def _tool():
    return load_script("study_table")


def test_there_are_studies():
    assert len(STUDIES) >= 7, STUDIES


@pytest.mark.parametrize("study", STUDIES, ids=[s.name for s in STUDIES])
def test_readme_table_is_the_tools_output(study: Path):
    readme = (study / "README.md").read_text(encoding="utf-8")
    printed = _tool().table(study)
    assert len(printed.splitlines()) >= 3, "a table with a header, an alignment row and at least one row"
    assert "\n" + printed + "\n" in readme, (
        f"{study.name}/README.md's table differs from `python scripts/study_table.py {study.relative_to(ROOT)}`; "
        "paste the script's output into the README")


@pytest.mark.parametrize("study", STUDIES, ids=[s.name for s in STUDIES])
def test_study_is_short_and_keeps_its_journal(study: Path):
    lines = (study / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_LINES, f"{study.name}/README.md has {len(lines)} lines; the journal goes to LOG.md"
    assert (study / "LOG.md").is_file()
    header = (study / "results.csv").read_text(encoding="utf-8").splitlines()[0].split(",")
    assert "command" in header, f"{study.name}/results.csv needs a `command` column naming what made each row"


def _study(tmp_path: Path, columns: list[str], csv_text: str, where: dict | None = None) -> Path:
    (tmp_path / "table.json").write_text(json.dumps({"columns": columns, **({"where": where} if where else {})}))
    (tmp_path / "results.csv").write_text(csv_text)
    return tmp_path


def test_tool_prints_the_chosen_columns_and_rows(tmp_path):
    study = _study(tmp_path, ["method", "speedup"], "method,speedup,table,command\nngram,1.43x,main,a\n"
                   "draft,0.87x,main,b\nngram,9.99x,other,c\n", where={"table": "main"})
    assert _tool().table(study) == "| method | speedup |\n|---|---:|\n| ngram | 1.43x |\n| draft | 0.87x |"
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "study_table.py"), str(study)],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == _tool().table(study)
    # a list: rows with any of its values
    several = _study(tmp_path, ["method"], "method,table,command\nngram,main,a\ndraft,aside,b\nsuffix,other,c\n",
                     where={"table": ["main", "other"]})
    assert _tool().table(several) == "| method |\n|---|\n| ngram |\n| suffix |"


def test_tool_says_what_is_wrong(tmp_path):
    study = _study(tmp_path, ["method", "tau"], "method,speedup,command\nngram,1.43x,a\n")
    with pytest.raises(KeyError, match="tau"):
        _tool().table(study)
    study = _study(tmp_path, ["method"], "method,table,command\nngram,main,a\n", where={"table": "other"})
    with pytest.raises(ValueError, match="no row"):
        _tool().table(study)
    (tmp_path / "table.json").unlink()
    with pytest.raises(FileNotFoundError, match="table.json"):
        _tool().table(study)
