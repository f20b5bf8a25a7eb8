"""The study's module commands end a bad argument with one line on stderr and status 2, not a
traceback: `compare --out` naming a file, or a folder that cannot be made; `dashboard --check`
naming a run folder made without W&B, a path that does not exist, or a W&B run wandb cannot read."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec.study import compare, dashboard
from tests.study.test_compare import _summary, _write


@pytest.fixture
def run(tmp_path) -> Path:
    return _write(tmp_path / "run", _summary("ngram", 0.5, k=2))


def test_compare_out_naming_a_file_is_refused_before_anything_is_written(run, tmp_path, capsys):
    existing = tmp_path / "existing"
    existing.write_text("keep me")
    assert compare.main([str(run), "--out", str(existing)]) == 2
    assert f"--out {existing} is a file; --out takes a folder" in capsys.readouterr().err
    assert existing.read_text() == "keep me" and not (run / compare.CSV_NAME).exists()


def test_compare_out_below_a_file_says_it_cannot_write(run, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "tables"
    assert compare.main([str(run), "--out", str(out)]) == 2
    assert f"cannot write {out / compare.CSV_NAME} (Not a directory); choose another --out" in capsys.readouterr().err


def test_compare_out_folder_still_gets_the_csv(run, tmp_path):
    assert compare.main([str(run), "--out", str(tmp_path / "tables")]) == 0
    assert (tmp_path / "tables" / compare.CSV_NAME).is_file()


@pytest.mark.parametrize("make, message", [
    (lambda p: _write(p, _summary("ngram", 0.5, k=2)),
     "no W&B run here (a specdec run made without W&B: rerun it with logger=wandb, offline by default)"),
    (lambda p: None, "no such file or folder"),
    (lambda p: (p / "wandb" / "offline-run-1").mkdir(parents=True), "cannot read the W&B run"),
])
def test_dashboard_check_of_a_run_it_cannot_read_says_why(tmp_path, capsys, make, message):
    folder = tmp_path / "run"
    make(folder)
    argv = ["--project", "specdec", "--out", str(tmp_path / "workspace.json"), "--check", str(folder)]
    assert dashboard.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specdec.study.dashboard: --check {folder}") and message in err
    assert not (tmp_path / "workspace.json").exists()
