"""The end of a sweep: one CSV line per job, a figure of speedup and tau against each swept parameter.

`SweepSummary` is a Hydra callback (listed in `conf/config.yaml` under `hydra.callbacks`). When a
multirun ends it reads every job's `summary.json` and `.hydra/overrides.yaml` under the sweep folder
and writes there `sweep_summary.csv`, `sweep_summary.png` (and `.pdf`, `specdec.study.figures`) and
`report.html` (`specdec.study.html_report`). It works for any launcher (basic, joblib, submitit)
because it reads only files. While the jobs of the basic launcher run in this process it also shows
a progress bar over jobs (quiet when stderr is not a terminal).

Every job has a line, with a `status`:

- complete:        summary.json says `complete: true`
- failed:          the job raised (an error, Ctrl-C, SIGTERM); summary.json holds the partial results
                   and the `error`
- incomplete:      summary.json says `complete: false` and holds no error: the job is still running,
                   or was killed without a chance to say so (SIGKILL, out of memory)
- missing summary: no summary.json: the job failed before its first results (a bad value, a model
                   that does not load), or never started. With the basic sweeper the jobs the sweep
                   should have run are listed from `multirun.yaml`, so one with no folder at all is
                   still a line.

If a job failed, Hydra stops before the callback's turn; rebuild the summary from what is there with

    python -m specdec.study.sweep multirun/<sweep folder>
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from specdec.study.report import markdown_table, write_csv
from specdec.study.results import HEADLINE

log = logging.getLogger("specdec")

CSV_NAME = "sweep_summary.csv"
PLOT_NAME = "sweep_summary.png"
# The first method's headline numbers (a MethodSummary's, repeated at the top of summary.json), then
# the run's own; per-position acceptance is a list, left to summary.json.
METRICS = (*(m for m in HEADLINE if m != "per_position_acceptance"), "baseline_tokens_per_s", "matches_baseline",
           "num_prompts", "method", "verifier", "lossless", "complete")
COMPLETE, FAILED, INCOMPLETE, MISSING = "complete", "failed", "incomplete", "missing summary"
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"

_job_bar: Any = None  # the progress bar over jobs; lives only in the process that launched the sweep


def swept_keys(task_overrides: list[str]) -> list[str]:
    """The keys of the command-line overrides that sweep (`k=1,2,4`, `range(...)`, `choice(...)`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(task_overrides))
    return [o.key_or_group for o in parsed if o.is_sweep_override()]


def swept_keys_of(sweep_dir: str | Path) -> list[str]:
    """The swept keys of the multirun whose folder this is, from the `multirun.yaml` Hydra writes there."""
    path = Path(sweep_dir) / "multirun.yaml"
    if not path.is_file():
        return []
    task = OmegaConf.select(OmegaConf.load(path), "hydra.overrides.task", default=[])
    return swept_keys(OmegaConf.to_container(task))


def _count_jobs(task_overrides: list[str]) -> int | None:
    """Jobs the basic sweeper will launch: the product of the sweeps' lengths (None if unknown)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(task_overrides))
        return math.prod(len(list(o.sweep_string_iterator())) for o in parsed if o.is_sweep_override())
    except Exception:  # range over floats, interval sweeps for Optuna, ...: no total, just a count
        return None


def _read_overrides(job_dir: Path) -> dict[str, str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return {}
    items = OmegaConf.to_container(OmegaConf.load(path))
    pairs = (item.split("=", 1) for item in items if "=" in item)
    return {key.lstrip("+~"): value for key, value in pairs}


def _expected_jobs(sweep_dir: Path) -> dict[str, dict[str, str]]:
    """{job folder: its overrides} for every job the sweep launches, from its `multirun.yaml`; empty
    when that cannot be known (another sweeper, a custom `hydra.sweep.subdir`, no multirun.yaml)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    path = sweep_dir / "multirun.yaml"
    if not path.is_file():
        return {}
    hydra_cfg = OmegaConf.load(path).hydra
    if OmegaConf.select(hydra_cfg, "sweeper._target_") != BASIC_SWEEPER or \
            OmegaConf.to_container(hydra_cfg.sweep)["subdir"] != "${hydra.job.num}":
        return {}
    params = hydra_cfg.sweeper.get("params")
    params = OmegaConf.to_container(params) if params is not None else {}
    task = [*(f"{k}={v}" for k, v in params.items()), *OmegaConf.to_container(hydra_cfg.overrides.task)]
    try:
        batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(task), None)
    except HydraException as exc:  # an override this parser cannot expand without the app's config
        log.warning("cannot list the jobs of %s from multirun.yaml (%s); listing job folders only",
                    sweep_dir, exc)
        return {}
    jobs = [job for batch in batches for job in batch]
    return {str(num): dict(o.lstrip("+~").split("=", 1) for o in job if "=" in o)
            for num, job in enumerate(jobs)}


def _read_summary(job_dir: Path) -> tuple[dict | None, str | None]:
    """(summary.json, None), or (None, why not) when it is absent or unreadable."""
    import json

    path = job_dir / "summary.json"
    if not path.is_file():
        return None, None
    try:
        return json.loads(path.read_text(encoding="utf-8")), None
    except (OSError, ValueError) as exc:
        return None, f"unreadable summary.json: {exc}"


def job_status(summary: dict | None) -> str:
    """complete / failed / incomplete / missing summary: see the module docstring."""
    if summary is None:
        return MISSING
    if summary.get("complete"):
        return COMPLETE
    return FAILED if summary.get("error") else INCOMPLETE


def collect(sweep_dir: Path, keys: list[str] | None = None) -> tuple[list[str], list[dict]]:
    """One row per job: its folder, swept values, status (and error) and headline metrics. The jobs are
    the folders holding `.hydra/overrides.yaml` or `summary.json`, plus those `multirun.yaml` says the
    sweep launches. Without `keys`, the swept parameters are the overrides whose values differ."""
    sweep_dir = Path(sweep_dir)
    markers = [*sweep_dir.glob("**/.hydra/overrides.yaml"), *sweep_dir.glob("**/summary.json")]
    found = {(p.parent.parent if p.parent.name == ".hydra" else p.parent) for p in markers}
    jobs = {str(d.relative_to(sweep_dir)): _read_overrides(d) for d in found if ".submitit" not in d.parts}
    for job, overrides in _expected_jobs(sweep_dir).items():
        jobs[job] = jobs.get(job) or overrides
    if keys is None:
        all_keys = dict.fromkeys(k for o in jobs.values() for k in o)
        keys = [k for k in all_keys if len({o.get(k) for o in jobs.values()}) > 1]
    rows = []
    for job in sorted(jobs, key=_job_order):
        summary, problem = _read_summary(sweep_dir / job)
        row: dict[str, Any] = {"job": job, "label": None}
        row.update({k: jobs[job].get(k) for k in keys})
        row["status"] = job_status(summary)
        row["error"] = (summary or {}).get("error") or problem
        row.update({m: (summary or {}).get(m) for m in METRICS})
        rows.append(row)
    label_jobs(rows, jobs, keys)
    return keys, rows


def label_jobs(rows: list[dict], overrides: dict[str, dict[str, str]], keys: list[str]) -> None:
    """Each row's `label`: its method's name, or, where jobs measured methods of the same name, that
    name with the overrides whose values differ among those jobs, the swept keys first
    (`ngram[num_speculative_tokens=2]`, as `specdec.study.variants` names a run's methods apart);
    by job where no override differs. A job with no summary has no label."""
    from specdec.study.variants import short_keys

    groups: dict[str, list[dict]] = {}
    for row in rows:
        row["label"] = None
        if row.get("method") is not None:
            groups.setdefault(row["method"], []).append(row)
    for name, group in groups.items():
        if len(group) == 1:
            group[0]["label"] = name
            continue
        given = [overrides.get(r["job"], {}) for r in group]
        candidates = dict.fromkeys([*keys, *(k for o in given for k in o)])
        differ = [k for k in candidates if len({o.get(k) for o in given}) > 1]
        short = short_keys(differ)
        for row, o in zip(group, given):
            row["label"] = (f"{name}[{','.join(f'{short[k]}={o.get(k)}' for k in differ)}]" if differ
                            else f"{name}[job {row['job']}]")


def _job_order(job: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in Path(job).parts)


def _as_number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def plot(keys: list[str], rows: list[dict], path: Path, context: str = "") -> Path:
    """Speedup and tau against each swept parameter (`specdec.study.figures.sweep_figure`): lines over
    a numeric one, grouped bars over a categorical one, a colour per method; written as `path` (PNG)
    and beside it as PDF. `context`: the subtitle (target, prompts, n, device, dtype)."""
    from specdec.study.figures import save, sweep_figure

    path = Path(path)
    return save(sweep_figure(keys, rows, context), path.parent, path.stem)


def context_of(sweep_dir: Path, rows: list[dict]) -> str:
    """The subtitle of the sweep's figure: what its jobs' summaries say of target, prompts, n, device
    and dtype (every value, where jobs differ)."""
    from specdec.study.figures import context_line

    summaries = [_read_summary(Path(sweep_dir) / str(r["job"]))[0] for r in rows]
    return context_line(s for s in summaries if s)


def summarize_sweep(sweep_dir: str | Path, keys: list[str] | None = None) -> tuple[Path, Path | None]:
    """Write sweep_summary.csv and sweep_summary.png into `sweep_dir`; returns their paths."""
    sweep_dir = Path(sweep_dir)
    keys, rows = collect(sweep_dir, keys)
    if not rows:
        raise FileNotFoundError(f"no jobs under {sweep_dir}: no job folder (with .hydra/overrides.yaml or "
                                "summary.json) and no multirun.yaml; pass the folder of a multirun")
    csv_path = write_csv(rows, sweep_dir / CSV_NAME)
    measured = [r for r in rows if r["status"] != MISSING]
    try:
        png_path = plot(keys, measured, sweep_dir / PLOT_NAME, context_of(sweep_dir, measured)) if measured else None
    except Exception as exc:  # the CSV is the result; a plot failure must not hide it
        log.warning("sweep plot failed (%s: %s); %s is written", type(exc).__name__, exc, csv_path)
        png_path = None
    write_report(sweep_dir, keys, rows, png_path)
    return csv_path, png_path


def write_report(sweep_dir: Path, keys: list[str], rows: list[dict], png_path: Path | None) -> Path | None:
    """The sweep's report.html (specdec.study.html_report): its table, figure, multirun.yaml and
    provenance. A failure is a warning: the CSV is the result."""
    from specdec.study.html_report import write_sweep_report

    try:
        summaries = [s for s in (_read_summary(sweep_dir / str(r["job"]))[0] for r in rows) if s]
        measured = [r for r in rows if r["status"] != MISSING]
        return write_sweep_report(sweep_dir, format_rows(keys, rows), {"sweep": png_path} if png_path else {},
                                  context_of(sweep_dir, measured), summaries)
    except Exception as exc:
        log.warning("sweep report.html failed (%s: %s)", type(exc).__name__, exc)
        return None


def format_rows(keys: list[str], rows: list[dict]) -> str:
    """A short markdown table of the sweep, printed at its end: a job that is not complete says so
    (its status, and its error if it has one), and a line under the table counts each status."""
    head = ["job", "method", *keys, "status", "speedup", "tau", "alpha", "predicted"]
    cells = []
    for r in rows:
        status = r["status"] if r["status"] == COMPLETE else f"**{r['status']}**"
        if r.get("error"):
            status += f" ({r['error']})".replace("|", "/")
        line = [str(r["job"]), str(r.get("label") or "-"), *(str(r[k]) for k in keys), status]
        for m in ("speedup", "mean_accepted_length", "acceptance_rate", "predicted_speedup"):
            x = _as_number(r.get(m))
            line.append("-" if x is None or math.isnan(x) else f"{x:.2f}")
        cells.append(line)
    counts = {s: sum(r["status"] == s for r in rows) for s in (COMPLETE, FAILED, INCOMPLETE, MISSING)}
    total = f"{len(rows)} jobs: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    return "\n".join([*markdown_table(head, cells, left=range(len(keys) + 3)), "", total])


class SweepSummary(Callback):
    """Hydra callback: progress over jobs while they run here, the sweep summary when they are done."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _job_bar
        from tqdm.auto import tqdm

        total = _count_jobs(OmegaConf.to_container(config.hydra.overrides.task))
        _job_bar = tqdm(total=total, desc="sweep", unit="job", file=sys.stderr, disable=None)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if _job_bar is not None:  # None in launcher workers (joblib, submitit): no bar there
            _job_bar.update(1)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _job_bar
        if _job_bar is not None:
            _job_bar.close()
            _job_bar = None
        sweep_dir = Path(config.hydra.sweep.dir)
        keys = swept_keys(OmegaConf.to_container(config.hydra.overrides.task))
        try:
            csv_path, png_path = summarize_sweep(sweep_dir, keys)
        except FileNotFoundError as exc:
            log.warning("no sweep summary: %s", exc)
            return
        _, rows = collect(sweep_dir, keys)
        print(f"\nsweep {sweep_dir.name}: {len(rows)} jobs\n{format_rows(keys, rows)}\n"
              f"wrote {csv_path}" + (f" and {png_path}" if png_path else ""), flush=True)


def main(argv: list[str] | None = None) -> None:
    """`python -m specdec.study.sweep <multirun folder> [key ...]`: rebuild the summary of a sweep."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        raise SystemExit("usage: python -m specdec.study.sweep <multirun folder> [swept key ...]")
    if not Path(args[0]).is_dir():
        raise SystemExit(f"Error: {args[0]} is not a folder; give a sweep's multirun folder (multirun/<date>/<time>)")
    keys, rows = collect(Path(args[0]), args[1:] or None)
    csv_path, png_path = summarize_sweep(args[0], keys)
    print(f"{format_rows(keys, rows)}\nwrote {csv_path}" + (f" and {png_path}" if png_path else ""))


if __name__ == "__main__":
    main()
