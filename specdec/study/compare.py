"""Compare any finished runs: one Spec-Bench-style table across run and sweep folders, a CSV and a plot.

    python -m specdec.study.compare <run or sweep folder>... [--out DIR] [--columns a,b,...] [--baseline]
                                    [--latex FILE]

Each argument is a run folder (it holds `summary.json`), a sweep folder (its job folders hold them), or
any folder above them; runs need not come from one launch. Every method measured in a run is one row
(plain decoding, the baseline and exact greedy's reference, only with `--baseline`; a method two runs
measured is labelled by run, `ngram @ launch_a/ngram`): the method, its arguments (k, schedule,
verifier, the proposer's or decoder's own arguments), target, draft, dtype, temperature, the overall
numbers and the speedup per category. A run that stopped midway (`"complete": false`) is marked
`(incomplete)`; a job folder with no summary.json at all is listed under the table.

Speedup, tau and alpha carry their 95% intervals (`1.36x [1.21, 1.50]`, specdec.study.intervals) and
the counts behind them (prompts, steps); a cell that cannot be told from noise ends in `~`, which a
legend line under the table explains. Summaries written before intervals existed show the value alone.

Writes `compare.csv` (every number of every row, per category too, intervals and counts included),
`compare.png` (speedup by row and category) and `compare.tex` (a booktabs table of methods by
category, speedup with its interval and tau, as the Spec-Bench and EAGLE papers lay theirs out;
`--latex FILE` writes it elsewhere) into `--out` (default: the first folder given).

A method's arguments come from summary.json's `method_configs`. Summaries written before it existed
fall back, in `method_configs_of` only, to the composed config Hydra saved beside them
(`.hydra/config.yaml`), then to the command-line overrides (`.hydra/overrides.yaml`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.study import intervals, report
from specdec.study.report import BASELINE, OVERALL, _model, markdown_table, write_csv
from specdec.study.results import MethodResults

CSV_NAME = "compare.csv"
LATEX_NAME = "compare.tex"
PLOT_NAME = "compare.png"
SKIP_PARTS = {".submitit", "wandb", ".hydra"}  # folders that never hold a run's summary.json


@dataclass
class Run:
    """One run folder: its summary and the full config of every method it measured."""

    path: Path
    label: str
    summary: dict
    method_configs: dict[str, dict]

    @property
    def complete(self) -> bool:
        return self.summary.get("complete", True) is not False


# ---------------------------------------------------------------- finding and reading runs


def find_runs(paths: list[str | Path]) -> tuple[list[Path], list[Path]]:
    """(summary.json files, job folders that have Hydra's files but no summary.json) under `paths`.
    Raises FileNotFoundError naming a path that does not exist or holds no run at all."""
    summaries: list[Path] = []
    unfinished: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file or folder")
        if path.is_file():
            if path.name != "summary.json":
                raise FileNotFoundError(f"{path}: give a run folder, a sweep folder or a summary.json")
            found, jobs = [path], []
        else:
            found = [p for p in sorted(path.rglob("summary.json")) if not SKIP_PARTS & set(p.relative_to(path).parts)]
            jobs = [h.parent for h in sorted(path.rglob(".hydra"))
                    if not (h.parent / "summary.json").is_file() and not SKIP_PARTS & set(h.parent.relative_to(path).parts)]
        if not found and not jobs:
            raise FileNotFoundError(f"{path}: no summary.json in it or below it; give a run folder (with "
                                    "summary.json) or a sweep folder of job folders")
        summaries += [p for p in found if p not in summaries]
        unfinished += [j for j in jobs if j not in unfinished]
    summaries.sort(key=_natural)
    unfinished.sort(key=_natural)
    return summaries, unfinished


def _natural(path: Path) -> tuple:
    """Job folders 0, 1, ..., 10 in numeric order."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.parts)


def load_runs(summary_paths: list[Path]) -> list[Run]:
    """Read every summary.json; labels are the run folders relative to their common ancestor."""
    dirs = [p.parent.resolve() for p in summary_paths]
    runs = []
    for path, run_dir in zip(summary_paths, dirs):
        try:
            summary = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from None
        if not isinstance(summary, dict) or "methods" not in summary:
            raise ValueError(f"{path}: not the summary of a specdec run (it has no `methods`)")
        runs.append(Run(path.parent, _label(run_dir, dirs), summary, method_configs_of(summary, path.parent)))
    return runs


def _label(run_dir: Path, dirs: list[Path]) -> str:
    if len(dirs) == 1:
        return run_dir.name
    common = Path(*_common_parts(dirs))
    rel = run_dir.relative_to(common)
    return str(rel) if rel.parts else run_dir.name


def _common_parts(dirs: list[Path]) -> list[str]:
    parts = list(dirs[0].parts)
    for d in dirs[1:]:
        n = 0
        while n < min(len(parts), len(d.parts)) and parts[n] == d.parts[n]:
            n += 1
        parts = parts[:n]
    return parts


def method_configs_of(summary: dict, run_dir: Path) -> dict[str, dict]:
    """Every method's config by name: from summary.json, else from the Hydra files beside it (older runs)."""
    if "method_configs" in summary:
        return summary["method_configs"]
    from omegaconf import OmegaConf

    composed = run_dir / ".hydra" / "config.yaml"
    if composed.is_file():
        cfg = OmegaConf.load(composed)
        nodes = [cfg.get("method")] + list((cfg.get("compare") or {}).values())
        configs = [OmegaConf.to_container(n, resolve=False) for n in nodes if n is not None]
        return {c["name"]: c for c in configs if isinstance(c, dict) and "name" in c}
    overrides = run_dir / ".hydra" / "overrides.yaml"
    if overrides.is_file():  # only what the command line changed, on top of the method's own file
        items = [str(o) for o in OmegaConf.to_container(OmegaConf.load(overrides))]
        config: dict[str, Any] = {}
        for key, value in (o.lstrip("+~").split("=", 1) for o in items if "=" in o):
            if key.startswith("method."):
                node = config
                *parents, leaf = key.removeprefix("method.").split(".")
                for p in parents:
                    node = node.setdefault(p, {})
                node[leaf] = value
        return {summary["method"]: config}
    return {}


# ---------------------------------------------------------------- rows


def method_args(config: dict | None, summary: dict, name: str, verifier: str | None) -> str:
    """`k=4 constant greedy exit_layer=4`: k, schedule (with its arguments), the verifier that ran
    (with its arguments), then the proposer's or decoder's own arguments. '-' for plain decoding."""
    config = config or {}
    part = config.get("proposer") or config.get("decoder") or {}
    if name == BASELINE or (("proposer" in config or "decoder" in config) and not part):
        return "-"
    k = config.get("num_speculative_tokens", summary.get("num_speculative_tokens") if name == summary["method"] else None)
    schedule = config.get("schedule", summary.get("schedule") if name == summary["method"] else None)
    args = [f"k={k}"] if k not in (None, 0, "0") else []
    if schedule is not None and not config.get("decoder"):  # a whole decoder (an anchor) takes no schedule
        args.append(schedule + _call_args(config.get("schedule_args")))
    if verifier is not None:
        args.append(verifier + _call_args(config.get("verifier_args")))
    if isinstance(part, dict):
        args += [f"{key}={value}" for key, value in part.items() if key != "_target_"]
    return " ".join(args) or "-"


def _call_args(args: dict | None) -> str:
    return "(" + ", ".join(f"{k}={v}" for k, v in args.items()) + ")" if args else ""


def rows_of(run: Run, with_baseline: bool = False) -> list[dict]:
    """One row per method of the run: identity, arguments, overall numbers, `<category>/<metric>`."""
    s = run.summary
    methods = {name: MethodResults.from_dict(block) for name, block in s["methods"].items()}
    plain = {BASELINE, s.get("exact_greedy_reference")}  # plain decoding, one token wide and exact greedy's
    names = [n for n in methods if n not in plain or with_baseline or len(methods) == 1]
    rows = []
    for name in names:
        block = methods[name]
        row: dict[str, Any] = {
            "run": run.label + ("" if run.complete else " (incomplete)"),
            "complete": run.complete,
            "method": name,
            "label": name,  # unique across the comparison (`label_rows`)
            "args": method_args(run.method_configs.get(name), s, name, block.verifier),
            "target": _model(s, "target"),
            "draft": _model(s, "draft") if _needs_draft(run.method_configs.get(name), s, name) else "none",
            "dtype": s.get("dtype"),
            "temperature": s.get("temperature"),
            "data": s.get("data"),
            "num_prompts": block.overall.num_prompts,
            "lossless": block.lossless,
            "verifier": block.verifier,
            "exact_greedy": block.exact_greedy,
            "baseline_tokens_per_s": methods[BASELINE].overall.tokens_per_s if BASELINE in methods
            else s.get("baseline_tokens_per_s"),
        }
        row.update({key: value for key, value in block.overall.to_dict().items() if not isinstance(value, (list, dict))})
        for category, m in block.categories.items():
            for key in ("speedup", "mean_accepted_length", "acceptance_rate", "tokens_per_s"):
                low, high = m.interval(key)
                row.update({f"{category}/{key}": getattr(m, key), f"{category}/{key}_ci_low": low,
                            f"{category}/{key}_ci_high": high})
            row.update({f"{category}/{key}": getattr(m, key) for key in ("num_prompts", "num_repeats", "steps")})
        row["path"] = str(run.path)
        rows.append(row)
    return rows


def label_rows(rows: list[dict]) -> list[dict]:
    """Each row's `label`: its method's name, or, where rows of several runs measured a method of the
    same name, `<method> @ <run>`, so that two runs of one method stay two rows that say which is
    which (a run names its own methods apart: `specdec.study.variants`)."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["method"]] = counts.get(row["method"], 0) + 1
    for row in rows:
        row["label"] = row["method"] if counts[row["method"]] == 1 else f"{row['method']} @ {row['run']}"
    return rows


def _needs_draft(config: dict | None, summary: dict, name: str) -> bool:
    if config and "needs_draft" in config:
        return bool(config["needs_draft"])
    return name == summary["method"] and summary.get("draft") not in (None, "none")


def categories_of(runs: list[Run]) -> list[str]:
    """Categories in the order runs first list them."""
    return list(dict.fromkeys(c for r in runs for c in r.summary.get("categories", [])))


# ---------------------------------------------------------------- the table


def _num(x: Any, spec: str, suffix: str = "") -> str:
    if x is None or isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return "-"
    return f"{x:{spec}}{suffix}"


def _cell(r: dict, name: str, spec: str, suffix: str = "", category: str | None = None) -> str:
    """`name` of a row (`category`: of one of its categories) with its interval and mark
    (`report.interval_cell`); the value alone for a summary without intervals, and for the baseline's
    own speedup."""
    at = f"{category}/" if category else ""
    repeats = r.get(f"{at}num_repeats") or 0
    shown = repeats > 0 and not (name == "speedup" and r["method"] == BASELINE)
    return report.interval_cell(r.get(f"{at}{name}"), r.get(f"{at}{name}_ci_low"), r.get(f"{at}{name}_ci_high"),
                                r.get(f"{at}steps"), spec, suffix, 1.0 if name == "speedup" else None, shown, repeats)


Column = tuple[str, Callable[[dict], str]]
COLUMNS: dict[str, Column] = {
    "run": ("run", lambda r: r["run"]),
    "method": ("method", lambda r: r.get("label", r["method"]) + ("" if r["lossless"] is not False else " (lossy)")),
    "args": ("arguments", lambda r: r["args"]),
    "target": ("target", lambda r: str(r["target"])),
    "draft": ("draft", lambda r: str(r["draft"])),
    "dtype": ("dtype", lambda r: str(r["dtype"])),
    "temperature": ("T", lambda r: _num(r["temperature"], "g")),
    "speedup": ("speedup", lambda r: _cell(r, "speedup", ".2f", "x")),
    "spread": ("per-prompt median (min-max)", lambda r: f"{_num(r.get('speedup_median'), '.2f')} "
               f"({_num(r.get('speedup_min'), '.2f')}-{_num(r.get('speedup_max'), '.2f')})"),
    "tok/s": ("tok/s", lambda r: _num(r.get("tokens_per_s"), ".1f")),
    "base_tok/s": ("base tok/s", lambda r: _num(r.get("baseline_tokens_per_s"), ".1f")),
    "tau": ("tau", lambda r: _cell(r, "mean_accepted_length", ".2f")),
    "alpha": ("alpha", lambda r: _cell(r, "acceptance_rate", ".2f")),
    "prompts": ("prompts", lambda r: _num(r.get("num_prompts"), "d")),
    "repeats": ("repeats", lambda r: _num(r.get("num_repeats"), "d")),
    "steps": ("steps", lambda r: _num(r.get("steps"), "d")),
    "predicted": ("predicted", lambda r: _num(r.get("predicted_speedup"), ".2f", "x")),
    "measured/predicted": ("measured/predicted", lambda r: _num(r.get("measured_over_predicted"), ".2f")),
    "c": ("c", lambda r: _num(r.get("c"), ".2f")),
    "verify_cost": ("verify cost", lambda r: _num(r.get("verify_cost"), ".2f")),
    "ttft": ("TTFT s", lambda r: _num(r.get("ttft_s"), ".3f")),
    "=baseline": ("= baseline", lambda r: _num(r.get("matches_baseline"), ".0%")),
    "lossless": ("lossless", lambda r: {True: "yes", False: "**no**"}.get(r["lossless"], "-")),
}
DEFAULT_COLUMNS = ["run", "method", "args", "target", "draft", "dtype", "temperature", "speedup", "tok/s",
                   "tau", "alpha", "prompts", "steps", "lossless"]


def format_table(rows: list[dict], columns: list[str], categories: list[str]) -> str:
    """Markdown: the chosen columns, then the speedup of every category with its interval (tau in
    parentheses); a legend line under it where any row has intervals."""
    unknown = [c for c in columns if c not in COLUMNS]
    if unknown:
        raise ValueError(f"unknown column(s) {unknown}; choose from: {', '.join(COLUMNS)}")
    heads = [COLUMNS[c][0] for c in columns] + categories
    text_cols = {"run", "method", "args", "target", "draft", "dtype", "lossless"}
    cells = []
    for r in rows:
        line = [COLUMNS[c][1](r) for c in columns]
        for cat in categories:
            speedup = r.get(f"{cat}/speedup")
            line.append("-" if speedup is None else
                        f"{_cell(r, 'speedup', '.2f', 'x', cat)} ({_num(r.get(f'{cat}/mean_accepted_length'), '.2f')})")
        cells.append(line)
    lines = markdown_table(heads, cells, left=[i for i, c in enumerate(columns) if c in text_cols])
    repeats = {r.get("num_repeats") or 0 for r in rows} - {0}
    if repeats:
        lines += ["", report.legend(repeats.pop() if len(repeats) == 1 else None)]
    return "\n".join(lines)


# ---------------------------------------------------------------- LaTeX

_LATEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_ESCAPES.get(ch, ch) for ch in str(text))


def _latex_speedup(r: dict, category: str | None) -> str:
    """`1.36$\\times$ {\\scriptsize [1.21, 1.50]}`, and a dagger where the markdown cell has `report.MARK`."""
    at = f"{category}/" if category else ""
    value = r.get(f"{at}speedup")
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return "--"
    cell = _cell(r, "speedup", ".2f", "x", category)
    text = f"{value:.2f}$\\times$"
    if "[" in cell:
        text += f" {{\\scriptsize [{r[f'{at}speedup_ci_low']:.2f}, {r[f'{at}speedup_ci_high']:.2f}]}}"
    return text + ("$^\\dagger$" if cell.endswith(report.MARK) else "")


def latex_table(rows: list[dict], categories: list[str]) -> str:
    """A booktabs table: one line per row (method); per category, then overall, the speedup with its 95%
    interval and tau, as the EAGLE papers lay out speedup and tau per benchmark (Spec-Bench's
    categories, its overall column last); a lossless mark per method. Needs booktabs and amssymb."""
    groups = [*categories, OVERALL]
    head = " & ".join(f"\\multicolumn{{2}}{{c}}{{{latex_escape(g.replace('_', ' '))}}}" for g in groups)
    lines = [
        "% python -m specdec.study.compare; needs \\usepackage{booktabs} and \\usepackage{amssymb}",
        "\\begin{table}[t]",
        "\\centering",
        "\\small",
        f"\\begin{{tabular}}{{lc{'rr' * len(groups)}}}",
        "\\toprule",
        f" & & {head} \\\\",
        " ".join(f"\\cmidrule(lr){{{3 + 2 * i}-{4 + 2 * i}}}" for i in range(len(groups))),
        "Method & Lossless & " + " & ".join("Speedup & $\\tau$" for _ in groups) + " \\\\",
        "\\midrule",
    ]
    for r in rows:
        cells = [latex_escape(r.get("label", r["method"])),
                 {True: "\\checkmark", False: "$\\times$"}.get(r["lossless"], "--")]
        for g in groups:
            category = None if g == OVERALL else g
            tau = _num(r.get(f"{g}/mean_accepted_length" if category else "mean_accepted_length"), ".2f")
            cells += [_latex_speedup(r, category), "--" if tau == "-" else tau]
        lines.append(" & ".join(cells) + " \\\\")
    repeats = {r.get("num_repeats") or 0 for r in rows} - {0}
    over = "prompts" + (" and repeats" if max(repeats, default=1) > 1 else "")
    caption = ("Speedup over autoregressive decoding and mean accepted length $\\tau$ per category. "
               + (f"Brackets: 95\\% bootstrap interval over {over} ({intervals.RESAMPLES:,} resamples). "
                  f"$^\\dagger$: the interval includes 1.0$\\times$, or the speedup rests on fewer than "
                  f"{intervals.MIN_STEPS} steps or on one prompt. " if repeats else "")
               + "Lossless: \\checkmark{} where the verifier keeps the target's output distribution.")
    lines += ["\\bottomrule", "\\end{tabular}", f"\\caption{{{caption}}}", "\\end{table}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- files


def row_label(row: dict) -> str:
    return " ".join(x for x in (row["run"], row["method"], row["args"] if row["args"] != "-" else "") if x)


def plot(rows: list[dict], categories: list[str], path: Path) -> Path:
    """A heat map of speedup, one line per row and one column per category plus overall, each cell
    written out; colours diverge at 1.0 (red slower than plain decoding, blue faster)."""
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure

    cols = categories + [OVERALL]
    values = [[_finite(r.get(f"{c}/speedup") if c != OVERALL else r.get("speedup")) for c in cols] for r in rows]
    finite = [v for line in values for v in line if v == v]
    lo, hi = min(finite + [0.9]), max(finite + [1.1])
    fig = Figure(figsize=(max(6.0, 1.0 * len(cols) + 4.0), max(2.5, 0.38 * len(rows) + 1.6)))
    ax = fig.add_subplot()
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(lo, 0.99), vmax=max(hi, 1.01))
    image = ax.imshow(values, cmap="RdBu", norm=norm, aspect="auto")
    for i, line in enumerate(values):
        for j, v in enumerate(line):
            dark = v == v and abs(float(norm(v)) - 0.5) > 0.3  # white text on the saturated ends
            ax.text(j, i, "-" if v != v else f"{v:.2f}", ha="center", va="center", fontsize=8,
                    color="white" if dark else "black")
    ax.set_xticks(range(len(cols)), cols, rotation=30, ha="right")
    ax.set_yticks(range(len(rows)), [row_label(r) for r in rows], fontsize=8)
    ax.set_title("speedup over autoregressive, by run and category")
    fig.colorbar(image, ax=ax, label="speedup")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _finite(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else float("nan")


# ---------------------------------------------------------------- the command


@dataclass
class Comparison:
    runs: list[Run]
    rows: list[dict]
    categories: list[str]
    unfinished: list[Path]
    table: str


def compare(paths: list[str | Path], columns: list[str] | None = None, with_baseline: bool = False) -> Comparison:
    """Find, read and tabulate the runs under `paths` (nothing is written)."""
    summaries, unfinished = find_runs(paths)
    runs = load_runs(summaries)
    rows = label_rows([row for run in runs for row in rows_of(run, with_baseline)])
    categories = categories_of(runs)
    table = format_table(rows, columns or DEFAULT_COLUMNS, categories) if rows else ""
    if unfinished:
        table += ("\n\n" if table else "") + "no summary.json (failed or not started): " + ", ".join(
            str(j) for j in unfinished)
    return Comparison(runs, rows, categories, unfinished, table)


def _write_report(result: Comparison, out: Path, heat_map: Path | None) -> None:
    """compare.html and the speedup figure (specdec.study.html_report); a failure is a line on stderr."""
    from specdec.study.html_report import write_comparison_report

    try:
        page = write_comparison_report(out, result, {"speedup heat map": heat_map} if heat_map else {})
    except Exception as exc:  # the CSV is the result
        print(f"compare.html failed ({type(exc).__name__}: {exc})", file=sys.stderr)
        return
    print(f"wrote {page}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.study.compare", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="run folders, sweep folders, or folders above them")
    parser.add_argument("--out", help="folder for compare.csv and compare.png (default: the first path)")
    parser.add_argument("--columns", help=f"comma-separated, from: {', '.join(COLUMNS)} "
                                          f"(default: {','.join(DEFAULT_COLUMNS)})")
    parser.add_argument("--baseline", action="store_true", help="also a row for each run's autoregressive baseline")
    parser.add_argument("--latex", help=f"the LaTeX table's file (default: {LATEX_NAME} in --out)")
    args = parser.parse_args(argv)
    columns = args.columns.split(",") if args.columns else None
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        print(f"specdec.study.compare: --out {args.out} is a file; --out takes a folder (compare.csv and "
              "compare.png are written into it)", file=sys.stderr)
        return 2
    try:
        if columns:
            format_table([], columns, [])  # an unknown column fails before any file is read
        result = compare(args.paths, columns, args.baseline)
    except (FileNotFoundError, ValueError) as err:
        print(f"specdec.study.compare: {err}", file=sys.stderr)
        return 2
    print(result.table)
    if not result.rows:
        return 1
    first = Path(args.paths[0])
    out = Path(args.out) if args.out else (first if first.is_dir() else first.parent)
    try:
        out.mkdir(parents=True, exist_ok=True)
        csv_path = write_csv(result.rows, out / CSV_NAME)
    except OSError as err:  # a file on the way, no permission, a full disk
        print(f"specdec.study.compare: cannot write {out / CSV_NAME} ({err.strerror or err}); choose another "
              "--out", file=sys.stderr)
        return 2
    tex_path = Path(args.latex) if args.latex else out / LATEX_NAME
    try:
        tex_path.write_text(latex_table(result.rows, result.categories), encoding="utf-8")
    except OSError as err:
        print(f"specdec.study.compare: cannot write {tex_path} ({err.strerror or err}); choose another "
              "--latex file", file=sys.stderr)
        return 2
    try:
        png_path: Path | None = plot(result.rows, result.categories, out / PLOT_NAME)
    except Exception as exc:  # the CSV is the result; a plot failure must not hide it
        print(f"plot failed ({type(exc).__name__}: {exc})", file=sys.stderr)
        png_path = None
    print(f"\nwrote {csv_path}, {tex_path}" + (f" and {png_path}" if png_path else ""))
    _write_report(result, out, png_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
