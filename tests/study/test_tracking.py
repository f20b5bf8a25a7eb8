"""Tracking: local results are always written; W&B (offline here) sees the same numbers, and a failing
W&B never raises into the run nor loses a local result."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from specdec.study.tracking import (
    Terminated,
    Tracker,
    WandbTracker,
    flatten,
    inspect_offline_run,
    make_tracker,
    read_offline_summary,
    sigterm_raises,
    write_local_results,
)

wandb = pytest.importorskip("wandb")

ROWS = [
    {"prompt_id": 0, "category": "qa", "acceptance_rate": 0.75, "speedup": 1.5, "accepted": [3, 2, 0]},
    {"prompt_id": 1, "category": "code", "acceptance_rate": float("nan"), "speedup": 1.25, "extra": True},
]
SUMMARY = {
    "method": "draft",
    "draft": {"overall": {"speedup": 1.4, "acceptance_rate": 0.625, "per_position_acceptance": [0.9, 0.5]}},
    "baseline": {"tokens_per_s": 42.0, "ttft_ms": float("nan")},
    "num_prompts": 2,
}


@pytest.fixture
def wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    return tmp_path


def _plot(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([1, 2, 3], [0.9, 0.5, 0.2])
    fig.savefig(path)
    plt.close(fig)
    return path


def test_write_local_results_is_strict_json(tmp_path: Path) -> None:
    write_local_results(tmp_path / "out", ROWS, SUMMARY)
    lines = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=pytest.fail) for line in lines]  # NaN would call parse_constant
    assert len(rows) == 2 and rows[1]["acceptance_rate"] is None and rows[0]["accepted"] == [3, 2, 0]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text(), parse_constant=pytest.fail)
    assert summary["baseline"]["ttft_ms"] is None
    assert summary["draft"]["overall"]["per_position_acceptance"] == [0.9, 0.5]
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_a_full_disk_changes_neither_results_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    write_local_results(out, ROWS[:1], {**SUMMARY, "num_prompts": 1})
    before = {p.name: p.read_text() for p in out.iterdir()}
    real_write = Path.write_text

    def full_disk(self: Path, text: str, *args: object, **kwargs: object) -> int:
        if self.name == "summary.json.tmp":  # results.jsonl.tmp is written, then the disk is full
            real_write(self, text[:10], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_local_results(out, ROWS, SUMMARY)
    assert {p.name: p.read_text() for p in out.iterdir()} == before  # both old, no .tmp left behind


def test_flatten_numbers_list_items_from_one_and_drops_nulls() -> None:
    flat = flatten(SUMMARY)
    assert flat["draft/overall/speedup"] == 1.4
    assert flat["draft/overall/per_position_acceptance/1"] == 0.9
    assert flat["draft/overall/per_position_acceptance/2"] == 0.5
    assert "baseline/ttft_ms" not in flat and flat["method"] == "draft"


def test_make_tracker() -> None:
    assert type(make_tracker("none")) is Tracker
    assert isinstance(make_tracker("wandb", project="p"), WandbTracker)
    with pytest.raises(ValueError, match="none, wandb"):
        make_tracker("tensorboard")


def test_noop_tracker(tmp_path: Path) -> None:
    with Tracker() as tracker:
        tracker.start({}, "job", None, tmp_path)
        tracker.log_rows(ROWS)
        tracker.log_summary(SUMMARY, ROWS, {})
    assert tracker.run_dir is None


def test_offline_run_holds_the_summary(wandb_env: Path) -> None:
    out = wandb_env / "job"
    plot = _plot(wandb_env / "acceptance.png")
    t0 = time.perf_counter()
    with WandbTracker(project="specdec-test") as tracker:
        tracker.start({"k": 4, "method": "draft"}, "job", "grp", out)
        tracker.log_rows(ROWS)
        tracker.log_summary(SUMMARY, ROWS, {"acceptance": plot})
    elapsed = time.perf_counter() - t0
    assert tracker.mode == "offline" and elapsed < 15
    run_dir = tracker.run_dir
    assert run_dir is not None and run_dir.is_relative_to(out) and run_dir.name.startswith("offline-run-")
    assert list(run_dir.glob("run-*.wandb"))

    summary = read_offline_summary(run_dir)
    for key, value in flatten(SUMMARY).items():
        assert summary[key] == value, key
    assert summary["prompt/speedup"] == 1.25  # the last per-prompt step
    assert summary["results"]["_type"] == "table-file" and summary["results"]["nrows"] == 2
    assert summary["plots/acceptance"]["_type"] == "image-file"


def test_one_run_per_job(wandb_env: Path) -> None:
    run_dirs = []
    for i in range(2):
        tracker = WandbTracker(project="specdec-test")
        tracker.start({"i": i}, f"job{i}", None, wandb_env / "multirun" / str(i))
        tracker.log_summary({"i": i}, [], {})
        tracker.finish()
        run_dirs.append(tracker.run_dir)
    assert run_dirs[0] != run_dirs[1]
    assert [read_offline_summary(d)["i"] for d in run_dirs] == [0, 1]


def test_failing_init_warns_and_goes_quiet(
    wandb_env: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_init(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no W&B today")

    monkeypatch.setattr(wandb, "init", broken_init)
    out = wandb_env / "job"
    with caplog.at_level(logging.WARNING, logger="specdec"), WandbTracker() as tracker:
        tracker.start({}, "job", None, out)
        tracker.log_rows(ROWS)
        tracker.log_summary(SUMMARY, ROWS, {})
        write_local_results(out, ROWS, SUMMARY)
    assert "W&B failed during init" in caplog.text and "no W&B today" in caplog.text
    assert str(out) in caplog.text
    assert tracker.run_dir is None
    assert (out / "summary.json").exists() and (out / "results.jsonl").exists()


def test_failing_log_mid_run_never_raises(
    wandb_env: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_log(self: object, *args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    out = wandb_env / "job"
    with caplog.at_level(logging.WARNING, logger="specdec"), WandbTracker() as tracker:
        tracker.start({}, "job", None, out)
        monkeypatch.setattr(type(tracker._run), "log", broken_log)
        tracker.log_rows(ROWS)
        tracker.log_summary(SUMMARY, ROWS, {})  # a no-op by now
    assert caplog.text.count("W&B failed") == 1 and "during log_rows" in caplog.text


@pytest.mark.parametrize("server", [None, "http://127.0.0.1:9"])  # DNS fails; nothing listens
def test_online_without_network_fails_fast_and_logs_offline(
    wandb_env: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, server: str | None
) -> None:
    # A well-formed key, so wandb really tries the network instead of stopping at "no API key".
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    if server:
        monkeypatch.setenv("WANDB_BASE_URL", server)
    out = wandb_env / "job"
    t0 = time.perf_counter()
    with (
        caplog.at_level(logging.WARNING, logger="specdec"),
        WandbTracker(mode="online", init_timeout=2) as tracker,
    ):
        tracker.start({}, "job", None, out)
        tracker.log_rows(ROWS)
        tracker.log_summary(SUMMARY, ROWS, {})
    elapsed = time.perf_counter() - t0
    assert elapsed < 20, elapsed  # measured: init_timeout + ~2 s for the offline run
    # the advice is in specdec's terms, and the run is kept for `wandb sync`
    assert "W&B could not start online" in caplog.text and f"wandb sync {tracker.run_dir}" in caplog.text
    assert "logger.mode=offline" in caplog.text and "logger=none" in caplog.text
    assert "logger.init_timeout=" in caplog.text and "wandb.init(" not in caplog.text
    assert tracker.run_dir.is_relative_to(out) and tracker.run_dir.name.startswith("offline-run-")
    assert read_offline_summary(tracker.run_dir)["draft/overall/speedup"] == 1.4
    # the failed online attempt's own run folder is gone, so `wandb sync out/wandb` uploads one run
    assert [p.resolve() for p in (out / "wandb").iterdir() if p.is_dir() and not p.is_symlink()] == [
        tracker.run_dir.resolve()
    ]


def test_missing_wandb_says_how_to_get_it(
    wandb_env: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with caplog.at_level(logging.WARNING, logger="specdec"), WandbTracker() as tracker:
        tracker.start({}, "job", None, wandb_env / "job")
        tracker.log_summary(SUMMARY, ROWS, {})
    assert "pip install wandb, or logger=none" in caplog.text and tracker.run_dir is None


def test_context_manager_marks_failure_and_reraises(wandb_env: Path) -> None:
    finished = []

    class Spy(Tracker):
        def finish(self, exit_code: int = 0) -> None:
            finished.append(exit_code)

    with pytest.raises(KeyError), Spy():
        raise KeyError("boom")
    with Spy():
        pass
    with pytest.raises(Terminated), Spy():
        raise Terminated(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), Spy():
        raise KeyboardInterrupt
    assert finished == [1, 0, 143, 130]

    with pytest.raises(KeyError), WandbTracker(project="specdec-test") as tracker:
        tracker.start({}, "job", None, wandb_env / "job")
        raise KeyError("boom")
    assert tracker.run_dir is not None
    assert inspect_offline_run(tracker.run_dir)["exit_code"] == 1


def test_missing_plot_keeps_the_summary(wandb_env: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="specdec"), WandbTracker(project="specdec-test") as tracker:
        tracker.start({}, "job", None, wandb_env / "job")
        tracker.log_summary(SUMMARY, ROWS, {"gone": wandb_env / "missing.png"})
    assert "during log_summary" in caplog.text
    assert tracker.run_dir is not None
    assert read_offline_summary(tracker.run_dir)["draft/overall/speedup"] == 1.4


def test_sigterm_raises_once_inside_the_block_only() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated) as raised, sigterm_raises():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # not reached: the handler raises as soon as the signal is taken
    assert raised.value.code == 143 and str(raised.value) == "received SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is previous

    with sigterm_raises():  # a second SIGTERM while the first unwinds (and saves) is ignored
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
    assert signal.getsignal(signal.SIGTERM) is previous


def test_sigterm_raises_is_a_no_op_outside_the_main_thread() -> None:
    seen = []

    def body() -> None:
        with sigterm_raises():  # signal.signal would raise ValueError here
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [signal.getsignal(signal.SIGTERM)]
