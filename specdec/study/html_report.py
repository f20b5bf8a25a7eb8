"""One HTML page a person can open offline: per run, per sweep and per comparison (`report.html`).

The page holds everything in itself: inline CSS, the figures as base64 PNG, no script and no
link to anything on a network. It shows the tables (the markdown tables the commands print, with
their 95% intervals where the summary has them), the figures, the configuration the run was composed
from, and provenance: the git commit of the code (where it is a git checkout), the versions of
Python and the packages that shaped the numbers, the device, and the date the page was written.

A report is a convenience, like the figures: the callers write it after the results files, and a
failure to write it is a warning, never a lost run.
"""

from __future__ import annotations

import base64
import datetime
import html
import json
import platform
import re
import subprocess
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

REPORT_NAME = "report.html"
PACKAGES = ("specdec", "torch", "transformers", "numpy", "matplotlib", "hydra-core", "wandb")

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: #222;
       margin: 0 auto; max-width: 1200px; padding: 1.5em 2em 4em; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
h2 { font-size: 1.15em; border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 2em; }
.context { color: #555; margin-top: 0; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 13px; }
th, td { border: 1px solid #d0d0d0; padding: 0.25em 0.6em; }
th { background: #f3f3f3; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tr:nth-child(even) td { background: #fafafa; }
figure { margin: 1em 0 2em; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #555; font-size: 12px; }
pre { background: #f6f8fa; padding: 0.8em; overflow-x: auto; font-size: 12px; border-radius: 4px; }
code { background: #f6f8fa; padding: 0 0.2em; border-radius: 3px; }
dl.provenance { display: grid; grid-template-columns: max-content auto; gap: 0.2em 1em; }
dl.provenance dt { font-weight: 600; }
dl.provenance dd { margin: 0; }
"""


# ---------------------------------------------------------------- provenance


def git_commit(where: Path | None = None) -> str | None:
    """The commit of the checkout holding `where` (default: this package), `+dirty` when tracked files
    differ from it; None outside a git checkout or without git."""
    where = Path(where or Path(__file__).resolve().parent)
    try:
        commit = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + (" +dirty" if dirty else "") if commit else None


def versions(packages: Iterable[str] = PACKAGES) -> dict[str, str]:
    """Python's version and each installed package's (from its metadata: nothing is imported)."""
    out = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def provenance(summaries: Iterable[Mapping] = ()) -> dict[str, str]:
    """What produced the page: git commit, versions, device (and dtype) of the runs, host, date."""
    summaries = list(summaries)
    devices = dict.fromkeys(f"{s.get('device')} {s.get('dtype')}" for s in summaries if s.get("device"))
    out = {"git commit": git_commit() or "not available (not a git checkout)",
           **{f"version: {k}": v for k, v in versions().items()},
           "device": ", ".join(devices) or "not recorded", "host": platform.node() or "unknown",
           "platform": platform.platform(), "written": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    return out


# ---------------------------------------------------------------- markdown -> HTML


def _inline(text: str) -> str:
    """Escape, then `code` and **bold**: the only markup the tables use."""
    text = html.escape(text)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", text)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table(lines: list[str]) -> str:
    head = _cells(lines[0])
    align = _cells(lines[1]) if len(lines) > 1 and set(lines[1].replace("|", "").strip()) <= set("-: ") else None
    body = lines[2:] if align else lines[1:]
    right = [a.endswith(":") for a in align] if align else [False] * len(head)

    def cls(i: int) -> str:
        return ' class="num"' if i < len(right) and right[i] else ""

    rows = ["<tr>" + "".join(f"<th{cls(i)}>{_inline(c)}</th>" for i, c in enumerate(head)) + "</tr>"]
    rows += ["<tr>" + "".join(f"<td{cls(i)}>{_inline(c)}</td>" for i, c in enumerate(_cells(line))) + "</tr>"
             for line in body]
    return "<table>\n" + "\n".join(rows) + "\n</table>"


def markdown_to_html(text: str) -> str:
    """The printed tables as HTML: `|` blocks become tables, other lines paragraphs."""
    out, block, para = [], [], []

    def flush() -> None:
        if block:
            out.append(_table(block))
            block.clear()
        if para:
            out.append("<p>" + "<br>\n".join(_inline(p) for p in para) + "</p>")
            para.clear()

    for line in text.splitlines():
        if line.lstrip().startswith("|"):
            if para:
                flush()
            block.append(line)
        elif not line.strip():
            flush()
        else:
            if block:
                flush()
            para.append(line)
    flush()
    return "\n".join(out)


# ---------------------------------------------------------------- the page


def image(path: Path, caption: str = "") -> str:
    """A PNG file as an <img> with its bytes inline (base64), in a <figure>."""
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    alt = html.escape(caption or Path(path).stem)
    cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
    return f'<figure><img alt="{alt}" src="data:image/png;base64,{data}">{cap}</figure>'


def preformatted(text: str, title: str | None = None) -> str:
    pre = f"<pre>{html.escape(text)}</pre>"
    return f"<details><summary>{html.escape(title)}</summary>{pre}</details>" if title else pre


def definitions(items: Mapping[str, Any]) -> str:
    return '<dl class="provenance">' + "".join(
        f"<dt>{html.escape(str(k))}</dt><dd>{html.escape(str(v))}</dd>" for k, v in items.items()) + "</dl>"


def page(title: str, context: str, sections: list[tuple[str, str]]) -> str:
    """A whole page: the title, the context line, then each (heading, HTML body)."""
    parts = [f"<h2>{html.escape(h)}</h2>\n{body}" for h, body in sections if body]
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{html.escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
            f"<h1>{html.escape(title)}</h1>\n<p class=\"context\">{html.escape(context)}</p>\n"
            + "\n".join(parts) + "\n</body>\n</html>\n")


def _figures(figures: Mapping[str, Path]) -> str:
    return "\n".join(image(p, name.replace("_", " ")) for name, p in figures.items() if Path(p).is_file())


def _yaml(config: Any) -> str:
    """The composed config as YAML (JSON where omegaconf is missing)."""
    try:
        from omegaconf import OmegaConf

        return OmegaConf.to_yaml(OmegaConf.create(config))
    except Exception:  # not installed, or a value OmegaConf does not take
        return json.dumps(config, indent=2, default=str)


def _write(path: Path, text: str) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


def write_run_report(out_dir: Path, summary: dict, table: str, config: Mapping | None,
                     figures: Mapping[str, Path]) -> Path:
    """`out_dir/report.html` for one run: its tables, figures, composed config, summary and provenance."""
    from specdec.study.figures import context_line

    name = summary.get("method", "run")
    title = f"specdec run: {name}" + ("" if summary.get("lossless", True) else " (lossy)")
    if summary.get("complete") is False:
        title += " (incomplete" + (f": {summary['error']}" if summary.get("error") else "") + ")"
    sections = [("Results", markdown_to_html(table)), ("Figures", _figures(figures)),
                ("Configuration", preformatted(_yaml(config)) if config is not None else ""),
                ("Summary", preformatted(json.dumps(summary, indent=2, default=str), "summary.json")),
                ("Provenance", definitions(provenance([summary])))]
    return _write(Path(out_dir) / REPORT_NAME, page(title, context_line([summary]), sections))


def write_sweep_report(sweep_dir: Path, table: str, figures: Mapping[str, Path], context: str,
                       summaries: Iterable[Mapping] = ()) -> Path:
    """`sweep_dir/report.html`: the sweep's table (a line per job), its figure, the multirun's config
    (Hydra's multirun.yaml) and provenance."""
    sweep_dir = Path(sweep_dir)
    multirun = sweep_dir / "multirun.yaml"
    config = multirun.read_text(encoding="utf-8") if multirun.is_file() else ""
    sections = [("Jobs", markdown_to_html(table)), ("Figures", _figures(figures)),
                ("Configuration (multirun.yaml)", preformatted(config) if config else ""),
                ("Provenance", definitions(provenance(summaries)))]
    return _write(sweep_dir / REPORT_NAME, page(f"specdec sweep: {sweep_dir.name}", context, sections))


COMPARE_REPORT = "compare.html"
COMPARE_FIGURE = "compare_speedup"


def comparison_entries(comparison: Any) -> list[dict]:
    """The bars of `figures.comparison_figure`, one per row of a `specdec.study.compare.Comparison`:
    the row's label, method, lossless mark and its summary blocks (with their intervals)."""
    from specdec.study.figures import OVERALL

    runs = {str(run.path): run for run in comparison.runs}
    entries = []
    for row in comparison.rows:
        block = runs[row["path"]].summary["methods"][row["method"]]
        label = " ".join(x for x in (row["run"], row["method"], row["args"] if row["args"] != "-" else "") if x)
        entries.append({"label": label, "method": row["method"], "lossless": row["lossless"],
                        "blocks": {**block.get("categories", {}), OVERALL: block.get("overall", {})}})
    return entries


def write_comparison_report(out_dir: Path, comparison: Any, figures: Mapping[str, Path] | None = None) -> Path:
    """`out_dir/compare.html` for a `specdec.study.compare.Comparison`, with its figure
    (`compare_speedup.png` and `.pdf`, drawn here) and any other `figures`: the table, every run
    compared (label, folder, settings) and provenance."""
    from specdec.study.figures import comparison_figure, context_line, save

    out_dir = Path(out_dir)
    summaries = [run.summary for run in comparison.runs]
    context = context_line(summaries)
    bars = save(comparison_figure(comparison_entries(comparison), comparison.categories, context), out_dir,
                COMPARE_FIGURE)
    keys = ("method", "target", "draft", "data", "num_prompts", "device", "dtype", "temperature", "complete")
    head = "| run | folder | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 2)
    lines = [f"| {run.label} | `{run.path}` | " + " | ".join(str(run.summary.get(k, "-")) for k in keys) + " |"
             for run in comparison.runs]
    sections = [("Comparison", markdown_to_html(comparison.table)),
                ("Figures", _figures({"speedup per category": bars, **(figures or {})})),
                ("Runs", markdown_to_html("\n".join([head, *lines]))),
                ("Provenance", definitions(provenance(summaries)))]
    return _write(out_dir / COMPARE_REPORT, page("specdec comparison", context, sections))
