"""Sweeps through the real command line: a two-point multirun writes sweep_summary.csv and its plot;
the submitit (local) and joblib launchers run jobs in other processes and the summary still appears;
the summary can be rebuilt from the folder alone."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdec.study.sweep import collect, label_jobs, main, summarize_sweep, swept_keys

REPO = Path(__file__).resolve().parents[2]
TINY = ["experiment=tiny_smoke", "data.limit=1", "data.categories=[qa,rag]", "generation.max_new_tokens=4",
        "threads=1", "warmup=false", "plots=false", "dtype=float32"]


def _specdec(tmp_path: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m specdec ...` started in tmp_path, so nothing lands in the repository."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "specdec", *args], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_two_point_multirun_writes_sweep_summary_and_plot(tmp_path):
    sweep = tmp_path / "sweep"
    proc = _specdec(tmp_path, "-m", *TINY, "method.num_speculative_tokens=1,3", f"hydra.sweep.dir={sweep}")
    rows = _csv(sweep / "sweep_summary.csv")
    assert [r["method.num_speculative_tokens"] for r in rows] == ["1", "3"]
    assert [r["status"] for r in rows] == ["complete", "complete"]
    # both jobs measured `draft`: each is labelled by the override that differs
    assert [r["method"] for r in rows] == ["draft", "draft"]
    assert [r["label"] for r in rows] == ["draft[num_speculative_tokens=1]", "draft[num_speculative_tokens=3]"]
    for row, job in zip(rows, ("0", "1")):
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert row["job"] == job
        assert float(row["speedup"]) == pytest.approx(summary["speedup"])
        assert float(row["mean_accepted_length"]) == pytest.approx(summary["mean_accepted_length"])
        assert summary["num_speculative_tokens"] == int(row["method.num_speculative_tokens"])
    assert (sweep / "sweep_summary.png").read_bytes()[:4] == b"\x89PNG"
    assert "sweep sweep: 2 jobs" in proc.stdout and "| method.num_speculative_tokens |" in proc.stdout
    assert "| 1 | draft[num_speculative_tokens=3] | 3 | complete |" in proc.stdout
    assert not (tmp_path / "outputs").exists()


def test_jobs_of_one_method_are_labelled_by_the_overrides_that_differ():
    rows = [{"job": str(n), "method": m} for n, m in enumerate(["ngram", "ngram", "suffix", None, "ngram"])]
    overrides = {"0": {"method": "ngram", "method.num_speculative_tokens": "2", "seed": "0"},
                 "1": {"method": "ngram", "method.num_speculative_tokens": "4", "seed": "0"},
                 "2": {"method": "suffix", "method.num_speculative_tokens": "2", "seed": "0"},
                 "4": {"method": "ngram", "method.num_speculative_tokens": "4", "seed": "1"}}
    label_jobs(rows, overrides, ["method.num_speculative_tokens"])
    assert [r["label"] for r in rows] == ["ngram[num_speculative_tokens=2,seed=0]", "ngram[num_speculative_tokens=4,seed=0]",
                                          "suffix", None, "ngram[num_speculative_tokens=4,seed=1]"]
    twins = [{"job": "0", "method": "ngram"}, {"job": "1", "method": "ngram"}]
    label_jobs(twins, {"0": {"seed": "0"}, "1": {"seed": "0"}}, [])
    assert [r["label"] for r in twins] == ["ngram[job 0]", "ngram[job 1]"]


def test_sweep_jobs_are_named_by_their_swept_values(tmp_path):
    sweep = tmp_path / "sweep_wandb"
    _specdec(tmp_path, "-m", *TINY, "logger=wandb", "generation.temperature=0,0.5", f"hydra.sweep.dir={sweep}")
    from specdec.study.tracking import inspect_offline_run

    runs = [inspect_offline_run(next((sweep / job / "wandb").glob("offline-run-*"))) for job in ("0", "1")]
    assert len({run["run_id"] for run in runs}) == 2 and all(run["state"] == "finished" for run in runs)
    assert sorted(run["name"] for run in runs) == ["generation.temperature=0", "generation.temperature=0.5"]
    assert [r["generation.temperature"] for r in _csv(sweep / "sweep_summary.csv")] == ["0", "0.5"]


def test_jobs_of_a_multirun_share_the_sweep_as_wandb_group(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf, open_dict

    from specdec.study.experiment import job_identity

    sweep = tmp_path / "my_sweep"
    sweep.mkdir()
    OmegaConf.save({"hydra": {"overrides": {"task": ["method.num_speculative_tokens=1,2", "seed=3"]}}},
                   sweep / "multirun.yaml")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["method.num_speculative_tokens=2", "seed=3"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.mode = RunMode.MULTIRUN
        cfg.hydra.sweep.dir = str(sweep)
        cfg.hydra.job.num = 1
    hydra_config = HydraConfig.instance()
    previous = hydra_config.cfg
    hydra_config.set_config(cfg)
    try:
        assert job_identity("draft") == ("method.num_speculative_tokens=2", "my_sweep")
    finally:
        hydra_config.cfg = previous
    assert job_identity("draft") == ("draft", None)  # outside Hydra: no group


def test_swept_keys_and_rebuilding_a_summary(tmp_path):
    assert swept_keys(["a=1,2", "b=3", "method=draft,ngram", "c=range(1,3)"]) == ["a", "method", "c"]
    for job, (k, speedup) in enumerate([(2, 1.5), (4, 2.0)]):
        d = tmp_path / str(job)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "overrides.yaml").write_text(f"- method.num_speculative_tokens={k}\n- seed=0\n")
        (d / "summary.json").write_text(json.dumps({"speedup": speedup, "mean_accepted_length": k / 2}))
    keys, rows = collect(tmp_path)
    assert keys == ["method.num_speculative_tokens"]  # seed does not vary: not a swept parameter
    assert [r["speedup"] for r in rows] == [1.5, 2.0]
    csv_path, png_path = summarize_sweep(tmp_path)
    assert _csv(csv_path)[1]["method.num_speculative_tokens"] == "4" and png_path.is_file()


def _job(sweep: Path, job: str, k: int, summary: dict | None) -> None:
    (sweep / job / ".hydra").mkdir(parents=True)
    (sweep / job / ".hydra" / "overrides.yaml").write_text(f"- method.num_speculative_tokens={k}\n- seed=0\n")
    if summary is not None:
        (sweep / job / "summary.json").write_text(json.dumps(summary))


def test_every_job_has_a_row_that_says_how_it_ended(tmp_path, capsys):
    from omegaconf import OmegaConf

    sweep = tmp_path / "sweep"
    _job(sweep, "0", 1, {"speedup": 1.5, "complete": True})
    _job(sweep, "1", 2, {"speedup": 1.2, "complete": False, "error": "Terminated: received SIGTERM"})
    _job(sweep, "2", 3, {"speedup": 1.1, "complete": False})  # killed -9, or still running
    _job(sweep, "3", 4, None)  # failed before its first results (a bad value, a model that does not load)
    # job 4 has no folder at all, but the sweep's multirun.yaml says it was to run
    OmegaConf.save({"hydra": {"sweep": {"dir": str(sweep), "subdir": "${hydra.job.num}"},
                              "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                                          "params": None},
                              "overrides": {"task": ["method.num_speculative_tokens=1,2,3,4,5", "seed=0"]}}},
                   sweep / "multirun.yaml")
    main([str(sweep)])
    printed = capsys.readouterr().out
    rows = _csv(sweep / "sweep_summary.csv")
    assert [(r["job"], r["method.num_speculative_tokens"], r["status"]) for r in rows] == [
        ("0", "1", "complete"), ("1", "2", "failed"), ("2", "3", "incomplete"), ("3", "4", "missing summary"),
        ("4", "5", "missing summary")]
    assert rows[1]["error"] == "Terminated: received SIGTERM" and rows[1]["speedup"] == "1.2"
    assert rows[3]["speedup"] == rows[4]["speedup"] == ""
    assert "| 0 | - | 1 | complete | 1.50 |" in printed  # no method in these summaries: no label
    assert "| 1 | - | 2 | **failed** (Terminated: received SIGTERM) | 1.20 |" in printed
    assert "| 2 | - | 3 | **incomplete** | 1.10 |" in printed and "| 4 | - | 5 | **missing summary** | - |" in printed
    assert "5 jobs: 1 complete, 1 failed, 1 incomplete, 2 missing summary" in printed
    assert (sweep / "sweep_summary.png").is_file()  # drawn from the jobs that have numbers


def test_a_sweep_whose_last_job_cannot_work_stops_before_the_first(tmp_path):
    """Every job is validated before any runs (`specdec.study.sweep_check`): a bad value in the last job
    stops the sweep with one line naming the job, and no job folder is made."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline"}
    for sweep_args in (["method.num_speculative_tokens=2,0"], ["method.num_speculative_tokens=2", "data.limit=1,0"]):
        sweep = tmp_path / f"sweep{len(sweep_args)}"
        proc = subprocess.run([sys.executable, "-m", "specdec", "-m", *TINY, *sweep_args, f"hydra.sweep.dir={sweep}"],
                              cwd=tmp_path, env=env, text=True, capture_output=True, timeout=300)
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert "Error: sweep job 1 (" in proc.stderr and "no job has run" in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
        assert not sweep.exists()


def test_job_overrides_expand_as_the_basic_sweeper_does():
    from omegaconf import OmegaConf

    from specdec.study.sweep_check import job_overrides

    config = OmegaConf.create({"hydra": {"sweeper": {"params": {"seed": "0,1"}},
                                         "overrides": {"task": ["method.num_speculative_tokens=1,2", "threads=1"]}}})
    assert job_overrides(config) == [[f"seed={s}", f"method.num_speculative_tokens={k}", "threads=1"]
                                     for s in (0, 1) for k in (1, 2)]


def test_a_folder_with_no_job_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no jobs under"):
        summarize_sweep(tmp_path)
    from specdec.study.sweep import main

    with pytest.raises(SystemExit, match="Error: .*nope is not a folder; give a sweep's multirun folder"):
        main([str(tmp_path / "nope")])


def test_submitit_local_launcher_runs_a_job(tmp_path, request):
    start = time.perf_counter()
    sweep = tmp_path / "submitit"
    _specdec(tmp_path, "-m", "hydra/launcher=submitit_local", *TINY, "method.num_speculative_tokens=2",
             f"hydra.sweep.dir={sweep}")
    assert json.loads((sweep / "0" / "summary.json").read_text())["complete"] is True
    assert _csv(sweep / "sweep_summary.csv")[0]["job"] == "0"
    assert (sweep / ".submitit").is_dir()  # the job really went through submitit
    elapsed = time.perf_counter() - start
    assert elapsed < 120, elapsed


@pytest.mark.slow
def test_joblib_launcher_runs_jobs_in_parallel(tmp_path):
    sweep = tmp_path / "joblib"
    _specdec(tmp_path, "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *TINY,
             "method=draft,autoregressive", f"hydra.sweep.dir={sweep}")
    rows = _csv(sweep / "sweep_summary.csv")
    assert sorted(r["method"] for r in rows) == ["autoregressive", "draft"]
    assert all(r["complete"] == "True" for r in rows)
