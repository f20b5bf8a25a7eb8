"""A run never overwrites or shares another run's folder: default folders differ within a second, a
folder holding another run or sweep is refused before Hydra writes a byte into it (checked through the
real command line), claims are exclusive, a sweep's jobs get a folder each, and the Python API refuses
a folder that holds results."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specdec.study import experiment
from specdec.study.run_dirs import FolderInUseError, check_sweep_subdir, claim_run_dir, claim_sweep_dir

REPO = Path(__file__).resolve().parents[2]
TINY = ["experiment=tiny_smoke", "data.limit=1", "data.categories=[qa]", "generation.max_new_tokens=2",
        "warmup=false", "plots=false", "threads=1"]


def _specdec(cwd: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, "-m", "specdec", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_default_folders_differ_within_one_second(monkeypatch):
    import hydra.core.utils

    class Clock(dt.datetime):
        microsecond_now = 0

        @classmethod
        def now(cls, tz=None):
            return dt.datetime(2026, 1, 2, 3, 4, 5, cls.microsecond_now)

    monkeypatch.setattr(hydra.core.utils, "datetime", Clock)  # what Hydra's ${now:} resolver reads
    folders = []
    for start in (100, 200):  # two runs started 100 microseconds apart
        Clock.microsecond_now = start
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose("config", return_hydra_config=True)
        folders.append((cfg.hydra.run.dir, cfg.hydra.sweep.dir))
    assert folders[0][0] != folders[1][0] and folders[0][1] != folders[1][1]
    # named by the time and the run's method (the default preset's)
    assert folders[0][0].startswith("outputs/2026-01-02/03-04-05") and folders[0][0].endswith(f"_{cfg.method.name}")


def test_claims_are_exclusive(tmp_path):
    run = claim_run_dir(tmp_path / "run")
    with pytest.raises(FolderInUseError, match=r"already holds another run \(its \.hydra/\).*Pick another"):
        claim_run_dir(run)
    (tmp_path / "made_in_advance").mkdir()
    claim_run_dir(tmp_path / "made_in_advance")  # an empty folder given in advance is fine
    results = tmp_path / "old"
    results.mkdir()
    (results / "summary.json").write_text("{}")
    with pytest.raises(FolderInUseError, match=r"already holds the results of another run \(summary\.json\)"):
        claim_run_dir(results)
    assert not (results / ".hydra").exists()

    sweep = claim_sweep_dir(tmp_path / "sweep")
    with pytest.raises(FolderInUseError, match=r"multirun\.yaml"):
        claim_sweep_dir(sweep)
    with pytest.raises(FolderInUseError, match=r"another run or sweep \(summary\.json\)"):
        claim_sweep_dir(results)


def test_sweep_jobs_need_folders_of_their_own():
    from omegaconf import OmegaConf

    check_sweep_subdir(OmegaConf.create({"sweep": {"subdir": "${hydra.job.num}"}}))
    check_sweep_subdir(OmegaConf.create({"sweep": {"subdir": "${hydra.job.override_dirname}_${hydra.job.num}"}}))
    for subdir in ("same", "${hydra.job.override_dirname}"):  # seeds are left out of override_dirname
        with pytest.raises(FolderInUseError, match=r"include \$\{hydra.job.num\}"):
            check_sweep_subdir(OmegaConf.create({"sweep": {"subdir": subdir}}))


def test_a_second_run_into_a_folder_is_refused_before_anything_is_written(tmp_path):
    earlier = tmp_path / "earlier"
    (earlier / ".hydra").mkdir(parents=True)
    (earlier / ".hydra" / "overrides.yaml").write_text("- seed=7\n")
    (earlier / "summary.json").write_text('{"speedup": 1.5}')
    before = _snapshot(earlier)
    proc = _specdec(tmp_path, *TINY, "seed=8", f"hydra.run.dir={earlier}")
    assert proc.returncode == 1
    assert f"hydra.run.dir={earlier} already holds the results of another run" in proc.stderr
    assert _snapshot(earlier) == before  # neither .hydra/ nor the log was rewritten

    proc = _specdec(tmp_path, "-m", *TINY, "seed=1,2", f"hydra.sweep.dir={earlier}")
    assert proc.returncode == 1 and f"hydra.sweep.dir={earlier} already holds another run" in proc.stderr
    assert _snapshot(earlier) == before and "Launching" not in proc.stdout + proc.stderr


def test_a_folder_that_cannot_be_made_is_one_error_line(tmp_path):
    from omegaconf import OmegaConf

    from specdec.study.run_dirs import RunFolders

    (tmp_path / "a_file").write_text("")
    bad = tmp_path / "a_file" / "sub"
    proc = _specdec(tmp_path, *TINY, f"hydra.run.dir={bad}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "UserWarning" not in proc.stderr
    assert f"Error: hydra.run.dir={bad}: cannot create it (Not a directory); pick a writable folder" in proc.stderr
    config = OmegaConf.create({"hydra": {"run": {"dir": str(tmp_path / "a_file")}, "output_subdir": ".hydra",
                                         "sweep": {"dir": str(bad), "subdir": "${hydra.job.num}"}}})
    with pytest.raises(SystemExit, match=r"hydra.run.dir=.*a_file: cannot create it \(a file of that name is in"):
        RunFolders().on_run_start(config)
    with pytest.raises(SystemExit, match=r"hydra.sweep.dir=.*: cannot create it \(Not a directory\); pick a writable"):
        RunFolders().on_multirun_start(config)


def test_a_refused_run_leaves_no_run_folder(tmp_path):
    proc = _specdec(tmp_path, *TINY, "method.num_speculative_tokens=-1")
    assert proc.returncode == 1 and "Error: method.num_speculative_tokens" in proc.stderr
    assert not (tmp_path / "outputs").exists()  # neither the run's folder, Hydra's files in it, nor outputs/<date>
    kept = tmp_path / "outputs" / "2020-01-01" / "an_earlier_run"
    kept.mkdir(parents=True)
    proc = _specdec(tmp_path, *TINY, "method.num_speculative_tokens=-1",
                    f"hydra.run.dir={tmp_path / 'outputs' / '2020-01-01' / 'refused'}")
    assert proc.returncode == 1 and [p.name for p in kept.parent.iterdir()] == ["an_earlier_run"]
    made = tmp_path / "made_in_advance"
    made.mkdir()
    (made / "notes.txt").write_text("mine")
    proc = _specdec(tmp_path, *TINY, "data=hf", f"data.path={tmp_path / 'missing.jsonl'}", f"hydra.run.dir={made}")
    assert proc.returncode == 1 and "Error: data.path: file not found" in proc.stderr
    assert _snapshot(made) == {"notes.txt": b"mine"} and not (made / ".hydra").exists()



@pytest.mark.parametrize("script", ["train_heads", "train_draft"])
def test_a_refused_training_run_leaves_no_run_folder(tmp_path, script):
    """The training scripts refuse a bad value before loading (specdec.train.script_checks) and take back
    the folder Hydra made for the run, as the experiment command does; a folder made in advance stays."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(REPO / "scripts" / f"{script}.py"), "train.epochs=-1"]
    proc = subprocess.run(command, cwd=tmp_path, env=env, text=True, capture_output=True, timeout=300)
    assert proc.returncode == 1 and "Error: train.epochs=-1: must be >= 1" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no outputs/train_*/<time>/ with a log and .hydra/
    made = tmp_path / "made_in_advance"
    made.mkdir()
    proc = subprocess.run([*command, f"hydra.run.dir={made}"], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 1 and list(made.iterdir()) == [] and [p.name for p in tmp_path.iterdir()] == [made.name]

def test_python_api_refuses_a_folder_that_holds_results(tmp_path, monkeypatch):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=TINY)
    (tmp_path / "results.jsonl").write_text('{"prompt_id": "old"}\n')
    monkeypatch.setattr(experiment, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(FolderInUseError, match=r"out_dir=.* already holds the results of another run"):
        experiment.run(cfg, tmp_path)
    assert (tmp_path / "results.jsonl").read_text() == '{"prompt_id": "old"}\n'


@pytest.mark.slow
def test_two_runs_started_together_keep_their_own_folders(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "specdec", *TINY, f"seed={seed}"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for seed in (1, 2)]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
    folders = sorted(p.parent for p in (tmp_path / "outputs").rglob("summary.json"))
    assert len(folders) == 2
    seeds = sorted(json.loads((f / "summary.json").read_text())["seed"] for f in folders)
    assert seeds == [1, 2]
