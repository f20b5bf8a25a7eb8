"""Experiment tracking: the local results files, always, and Weights & Biases, when asked.

An experiment's results must survive whatever happens to the tracker, so the two are kept apart:

- `write_local_results` writes `results.jsonl` (one line per prompt) and `summary.json` into the job's
  output folder, both or neither (`write_atomic`). It needs nothing but the standard library and is
  called whether or not W&B works.
- `Tracker` is the no-op logger (`logger=none`); `WandbTracker` sends the same numbers to W&B, offline by
  default: the summary flattened (every speedup, tau, alpha and tokens/s with its 95% interval,
  `<name>_ci_low` / `_ci_high`, and the counts behind it: `num_prompts`, `num_repeats`, `steps`), one
  history step per prompt and repeat, and the results as a table (with each row's `repeat`). A run that cannot start online is logged offline instead, for a later `wandb sync`. Any
  other exception from W&B is caught, logged as a warning, and turns the tracker into a no-op:
  W&B may lose a run, the run never loses its results.
- `read_offline_summary` reads the summary of an offline run back, so tests can check that W&B saw
  what `summary.json` holds.
- `sigterm_raises` turns SIGTERM (what Slurm, `timeout` and `kill` send) into a `Terminated` exception,
  so a killed job takes the same way out as a crashed one: partial results saved with
  `complete: false`, the W&B run finished as failed, a non-zero exit status (143, as for a SIGTERM).

W&B facts this relies on (wandb 0.31): `reinit="create_new"` gives every job its own run even when
Hydra runs many jobs in one process; an offline run writes `offline-run-*/run-*.wandb` and no
`wandb-summary.json`, which `wandb leet inspect --summary --json` reads back.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

from specdec.core.errors import described

log = logging.getLogger("specdec")

SCALAR = (bool, int, float, str)
# The `logger.*` settings a tracker is given when it names them.
TRACKER_SETTINGS = ("project", "entity", "mode", "tags", "init_timeout")


def _jsonable(obj: Any) -> Any:
    """Make `obj` strict JSON: non-finite floats become None, tuples lists, paths and the rest strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if obj is None or isinstance(obj, SCALAR):
        return obj
    if isinstance(obj, Mapping):  # dicts, and OmegaConf configs too
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, Sequence):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "item"):  # numpy / torch scalars
        return _jsonable(obj.item())
    return str(obj)


def write_atomic(files: Mapping[Path, str]) -> None:
    """Write every file via a temporary file, then `os.replace` them all, so a crash never leaves a
    half-written file and a failed write (a full disk) changes none of them: files that must agree,
    such as results.jsonl and summary.json, are never left one new and one old. The temporary files
    of a failed write are removed."""
    tmps = {path: path.with_name(path.name + ".tmp") for path in files}
    try:
        for path, text in files.items():
            tmps[path].write_text(text, encoding="utf-8")
    except BaseException:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
        raise
    for path, tmp in tmps.items():
        os.replace(tmp, path)


def write_local_results(out_dir: Path, rows: list[dict] | None, summary: dict) -> None:
    """Write `results.jsonl` (one JSON line per row) and `summary.json` into `out_dir`; NaN/inf -> null.
    `rows` None keeps the results.jsonl that holds them already: on a full disk, the summary alone may
    still fit. On an OSError both files are left as they were."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {out_dir / "summary.json": json.dumps(_jsonable(summary), indent=2, allow_nan=False) + "\n"}
    if rows is not None:
        files[out_dir / "results.jsonl"] = "".join(json.dumps(_jsonable(row), allow_nan=False) + "\n" for row in rows)
    write_atomic(files)


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts and lists -> {"a/b/c": scalar}; list items are numbered from 1 (position i = 1..k).

    None and non-finite floats are left out: W&B drops None anyway, and summary.json holds them as null.
    """
    if isinstance(obj, Mapping):
        items = [(str(k), v) for k, v in obj.items()]
    elif isinstance(obj, Sequence) and not isinstance(obj, str):
        items = [(str(i), v) for i, v in enumerate(obj, start=1)]
    else:
        value = _jsonable(obj)
        return {} if value is None else {prefix: value}
    flat: dict[str, Any] = {}
    for key, value in items:
        flat.update(flatten(value, f"{prefix}/{key}" if prefix else key))
    return flat


class Terminated(SystemExit):
    """A signal asked the process to stop. A SystemExit, so that nothing that catches `Exception` swallows
    it and the process exits with status 128 + the signal's number, as the default action would."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signal_name = signal.Signals(signum).name

    def __str__(self) -> str:
        return f"received {self.signal_name}"


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Inside the block, SIGTERM raises `Terminated` in the main thread (once: a repeated SIGTERM is
    ignored while the exception unwinds and saves). Outside the main thread, where Python cannot set
    signal handlers, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        signal.signal(signum, signal.SIG_IGN)
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_code_of(exc: BaseException | None) -> int:
    """The exit status a run ends with, as the process would report it: 0 without an exception, a
    SystemExit's own status, 130 for Ctrl-C (128 + SIGINT), else 1."""
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT
    return 1


class Tracker:
    """The no-op tracker (`logger=none`) and the interface every tracker keeps."""

    def start(self, config: dict, name: str, group: str | None, out_dir: Path) -> None:
        pass

    def log_rows(self, rows: list[dict]) -> None:
        """Per-prompt metrics."""

    def log_summary(self, summary: dict, rows: list[dict], plots: dict[str, Path]) -> None:
        """The run's aggregate metrics, a table of the rows, and plots saved as image files (and the
        run's report.html, a `.html` file among them)."""

    def finish(self, exit_code: int = 0) -> None:
        """Close the run; a non-zero `exit_code` marks it failed."""

    @property
    def run_dir(self) -> Path | None:
        """Where the tracker wrote the run; None when it wrote nothing."""
        return None

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.finish(exit_code_of(exc))  # returns None: the exception, if any, propagates


class WandbTracker(Tracker):
    """Weights & Biases, one run per job. Every W&B call is guarded: on failure, warn and go quiet.
    A `mode` W&B does not know is refused by `specdec.study.config.validate` before any model loads (W&B
    itself would refuse it only at `init`, after the run began, and the run would go on untracked)."""

    MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")  # what wandb.init takes as `mode`
    LOCAL_MODES = ("offline", "dryrun", "disabled")  # need no server: a failure has no offline fallback

    @staticmethod
    def resolve_mode(mode: str | None) -> str:
        """`mode`, else WANDB_MODE, else offline: an explicit wandb.init(mode=...) overrides WANDB_MODE,
        so the environment variable is read here."""
        return mode or os.environ.get("WANDB_MODE") or "offline"

    def __init__(
        self,
        project: str = "specdec",
        entity: str | None = None,
        mode: str | None = None,
        tags: tuple[str, ...] | list[str] = (),
        init_timeout: float = 15.0,
    ) -> None:
        self.project = project
        self.entity = entity
        self.mode = self.resolve_mode(mode)
        self.tags = list(tags)
        self.init_timeout = init_timeout
        self._run: Any = None
        self._run_dir: Path | None = None
        self._out_dir: Path | None = None

    @property
    def run_dir(self) -> Path | None:
        return self._run_dir

    def _fail(self, during: str, exc: Exception) -> None:
        log.warning(
            "W&B failed during %s (%s); continuing without W&B (logger=none turns it off). Local results are "
            "still written in %s",
            during,
            described(exc),
            self._out_dir,
        )
        run, self._run = self._run, None
        if run is not None and during != "finish":
            try:  # close the broken run so it does not linger until the process exits
                run.finish(exit_code=1)
            except Exception:  # already warned; this run is past saving
                pass

    def start(self, config: dict, name: str, group: str | None, out_dir: Path) -> None:
        """Start the W&B run. One that cannot start online (no network, no valid key) is started offline
        instead, so that `wandb sync` can upload it later; any other failure leaves the tracker a no-op."""
        self._out_dir = Path(out_dir)
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # else it phones home even offline
        os.environ.setdefault("WANDB_SILENT", "true")
        try:
            import wandb
        except Exception as exc:  # not installed, or broken
            log.warning("logger=wandb, but wandb cannot be imported (%s): pip install wandb, or logger=none; "
                        "continuing without W&B. Local results are still written in %s", exc, self._out_dir)
            return
        init: dict[str, Any] = dict(
            project=self.project,
            entity=self.entity,
            name=name,
            group=group,
            tags=self.tags,
            config=_jsonable(config),
            dir=self._out_dir,
            reinit="create_new",  # a new run per job, even with a previous run still open
        )
        before: set[Path] = set()
        try:
            self._out_dir.mkdir(parents=True, exist_ok=True)
            before = _run_folders(self._out_dir)
            self._run = wandb.init(**init, mode=self.mode, settings=wandb.Settings(init_timeout=self.init_timeout))
            self._run_dir = Path(self._run.dir).parent  # .../wandb/offline-run-*/files -> the run folder
            return
        except Exception as exc:
            error = exc
        if self.mode in self.LOCAL_MODES:  # nothing to fall back to
            self._fail("init", error)
            return
        # The failed attempt may have left its own run folder (run-*, a few debug logs and an empty
        # .wandb file): `wandb sync <out_dir>/wandb` would upload it as a second, empty run.
        for folder in _run_folders(self._out_dir) - before:
            shutil.rmtree(folder, ignore_errors=True)
        try:
            self._run = wandb.init(**init, mode="offline", settings=wandb.Settings(init_timeout=self.init_timeout))
            self._run_dir = Path(self._run.dir).parent
        except Exception as exc:
            self._fail(f"init ({self.mode}: {described(error)}; then offline)", exc)
            return
        log.warning(
            "W&B could not start %s (%s); this run is logged offline instead, `wandb sync %s` uploads it "
            "later. logger.mode=offline (or WANDB_MODE=offline) skips trying, logger.init_timeout=<seconds> "
            "(now %g) waits longer for the server, logger=none turns W&B off",
            self.mode, described(error), self._run_dir, self.init_timeout,
        )

    def log_rows(self, rows: list[dict]) -> None:
        if self._run is None:
            return
        try:
            for row in rows:  # one step per prompt; "prompt/" keeps them apart from the summary's keys
                metrics = {
                    f"prompt/{k}": v
                    for k, v in row.items()
                    if isinstance(v, (int, float)) and math.isfinite(v)
                }
                self._run.log(metrics)
        except Exception as exc:
            self._fail("log_rows", exc)

    def log_summary(self, summary: dict, rows: list[dict], plots: dict[str, Path]) -> None:
        if self._run is None:
            return
        try:
            import wandb

            self._run.summary.update(flatten(summary))  # first: the numbers matter more than the pictures
            media: dict[str, Any] = {f"plots/{name}": wandb.Image(str(path)) for name, path in plots.items()
                                     if Path(path).suffix != ".html"}
            media.update(_pages(wandb, plots))
            if rows:
                media["results"] = _table(wandb, rows)
            if media:
                self._run.log(media)
        except Exception as exc:
            self._fail("log_summary", exc)

    def finish(self, exit_code: int = 0) -> None:
        if self._run is None:
            return
        try:
            self._run.finish(exit_code=exit_code)
        except Exception as exc:
            self._fail("finish", exc)
        self._run = None


def _pages(wandb: Any, files: dict[str, Path]) -> dict[str, Any]:
    """The HTML pages among a run's files (its report.html, specdec.study.html_report) as wandb.Html,
    under their own names. A page that cannot be read is a warning: the run's numbers and images
    are logged all the same."""
    pages = {}
    for name, path in files.items():
        if Path(path).suffix != ".html":
            continue
        try:
            pages[name] = wandb.Html(Path(path), inject=False)
        except Exception as exc:
            log.warning("W&B: %s not logged (%s); it is still in %s", path, described(exc), Path(path).parent)
    return pages


def _run_folders(out_dir: Path) -> set[Path]:
    """The W&B run folders (`run-*`, `offline-run-*`) under `out_dir`/wandb."""
    return {p for p in (out_dir / "wandb").glob("*run-*") if p.is_dir() and not p.is_symlink()}


def _table(wandb: Any, rows: list[dict]) -> Any:
    """A wandb.Table of the rows: one column per key seen in any row; lists and dicts as JSON strings."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    data = [
        [v if v is None or isinstance(v, SCALAR) else json.dumps(_jsonable(v)) for v in map(row.get, columns)]
        for row in rows
    ]
    return wandb.Table(columns=columns, data=_jsonable(data))


def make_tracker(kind: Any, **settings: Any) -> Tracker:
    """The tracker for `logger.kind`: a name, the file `conf/logger/kind/<name>.yaml` holding its
    `_target_` (none: the no-op Tracker, wandb: WandbTracker; see `specdec.study.registry`), or such a node.
    It is built with the `settings` (project, entity, mode, tags, init_timeout) that it takes."""
    from specdec.study.registry import build

    return build("logger/kind", kind, "logger.kind", offered=settings)


def inspect_offline_run(run_dir: Path) -> dict:
    """A W&B run folder (or its .wandb file) as `wandb leet inspect --summary --json` reads it: run_id, name,
    state, exit_code, config, summary, console tail."""
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json", str(run_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def read_offline_summary(run_dir: Path) -> dict:
    """The summary of a W&B run: the flattened keys the tracker wrote, W&B's own (`_step`, `_runtime`,
    `_timestamp`) and the last value of every logged history key (`prompt/...`, `results`, `plots/...`)."""
    return inspect_offline_run(run_dir)["summary"]
