"""Figures a paper can use: speedup per category, acceptance per draft position, sweeps and comparisons.

Every figure here follows the same rules, so that figures from different runs read alike:

- One colour per method, everywhere: `method_colour` maps a method's name to a fixed colour (the
  methods in `conf/method/` by a table, any other name by a hash of it), so a method keeps its colour
  in every panel and every figure.
- Lossy methods are marked: hatched bars and hollow markers, `(lossy)` after the name in the legend,
  and a legend entry that says what the hatching means.
- A line joins points only along a numeric axis (k, a tree budget), with ticks at the values
  measured; a categorical axis (a method, a schedule) is drawn as grouped bars.
- Error bars come from the summary's 95% intervals (`<metric>_ci`) where it has them; without
  them the plain values are drawn, and the caption does not claim any.
- Acceptance per position is drawn only where enough drafts reached the position
  (`MIN_COUNT`), and each point is annotated with its count n.
- A subtitle names the context: target, prompt set, number of prompts, device and dtype.

`save` writes each figure as PNG (for the HTML report and W&B) and PDF (for a paper). Only the
matplotlib object API is used, on the Agg canvas: no pyplot, no global backend or figure state.
"""

from __future__ import annotations

import itertools
import math
import textwrap
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from specdec.core.metrics import sum_lists

BASELINE = "autoregressive"
OVERALL = "overall"
MIN_COUNT = 10  # drafts that reached a position before its acceptance rate is drawn
LOSSY_HATCH = "///"
LOSSY_NOTE = "hatched / hollow: lossy (not the target's distribution)"
MARKERS = ("o", "s", "^", "D", "v", "P", "X")  # series of one colour: a marker and a line style each
LINESTYLES = ("-", "--", ":", "-.")

# The methods of conf/method/, each with its colour for good (colour-blind-safe hues first).
METHOD_COLOURS = {
    "autoregressive": "#7f7f7f",
    "draft": "#0072b2",
    "draft_typical": "#56b4e9",
    "draft_forced": "#999933",
    "ngram": "#e69f00",
    "suffix": "#d55e00",
    "suffix_tree": "#cc79a7",
    "layer_skip": "#009e73",
    "medusa": "#882255",
    "eagle": "#332288",
    "eagle3": "#6699cc",
    "mtp": "#aa3377",
    "hybrid": "#117733",
    "hf_assisted": "#44aa99",
    "hf_prompt_lookup": "#ddcc77",
    "hf_generate": "#aa4499",
    "vllm": "#4d4d4d",
    "vllm_ngram": "#f0c571",
    "vllm_suffix": "#e08b5a",
}
# For any other name: a hue picked by the name's hash, away from the greys.
_EXTRA = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
          "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173"]


def base_name(name: str) -> str:
    """`ngram[num_speculative_tokens=2]` -> `ngram`: the method a named variant is one of."""
    return name.split("[", 1)[0]


def method_colour(name: str) -> str:
    """The colour of method `name`, the same in every figure and every process; the variants of a
    method (`ngram[...]`, `autoregressive[exact greedy, width 5]`) share their method's colour."""
    base = base_name(name)
    return METHOD_COLOURS.get(base) or _EXTRA[zlib.crc32(base.encode()) % len(_EXTRA)]


def _number_variants(series: list[dict]) -> list[dict]:
    """Series of one method share its colour: where a method has several, each gets a number (its
    "tag", written on its bars, and its "index", picking its marker and line style) and its label
    starts with the number."""
    counts: dict[str, int] = {}
    for s in series:
        counts[base_name(s["method"])] = counts.get(base_name(s["method"]), 0) + 1
    seen: dict[str, int] = {}
    out = []
    for s in series:
        base = base_name(s["method"])
        index = seen.get(base, 0)
        seen[base] = index + 1
        tag = str(index + 1) if counts[base] > 1 else None
        out.append({**s, "index": index, "tag": tag, "label": (f"[{tag}] " if tag else "") + s["label"]})
    return out


def label(name: str, lossless: bool | None) -> str:
    return name + (" (lossy)" if lossless is False else "")


# ---------------------------------------------------------------- reading summaries


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or x is None:
        return None
    try:
        value = float(x)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def interval(block: dict, key: str) -> tuple[float, float] | None:
    """The 95% interval of `key` in a summary block, where it has one: `<key>_ci` as [low, high] or
    {low, high}, or `<key>_ci_low` / `<key>_ci_high`. None when absent or not finite."""
    ci = block.get(f"{key}_ci")
    if isinstance(ci, dict):
        ci = [ci.get("low", ci.get("lo", ci.get("lower"))), ci.get("high", ci.get("hi", ci.get("upper")))]
    if not isinstance(ci, (list, tuple)) or len(ci) != 2:
        ci = [block.get(f"{key}_ci_low"), block.get(f"{key}_ci_high")]
    low, high = (_number(x) for x in ci)
    return (low, high) if low is not None and high is not None else None


def context_line(summaries: Iterable[dict]) -> str:
    """`target T | prompts P (n=N) | device D dtype X`: the values the summaries share; where they
    differ, every value, joined by '/'."""
    summaries = list(summaries)

    def value(key: str) -> str:
        values = list(dict.fromkeys(str(s.get(key)) for s in summaries if s.get(key) is not None))
        return "/".join(values) if values else "?"

    counts = [s.get("num_prompts") for s in summaries if s.get("num_prompts") is not None]
    n = str(counts[0]) if len(set(counts)) == 1 else (f"{min(counts)}-{max(counts)}" if counts else "?")
    return (f"target {value('target')} | prompts {value('data')} (n={n}) | "
            f"device {value('device')}, dtype {value('dtype')}")


# ---------------------------------------------------------------- drawing helpers


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _title(fig, title: str, context: str) -> None:
    fig.suptitle(f"{title}\n{context}", fontsize=9)


def _lossy_handle():
    from matplotlib.patches import Patch

    return Patch(facecolor="white", edgecolor="black", hatch=LOSSY_HATCH, label=LOSSY_NOTE)


def _legend(fig, handles: list, labels: list[str], lossy: bool) -> None:
    """One legend for the whole figure (every panel uses the same colours), below the title."""
    if not handles:
        return
    short = max(len(t) for t in labels) <= 40
    if lossy:
        handles, labels = [*handles, _lossy_handle()], [*labels, LOSSY_NOTE]
    if short:
        fig.legend(handles, labels, loc="outside lower center", ncol=min(4, len(handles)), fontsize=7,
                   frameon=False)
    else:  # long labels (runs and their arguments) in one column beside the panels, wrapped
        labels = [textwrap.fill(t, 48, subsequent_indent="    ") for t in labels]
        fig.legend(handles, labels, loc="outside right upper", fontsize=6, frameon=False)


def _grouped_bars(ax, groups: list[str], series: list[dict], metric: str) -> list:
    """Bars of `metric`, one group per entry of `groups` and in each one bar per series that has a
    block there (centred on the group). A series is {"label", "colour", "lossless", "blocks": {group:
    summary block}, optional "tag"}; error bars where a block has an interval; the tag written at the
    base of each of its bars. Returns one bar container per series that drew any (for the legend)."""
    present = [[i for i, s in enumerate(series) if s["blocks"].get(g)] for g in groups]
    tagged = any(s.get("tag") for s in series)
    width = 0.8 / max([1, *(len(p) for p in present)])
    bars = []
    for i, s in enumerate(series):
        xs, ys, lows, highs = [], [], [], []
        for g, group in enumerate(groups):
            if i not in present[g]:
                continue
            block = s["blocks"][group]
            slot = present[g].index(i)
            y = _number(block.get(metric))
            ci = interval(block, metric)
            xs.append(g + (slot - (len(present[g]) - 1) / 2) * width)
            ys.append(float("nan") if y is None else y)
            lows.append(y - ci[0] if y is not None and ci else 0.0)
            highs.append(ci[1] - y if y is not None and ci else 0.0)
        if not xs:
            continue
        yerr = [lows, highs] if any(lows) or any(highs) else None
        bars.append(ax.bar(xs, ys, width, color=s["colour"], edgecolor="black", linewidth=0.5,
                           hatch=LOSSY_HATCH if s["lossless"] is False else None, yerr=yerr, capsize=2,
                           label=s["label"], error_kw={"elinewidth": 0.8}))
        if tagged:  # bars of one colour (one method) tell their series apart by a tag at the base
            tag = s.get("tag") or ""
            for x in xs:
                ax.annotate(tag, (x, 0), textcoords="offset points", xytext=(0, 3), rotation=90 if len(tag) > 3 else 0,
                            ha="center", va="bottom", fontsize=6,
                            bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none"})
    tilt = len(groups) > 4 or max((len(g) for g in groups), default=0) > 12
    ax.set_xticks(range(len(groups)), groups, rotation=20 if tilt else 0, ha="right" if tilt else "center",
                  fontsize=8)
    return bars


def _has_intervals(series: list[dict], metric: str) -> bool:
    return any(interval(b or {}, metric) for s in series for b in s["blocks"].values())


def _ylabel(name: str, series: list[dict], metric: str) -> str:
    return name + (" (95% interval)" if _has_intervals(series, metric) else "")


def save(fig, out_dir: Path, stem: str) -> Path:
    """`<stem>.png` and `<stem>.pdf` in `out_dir`; returns the PNG's path."""
    out_dir = Path(out_dir)
    png = out_dir / f"{stem}.png"
    fig.savefig(png, dpi=130)
    fig.savefig(out_dir / f"{stem}.pdf")
    return png


# ---------------------------------------------------------------- one run


def _run_series(summary: dict) -> list[dict]:
    """The run's methods (the baseline only when it is all the run measured), as bar series."""
    methods = summary["methods"]
    names = [n for n in methods if n != BASELINE] or [BASELINE]
    return _number_variants([{"label": label(n, methods[n].get("lossless")), "colour": method_colour(n),
                              "lossless": methods[n].get("lossless"), "method": n,
                              "blocks": {**methods[n].get("categories", {}), OVERALL: methods[n].get("overall", {})}}
                             for n in names])


def category_figure(summary: dict):
    """Speedup (top) and tau (bottom) per category and overall, one bar per method of the run."""
    series = _run_series(summary)
    groups = [*summary.get("categories", []), OVERALL]
    fig = _figure(min(14.0, max(6.4, 0.6 * len(groups) * max(1, len(series)) + 2.0)), 6.0)
    top, bottom = fig.subplots(2, 1, sharex=True)
    bars = _grouped_bars(top, groups, series, "speedup")
    top.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    top.set_ylabel(_ylabel("speedup vs autoregressive", series, "speedup"), fontsize=8)
    _grouped_bars(bottom, groups, series, "mean_accepted_length")
    bottom.set_ylabel(_ylabel("mean accepted length (tau)", series, "mean_accepted_length"), fontsize=8)
    _title(fig, "speedup and mean accepted length per category", context_line([summary]))
    _legend(fig, bars, [b.get_label() for b in bars], any(s["lossless"] is False for s in series))
    return fig


def position_counts(results: Iterable[dict], method: str) -> dict[str, list[int]]:
    """{category and OVERALL: drafts that reached each position} for `method`, from results.jsonl rows
    (their `reached_per_position`)."""
    rows = [r for r in results if r.get("method") == method]
    counts = {c: sum_lists(r.get("reached_per_position") or [] for r in rows if r.get("category") == c)
              for c in dict.fromkeys(r.get("category") for r in rows)}
    counts[OVERALL] = sum_lists(r.get("reached_per_position") or [] for r in rows)
    return counts


def _counts_of(block: dict, given: Sequence[int] | None) -> list[int] | None:
    """A block's reached counts per position: its own `reached_per_position` where the summary holds
    one, else the counts given (from results.jsonl)."""
    own = block.get("reached_per_position")
    return list(own) if isinstance(own, list) else (list(given) if given is not None else None)


def _positions(rates: Sequence, counts: Sequence[int] | None, min_count: int) -> list[tuple[int, float, int | None]]:
    """(position from 1, rate, n) for the positions worth drawing: a finite rate reached `min_count`
    times or more (every finite rate when the counts are unknown)."""
    out = []
    for i, rate in enumerate(rates):
        y = _number(rate)
        n = counts[i] if counts is not None and i < len(counts) else None
        if y is not None and (counts is None or (n or 0) >= min_count):
            out.append((i + 1, y, n))
    return out


def acceptance_figure(summary: dict, results: Sequence[dict] | None = None, min_count: int = MIN_COUNT):
    """P(draft i accepted | drafts before it accepted) against i: left, overall for every method of the
    run; right, per category for the run's method. Points reached fewer than `min_count` times are
    left out; every point drawn carries its n."""
    from matplotlib.lines import Line2D

    series = [s for s in _run_series(summary) if s["blocks"][OVERALL].get("per_position_acceptance")]
    fig = _figure(10.0, 4.4)
    left, right = fig.subplots(1, 2, sharey=True)
    handles, labels, longest = [], [], 0
    for rank, s in enumerate(series):
        block = s["blocks"][OVERALL]
        given = position_counts(results, s["method"])[OVERALL] if results is not None else None
        rates = block.get("per_position_acceptance") or []
        longest = max(longest, len(rates))
        points = _positions(rates, _counts_of(block, given), min_count)
        lossy = s["lossless"] is False
        style = dict(color=s["colour"], marker=MARKERS[s["index"] % len(MARKERS)], markersize=5,
                     linestyle=LINESTYLES[s["index"] % len(LINESTYLES)],
                     markerfacecolor="white" if lossy else s["colour"])
        if points:
            xs, ys, ns = zip(*points)
            left.plot(xs, ys, **style)
            for x, y, n in points:
                if n is not None:
                    # alternate methods above and below their points, so that counts do not overlap
                    left.annotate(f"n={n}", (x, y), textcoords="offset points", ha="center",
                                  xytext=(0, 6 if rank % 2 == 0 else -11),
                                  fontsize=6, color=s["colour"])
        handles.append(Line2D([], [], **style))
        labels.append(s["label"])
    main = series[0] if series else None
    styles = zip(itertools.cycle(MARKERS), itertools.cycle(LINESTYLES))  # 28 distinct before one repeats
    for category in summary.get("categories", []) if main else []:
        block = main["blocks"].get(category) or {}
        given = position_counts(results, main["method"]).get(category) if results is not None else None
        points = _positions(block.get("per_position_acceptance") or [], _counts_of(block, given), min_count)
        marker, line = next(styles)
        if points:
            xs, ys, ns = zip(*points)
            right.plot(xs, ys, color=main["colour"], marker=marker, linestyle=line, markersize=4,
                       markerfacecolor="white" if main["lossless"] is False else main["colour"], label=category)
            for x, y, n in points:
                if n is not None:
                    right.annotate(str(n), (x, y), textcoords="offset points", xytext=(4, 2), fontsize=6)
    for ax in (left, right):
        ax.set_ylim(0, 1.08)
        ax.set_xlabel("draft position i")
        if longest:
            ax.set_xticks(range(1, longest + 1))
            ax.set_xlim(0.5, longest + 0.5)
    left.set_ylabel("P(draft i accepted | drafts before it accepted)", fontsize=8)
    left.set_title("overall, per method", fontsize=9)
    right.set_title(f"per category, {main['label']}" if main else "per category", fontsize=9)
    if right.lines:
        right.legend(fontsize=7, title="category (points: n)", title_fontsize=7)
    note = f"positions reached fewer than {min_count} times are left out"
    if not any(ax.lines for ax in (left, right)):
        left.text(0.5, 0.5, "no drafts" if not longest else f"no position reached {min_count} times",
                  ha="center", va="center", transform=left.transAxes)
    _title(fig, f"acceptance per draft position ({note})", context_line([summary]))
    _legend(fig, handles, labels, any(s["lossless"] is False for s in series))
    return fig


def run_figures(summary: dict, out_dir: Path, results: Sequence[dict] | None = None) -> dict[str, Path]:
    """A run's figures, PNG and PDF, in `out_dir`: {"categories", "acceptance_per_position"} -> PNG."""
    return {"acceptance_per_position": save(acceptance_figure(summary, results), out_dir, "acceptance_per_position"),
            "categories": save(category_figure(summary), out_dir, "categories")}


# ---------------------------------------------------------------- a sweep


def is_numeric(values: Iterable[Any]) -> bool:
    """Whether every value reads as a number: such an axis gets lines, any other grouped bars."""
    values = list(values)
    return bool(values) and all(_number(v) is not None for v in values)


def _series_of(rows: list[dict], others: list[str]) -> list[tuple[tuple, list[dict]]]:
    """The rows grouped by their values of `others` (one series per combination), in a stable order."""
    ordered = sorted(rows, key=lambda r: [str(r.get(o)) for o in others])
    return [(key, list(members)) for key, members in
            itertools.groupby(ordered, key=lambda r: tuple(r.get(o) for o in others))]


def _method_of(members: list[dict]) -> tuple[str, bool | None]:
    """(method, lossless) of a series' rows: lossy if any row was."""
    lossless = False if any(r.get("lossless") is False for r in members) else members[0].get("lossless")
    return str(members[0].get("method")), lossless


def _method_handles(series: list[dict], bars: bool) -> tuple[list, list[str]]:
    """Legend entries, one per method (its colour; hatched or hollow when lossy)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    seen: dict[str, Any] = {}
    for s in series:
        text = label(s["method"], s["lossless"])
        if text in seen:
            continue
        lossy = s["lossless"] is False
        seen[text] = (Patch(facecolor=s["colour"], edgecolor="black", hatch=LOSSY_HATCH if lossy else None)
                      if bars else Line2D([], [], color=s["colour"], marker="o",
                                          markerfacecolor="white" if lossy else s["colour"]))
    return list(seen.values()), list(seen)


def _short(key: str) -> str:
    """`method.num_speculative_tokens` -> `num_speculative_tokens`: a series' tag stays short."""
    return key.rsplit(".", 1)[-1]


SWEEP_METRICS = (("speedup", "speedup vs autoregressive"), ("mean_accepted_length", "mean accepted length (tau)"))


def sweep_figure(keys: list[str], rows: list[dict], context: str):
    """Speedup (top row) and tau (bottom row) against each swept parameter (one column each): lines over
    a numeric parameter, grouped bars over a categorical one. One series per method and combination of
    the other swept parameters; its colour is its method's, and series of one method differ by marker
    and line style (lines) or by the tag at their base (bars). Each column has its legend under it."""
    keys = keys or ["job"]
    fig = _figure(max(5.0, 4.6 * len(keys)), 7.4)
    axes = fig.subplots(2, len(keys), squeeze=False)
    any_lossy = any(r.get("lossless") is False for r in rows)
    for col, key in enumerate(keys):
        others = [k for k in keys if k != key and k != "method"]
        values = list(dict.fromkeys(r.get(key) for r in rows))
        numeric = is_numeric(values)
        if numeric:
            values.sort(key=_number)
        rank: dict[str, int] = {}
        series = []
        for group, members in _series_of(rows, ["method", *others]):
            method, lossless = _method_of(members)
            index = rank.get(method, 0)
            rank[method] = index + 1
            detail = ", ".join(f"{_short(o)}={v}" for o, v in zip(others, group[1:]))
            tag = ",".join(str(v) for v in group[1:])  # the legend's title names the keys
            series.append({"method": method, "lossless": lossless, "index": index, "members": members,
                           "colour": method_colour(method), "tag": tag or None,
                           "label": label(", ".join(x for x in (method, detail) if x), lossless)})
        for row_i, (metric, ylabel) in enumerate(SWEEP_METRICS):
            ax = axes[row_i][col]
            if numeric:
                for s in series:
                    members = sorted(s["members"], key=lambda r: _number(r.get(key)))
                    xs = [_number(r.get(key)) for r in members]
                    ys = [_number(r.get(metric)) for r in members]
                    cis = [interval(r, metric) for r in members]
                    yerr = None
                    if any(cis):
                        yerr = [[y - c[0] if c and y is not None else 0.0 for y, c in zip(ys, cis)],
                                [c[1] - y if c and y is not None else 0.0 for y, c in zip(ys, cis)]]
                    lossy = s["lossless"] is False
                    ax.errorbar(xs, [float("nan") if y is None else y for y in ys], yerr=yerr, capsize=2,
                                color=s["colour"], marker=MARKERS[s["index"] % len(MARKERS)],
                                linestyle=LINESTYLES[s["index"] % len(LINESTYLES)], markersize=5,
                                markerfacecolor="white" if lossy else s["colour"], label=s["label"])
                ax.set_xticks([_number(v) for v in values], [str(v) for v in values])
            else:
                bar_series = [{**s, "blocks": {str(r.get(key)): r for r in s["members"]}} for s in series]
                _grouped_bars(ax, [str(v) for v in values], bar_series, metric)
            ax.set_xlabel(key + ("" if numeric else " (categorical)"), fontsize=8)
            ax.set_ylabel(_ylabel(ylabel, [{"blocks": {i: r for i, r in enumerate(rows)}}], metric), fontsize=8)
        axes[0][col].axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        if numeric:
            handles, labels = axes[0][col].get_legend_handles_labels()
            title = f"series over {key}"
        else:
            handles, labels = _method_handles(series, bars=True)
            title = "bars tagged " + ",".join(_short(o) for o in others) if others else None
        if any_lossy:
            handles, labels = [*handles, _lossy_handle()], [*labels, LOSSY_NOTE]
        axes[1][col].legend(handles, labels, fontsize=6, title=title, title_fontsize=6, loc="upper center",
                            bbox_to_anchor=(0.5, -0.16), ncol=2 if len(handles) > 4 else 1, frameon=False)
    _title(fig, "sweep: speedup and mean accepted length", context)
    return fig


# ---------------------------------------------------------------- a comparison


def comparison_figure(entries: list[dict], categories: list[str], context: str):
    """Speedup per category and overall, one bar per compared row (a method of a run). An entry is
    {"label", "method", "lossless", "blocks": {category and OVERALL: summary block}}. A method that
    appears in several rows keeps its colour; its bars carry a number, which the legend explains."""
    series = _number_variants([{"label": label(e["label"], e["lossless"]), "lossless": e["lossless"],
                                "method": e["method"], "colour": method_colour(e["method"]), "blocks": e["blocks"]}
                               for e in entries])
    groups = [*categories, OVERALL]
    fig = _figure(min(14.0, max(6.4, 0.5 * len(groups) * max(1, len(series)) + 2.5)), 4.8)
    ax = fig.add_subplot()
    bars = _grouped_bars(ax, groups, series, "speedup")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_ylabel(_ylabel("speedup vs autoregressive", series, "speedup"), fontsize=8)
    _title(fig, "speedup per category, by run and method", context)
    _legend(fig, bars, [b.get_label() for b in bars], any(s["lossless"] is False for s in series))
    return fig
