"""W&B dashboards as code: the workspace or report a speculative-decoding study reads, built by a command.

    python -m specdec.study.dashboard --project P [--entity E] [--group SWEEP] [--kind workspace|report]
                                [--out FILE] [--offline] [--check RUN]

The panels answer the questions a study asks of its runs (one W&B run per job; `--group` keeps one
sweep): is it faster, by method and k (speedup, tokens/s against the baseline's); how much is accepted
(mean acceptance length tau, acceptance rate, acceptance by draft position); where (speedup and tau
per category); does the cost model explain the speedup (measured against predicted, draft cost c);
what does the first token cost (TTFT); and is the output still the target's (the runs table shows
`lossless` and the verifier of every run, a bar chart the greedy `= baseline` fraction).

Panels name the keys `specdec.study.tracking` logs: the flattened summary.json (`speedup`,
`per_position_acceptance/<i>`, `per_category/<category>/speedup`, ...), the per-prompt history
(`prompt/speedup`, x axis `prompt/index`) and the run config (`method.name`,
`method.num_speculative_tokens`). `named_metrics` lists every key a definition names and
`missing_metrics` checks them against what a real run logged (`logged_keys` reads an offline run),
so a misspelt key fails a test instead of drawing an empty chart.

With `--offline`, `--out`, WANDB_MODE=offline/disabled or no W&B credentials, nothing leaves the
machine: the definition is built, validated (every panel converts to W&B's own panel spec, a
workspace also round-trips through its view spec) and written to a JSON or YAML file. Otherwise it is
saved to W&B and its URL printed.
"""

from __future__ import annotations

import argparse
import json
import netrc
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws
from pydantic import TypeAdapter
from wandb_workspaces import expr

from specdec.core.errors import MissingInput, first_line

# The categories of the prompt sets specdec ships: the built-in set and Spec-Bench (its eight MT-bench
# categories reported as `multi_turn`, conf/data/spec_bench.yaml). tests/test_dashboard.py checks
# this list against the data; `--categories` sets others (a data=hf set with its own categories).
DEFAULT_CATEGORIES = ("multi_turn", "conversation", "translation", "summarization", "qa", "math_reasoning", "rag")
DEFAULT_K_MAX = 8  # draft positions shown in the per-position acceptance chart
KINDS = ("workspace", "report")
OFFLINE_MODES = ("offline", "disabled", "dryrun")

# The runs table: what a run is (method, k, schedule, temperature) and whether its output is the target's.
RUN_COLUMNS = [wr.Config("method.name"), wr.Config("method.num_speculative_tokens"), wr.Config("method.schedule"),
               wr.Config("generation.temperature"), wr.SummaryMetric("lossless"), wr.SummaryMetric("verifier"),
               wr.SummaryMetric("speedup"), wr.SummaryMetric("tokens_per_s"),
               wr.SummaryMetric("mean_accepted_length"), wr.SummaryMetric("matches_baseline")]


@dataclass
class Section:
    """A named group of panels and the question it answers (a markdown note at its top)."""

    name: str
    about: str
    panels: list = field(default_factory=list)


def sections(categories: tuple[str, ...] | list[str] = DEFAULT_CATEGORIES, k_max: int = DEFAULT_K_MAX) -> list[Section]:
    """Every panel of the dashboard, by section. New panel objects on every call (a panel belongs to one
    definition)."""
    method, k = wr.Config("method.name"), wr.Config("method.num_speculative_tokens")
    positions = [f"per_position_acceptance/{i}" for i in range(1, k_max + 1)]
    return [
        Section("Speed", "Is it faster? `speedup` = the method's tokens/s over the autoregressive baseline's, "
                "measured in the same run, interleaved prompt by prompt. 1.0 = no gain.", [
            wr.BarPlot(title="speedup over autoregressive, per run", metrics=["speedup"]),
            wr.BarPlot(title="speedup by method (mean over runs, min-max)", metrics=["speedup"], groupby=method,
                       groupby_aggfunc="mean", groupby_rangefunc="minmax"),
            wr.ScatterPlot(title="speedup against k", x=k, y=wr.SummaryMetric("speedup")),
            wr.BarPlot(title="tokens/s: method and its baseline", metrics=["tokens_per_s", "baseline_tokens_per_s"]),
            wr.BarPlot(title="tokens/s by k (mean over runs)", metrics=["tokens_per_s"], groupby=k,
                       groupby_aggfunc="mean", groupby_rangefunc="minmax"),
            wr.ParallelCoordinatesPlot(title="method, k, schedule, temperature -> speed and acceptance", columns=[
                wr.ParallelCoordinatesPlotColumn(metric=m) for m in (
                    method, k, wr.Config("method.schedule"), wr.Config("generation.temperature"),
                    wr.SummaryMetric("speedup"), wr.SummaryMetric("tokens_per_s"),
                    wr.SummaryMetric("mean_accepted_length"))]),
            wr.LinePlot(title="speedup per prompt", x="prompt/index", y=["prompt/speedup"]),
        ]),
        Section("Acceptance", "How much of the draft survives? tau = tokens emitted per target pass (bonus "
                "token included; 1.0 = plain decoding); alpha = accepted / proposed draft tokens; per position "
                "i: P(draft token i accepted | the ones before it were).", [
            wr.BarPlot(title="mean acceptance length (tau)", metrics=["mean_accepted_length"]),
            wr.BarPlot(title="acceptance rate (alpha)", metrics=["acceptance_rate"]),
            wr.BarPlot(title="acceptance by draft position", metrics=positions),
            wr.LinePlot(title="tau per prompt", x="prompt/index", y=["prompt/mean_accepted_length"]),
        ]),
        Section("Categories", "Where does it help? Speedup and tau per prompt category (Spec-Bench: "
                "summarization and RAG copy from the prompt, translation rarely does).", [
            wr.BarPlot(title="speedup per category", metrics=[f"per_category/{c}/speedup" for c in categories]),
            wr.BarPlot(title="tau per category",
                       metrics=[f"per_category/{c}/mean_accepted_length" for c in categories]),
        ]),
        Section("Cost model", "Does acceptance explain the speed? predicted = E[tokens per step] / (c k + "
                "verify cost) from the measured per-position acceptance and step costs; measured below "
                "predicted means time goes outside drafting and scoring. c = one draft token's cost relative "
                "to one target step.", [
            wr.ScatterPlot(title="measured against predicted speedup", x=wr.SummaryMetric("predicted_speedup"),
                           y=wr.SummaryMetric("speedup")),
            wr.BarPlot(title="draft cost c (per token, relative to a target step)", metrics=["c"]),
        ]),
        Section("Latency", "Time to first token: prefill of the target (and the draft), before any "
                "speculation.", [
            wr.BarPlot(title="TTFT (s, mean over prompts)", metrics=["ttft_s"]),
            wr.LinePlot(title="TTFT per prompt (s)", x="prompt/index", y=["prompt/ttft_s"]),
        ]),
        Section("Lossless", "Is the output still the target's? `lossless` (runs table) is false only for "
                "lossy verifiers (typical acceptance). `matches_baseline` (greedy runs): the fraction of "
                "prompts whose tokens equal the baseline's; below 1 in bfloat16 from rounding, 1 in float32.", [
            wr.BarPlot(title="greedy output = baseline (fraction of prompts)", metrics=["matches_baseline"]),
        ]),
    ]


def _runs_filter(group: str | None) -> list:
    return [expr.Metric("Group") == group] if group else []


def _column(metric: Any) -> str:
    """A runs-table column accessor: `summary:<key>`, or `config:<top>.value.<rest>` for a config key."""
    if isinstance(metric, wr.Config):
        top, *rest = metric.name.split(".")
        return f"config:{top}.value" + "".join(f".{r}" for r in rest)
    return f"summary:{metric.name}"


def build_workspace(project: str, entity: str = "", group: str | None = None,
                    categories=DEFAULT_CATEGORIES, k_max: int = DEFAULT_K_MAX, name: str | None = None) -> ws.Workspace:
    """A saved W&B workspace (a view of the project's runs, or of one sweep group), one section per question."""
    return ws.Workspace(
        entity=entity, project=project, name=name or f"specdec{': ' + group if group else ''}",
        sections=[ws.Section(name=s.name, panels=[wr.MarkdownPanel(markdown=s.about), *s.panels], is_open=True)
                  for s in sections(categories, k_max)],
        runset_settings=ws.RunsetSettings(filters=_runs_filter(group),
                                          pinned_columns=[_column(m) for m in RUN_COLUMNS]),
    )


def build_report(project: str, entity: str = "", group: str | None = None,
                 categories=DEFAULT_CATEGORIES, k_max: int = DEFAULT_K_MAX, name: str | None = None) -> wr.Report:
    """A W&B report: the same sections, each a heading, its question and a panel grid over the runs."""
    blocks: list = [wr.P("Speculative decoding against plain autoregressive decoding on the same prompts, "
                         "one run per job. Made by `python -m specdec.study.dashboard`.")]
    for s in sections(categories, k_max):
        runset = wr.Runset(entity=entity, project=project, name=group or "all runs", filters=_runs_filter(group),
                           pinned_columns=[_column(m) for m in RUN_COLUMNS])
        blocks += [wr.H2(s.name), wr.P(s.about), wr.PanelGrid(runsets=[runset], panels=s.panels)]
    return wr.Report(project=project, entity=entity, title=name or f"specdec: {group or project}",
                     description="speedup, acceptance, categories, cost model, latency, losslessness",
                     blocks=blocks)


def build(kind: str, project: str, **kwargs: Any) -> ws.Workspace | wr.Report:
    if kind not in KINDS:
        raise ValueError(f"--kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return (build_workspace if kind == "workspace" else build_report)(project, **kwargs)


# ---------------------------------------------------------------- what a definition names


@dataclass(frozen=True)
class MetricRef:
    """One key a panel or the runs table names. kind: `summary` (run summary), `history` (a logged
    series) or `config` (a dotted run config key)."""

    kind: str
    name: str
    where: str


def _ref(metric: Any, default_kind: str, where: str) -> MetricRef:
    if isinstance(metric, wr.Config):
        return MetricRef("config", metric.name, where)
    if isinstance(metric, (wr.SummaryMetric, wr.Metric)):
        return MetricRef("summary" if isinstance(metric, wr.SummaryMetric) else default_kind, metric.name, where)
    return MetricRef(default_kind, str(metric), where)


def _panel_refs(panel: Any) -> list[MetricRef]:
    where = f"{type(panel).__name__} {getattr(panel, 'title', None) or ''}".strip()
    refs = []
    if isinstance(panel, wr.MarkdownPanel):
        return []
    if isinstance(panel, wr.LinePlot):
        if panel.x not in (None, "Step", "_step"):
            refs.append(_ref(panel.x, "history", where))
        refs += [_ref(m, "history", where) for m in panel.y]
    elif isinstance(panel, wr.BarPlot):
        refs += [_ref(m, "summary", where) for m in panel.metrics]
    elif isinstance(panel, wr.ScalarChart):
        refs.append(_ref(panel.metric, "summary", where))
    elif isinstance(panel, wr.ScatterPlot):
        refs += [_ref(m, "summary", where) for m in (panel.x, panel.y, panel.z) if m is not None]
    elif isinstance(panel, wr.ParallelCoordinatesPlot):
        refs += [_ref(c.metric, "summary", where) for c in panel.columns]
    else:
        raise TypeError(f"{type(panel).__name__}: named_metrics does not know which keys this panel type names; "
                        "add it to specdec.study.dashboard._panel_refs")
    if isinstance(getattr(panel, "groupby", None), wr.Config):
        refs.append(_ref(panel.groupby, "config", where))
    return refs


def _column_ref(column: str, where: str) -> MetricRef | None:
    section, _, name = column.partition(":")
    if section == "summary":
        return MetricRef("summary", name, where)
    if section == "config":
        top, _, rest = name.partition(".value")
        return MetricRef("config", top + rest, where)
    return None  # run attributes (run:displayName) are W&B's own


def _panels_and_columns(definition: ws.Workspace | wr.Report) -> tuple[list, list[str]]:
    if isinstance(definition, ws.Workspace):
        return ([p for s in definition.sections for p in s.panels],
                list(definition.runset_settings.pinned_columns))
    grids = [b for b in definition.blocks if isinstance(b, wr.PanelGrid)]
    return ([p for g in grids for p in g.panels],
            list(dict.fromkeys(c for g in grids for r in g.runsets for c in r.pinned_columns)))


def named_metrics(definition: ws.Workspace | wr.Report) -> list[MetricRef]:
    """Every key the definition's panels and runs table name, in order."""
    panels, columns = _panels_and_columns(definition)
    refs = [r for p in panels for r in _panel_refs(p)]
    refs += [r for c in columns if (r := _column_ref(c, "runs table")) is not None]
    return refs


def logged_keys(run: str | Path) -> dict[str, set[str]]:
    """The keys a W&B run logged, by kind: `summary`, `history`, `config` (dotted). `run` is a W&B run
    folder (`.../wandb/offline-run-*`), its `.wandb` file, or a specdec run folder holding `wandb/`.
    Reads local files only (`wandb leet inspect`)."""
    from specdec.study.tracking import flatten, inspect_offline_run

    path = _wandb_run(Path(run))
    inspected = inspect_offline_run(path)
    config = {k: v for k, v in inspected["config"].items() if not k.startswith("_")}
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    history: set[str] = set()
    for line in proc.stdout.splitlines():
        record = json.loads(line)
        if record.get("type") == "history":
            history.update(k for k in record["history"]["item"] if not k.startswith("_"))
    flat_config = {k.replace("/", ".") for k in flatten(config)}
    return {"summary": set(inspected["summary"]), "history": history, "config": flat_config}


def _wandb_run(path: Path) -> Path:
    """The W&B run `path` names (see `logged_keys`); MissingInput saying why there is none."""
    if not path.exists():
        raise MissingInput(f"{path}: no such file or folder; give a W&B run folder (wandb/offline-run-*), its "
                           ".wandb file, or a specdec run folder logged with logger=wandb")
    if path.suffix == ".wandb" or list(path.glob("*.wandb")):
        return path
    found = sorted(path.glob("wandb/*run-*"), key=lambda p: p.stat().st_mtime)
    if not found:
        made_without = " (a specdec run made without W&B: rerun it with logger=wandb, offline by default)" \
            if (path / "summary.json").is_file() else ""
        raise MissingInput(f"{path}: no W&B run here{made_without}; expected a wandb/offline-run-* folder or a "
                           ".wandb file")
    return found[-1]


def missing_metrics(definition: ws.Workspace | wr.Report, logged: dict[str, set[str]]) -> list[MetricRef]:
    """The keys the definition names that the run did not log (of the same kind)."""
    return [r for r in named_metrics(definition) if r.name not in logged.get(r.kind, set())]


# ---------------------------------------------------------------- validate, write, save


def validate(definition: ws.Workspace | wr.Report) -> None:
    """Offline checks, raising ValueError: every panel converts to W&B's panel spec and names at least
    one key; a workspace converts to its full view spec and reads back with the same sections."""
    panels, _ = _panels_and_columns(definition)
    for panel in panels:
        panel._to_model()  # pydantic checks of W&B's own panel spec
        if not isinstance(panel, wr.MarkdownPanel) and not _panel_refs(panel):
            raise ValueError(f"panel {getattr(panel, 'title', panel)!r} names no metric")
    if isinstance(definition, ws.Workspace):
        view = definition._to_model()
        back = ws.Workspace._from_model(type(view).model_validate(view.model_dump(by_alias=True)))
        if [s.name for s in back.sections] != [s.name for s in definition.sections]:
            raise ValueError("the workspace does not read back from its view spec with the same sections")
    else:
        for block in definition.blocks:
            if isinstance(block, wr.PanelGrid):  # a run set's project id needs the server: check its filter
                for runset in block.runsets:
                    expr.expr_to_filters(runset.filters)
            else:
                block._to_model()


def to_dict(definition: ws.Workspace | wr.Report) -> dict:
    """The definition as plain data: its kind, the SDK model dump, and the keys it names by kind."""
    kind = "workspace" if isinstance(definition, ws.Workspace) else "report"
    refs = named_metrics(definition)
    return {"kind": kind,
            "metrics": {k: sorted({r.name for r in refs if r.kind == k}) for k in ("summary", "history", "config")},
            "definition": TypeAdapter(type(definition)).dump_python(definition, mode="json")}


def write(definition: ws.Workspace | wr.Report, path: str | Path) -> Path:
    """Write `to_dict(definition)` as YAML (.yaml/.yml) or JSON (anything else)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = to_dict(definition)
    if path.suffix in (".yaml", ".yml"):
        import yaml

        path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    else:
        path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path


def offline_reason(offline_flag: bool, out: str | None) -> str | None:
    """Why nothing may be sent to W&B, or None when saving is possible. Reads no network."""
    if offline_flag:
        return "--offline"
    if out:
        return "--out"
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode in OFFLINE_MODES:
        return f"WANDB_MODE={mode}"
    if os.environ.get("WANDB_API_KEY"):
        return None
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        if netrc.netrc().authenticators(host):
            return None
    except (FileNotFoundError, netrc.NetrcParseError):
        pass
    return "no W&B credentials (WANDB_API_KEY or `wandb login`)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.study.dashboard", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", required=True, help="W&B project (logger.project of the runs)")
    parser.add_argument("--entity", help="W&B entity (default: your default entity when saving)")
    parser.add_argument("--group", help="only the runs of this group (a sweep's folder name)")
    parser.add_argument("--kind", default="workspace", choices=KINDS)
    parser.add_argument("--name", help="the workspace's name or the report's title")
    parser.add_argument("--out", help="write the definition to this .json/.yaml file instead of saving it")
    parser.add_argument("--offline", action="store_true", help="never contact W&B; write the definition to a file")
    parser.add_argument("--categories", help=f"comma-separated (default: {','.join(DEFAULT_CATEGORIES)})")
    parser.add_argument("--k-max", type=int, default=DEFAULT_K_MAX, help="draft positions to chart (default 8)")
    parser.add_argument("--check", metavar="RUN", help="check every key the panels name against what this "
                        "W&B run (or specdec run folder) logged; exit 1 if any is missing")
    args = parser.parse_args(argv)
    if args.k_max < 1:
        parser.error(f"--k-max must be >= 1, got {args.k_max}")
    if args.check:
        try:  # the run is found before anything is built, or W&B asked for an entity
            _wandb_run(Path(args.check))
        except MissingInput as err:
            print(f"specdec.study.dashboard: --check {err}", file=sys.stderr)
            return 2
    categories = tuple(c for c in args.categories.split(",") if c) if args.categories else DEFAULT_CATEGORIES
    reason = offline_reason(args.offline, args.out)
    entity = args.entity or ""
    if reason is None and not entity:
        try:
            import wandb

            entity = wandb.Api().default_entity or ""
        except Exception as exc:  # unreachable or refused: build and write the definition all the same
            reason = f"no default W&B entity ({type(exc).__name__}: {exc}); pass --entity"
    definition = build(args.kind, args.project, entity=entity, group=args.group, categories=categories,
                       k_max=args.k_max, name=args.name)
    validate(definition)
    if args.check:
        try:
            logged = logged_keys(args.check)
        except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired) as err:  # wandb cannot read the run
            print(f"specdec.study.dashboard: --check {args.check}: cannot read the W&B run ({first_line(err)})",
                  file=sys.stderr)
            return 2
        missing = missing_metrics(definition, logged)
        for ref in missing:
            print(f"not logged by {args.check}: {ref.kind} key {ref.name!r} ({ref.where})", file=sys.stderr)
        if missing:
            return 1
        print(f"every key the {args.kind} names is logged by {args.check}")
    if reason is not None:
        path = write(definition, args.out or f"specdec_{args.kind}.json")
        print(f"{args.kind} built and validated ({len(named_metrics(definition))} metric references); "
              f"not saved to W&B ({reason}); definition written to {path}")
        return 0
    try:
        saved = definition.save()
    except Exception as exc:  # no network, no access: keep the definition rather than lose it
        path = write(definition, f"specdec_{args.kind}.json")
        print(f"saving to W&B failed ({type(exc).__name__}: {exc}); definition written to {path}", file=sys.stderr)
        return 1
    print(saved.url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
