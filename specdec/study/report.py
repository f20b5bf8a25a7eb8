"""From per-prompt results to what a researcher reads: summary.json, a Spec-Bench-style table, plots.

Input: the `PromptResult`s of a run (results.jsonl), one per prompt and method (the method, and the
autoregressive baseline measured on the same prompts in the same run). Output: `summarize` -> the
dict written to `summary.json` (per method a `MethodResults`: overall and per category),
`format_table` / `format_comparison` -> the printed tables, `table_rows` -> the run's table.csv,
`make_plots` -> the figures (drawn by `specdec.study.figures`, PNG and PDF). This module
only arranges and formats: the numbers come from `specdec.study.results.MethodSummary.measure`, which
applies the definitions of `specdec.core.metrics`.

Definitions (DESIGN.md's vocabulary), for a group of prompts (a category, or all of them):

- tokens_per_s = sum(new_tokens) / sum(wall_s); speedup = method tokens_per_s / baseline tokens_per_s.
  For greedy runs both produce the same tokens, so this equals baseline wall time / method wall time;
  with sampling the two may produce different numbers of tokens, and the rate is the fair ratio.
- The acceptance metrics (alpha, tau, the conditional a_i, vLLM's mean_acceptance_length,
  per-position rate and histograms) are defined once, in `specdec/core/metrics.py`, and applied to the
  group's summed counts.
- Costs, measured: t_base = baseline seconds per step (one target pass of 1 token, verifier included);
  t_draft, t_verify = the method's drafting and scoring+verifying seconds per step.
  c = (draft seconds / drafted tokens) / t_base, the cost of one draft token relative to a target step;
  verify_cost = t_verify / t_base, the cost of scoring k+1 tokens relative to scoring 1.
- predicted_speedup: Leviathan et al. (2023) give E[tokens per step] = (1 - alpha^(k+1)) / (1 - alpha)
  and speedup = E / (c k + 1), assuming i.i.d. acceptance and a k+1-token pass that costs one 1-token
  pass. Generalised here to the measured per-position acceptance and the measured verify cost:

      E = 1 + sum_{i=1..k} d_i prod_{j<=i} a_j       (expected tokens per step; d_i: fraction of
                                                    steps that drafted position i, 1 for a fixed k)
      predicted_speedup = E * t_base / (t_draft + t_verify) = E / (c * k_mean + verify_cost)

  with k_mean the mean drafted tokens per step. It leaves out prefill (TTFT) and the loop's own
  bookkeeping, so measured below predicted means time goes outside drafting and scoring.
  predicted_speedup_with_prefill adds the method's measured prefill (which gives each generation its
  first token) and compares with the baseline's measured tokens/s: the end-to-end prediction
  (experiments/measurement/LOG.md, "2. The cost model, checked with forced acceptance"). At batch
  size 1: with batches a row's ttft_s is its batch's.
- speedup_over_fastest_plain: per method, tokens/s over the fastest plain decoding the run measured
  (`fastest_plain`: specdec's baseline, exact greedy's reference, or an anchor: `hf_generate`, `vllm`).
- matches_baseline (greedy only): the fraction of prompts whose output tokens equal the baseline's, or,
  where exact greedy widened the run's scoring passes, those of plain decoding at that width (the
  `exact_greedy_reference` row, `autoregressive[exact greedy, width W]`). Speedups are always over
  plain decoding one token wide; exact_greedy_cost = its tokens/s over the reference's.
- Intervals: speedup, tau, alpha and tokens/s carry a 95% interval (`<name>_ci_low`, `_ci_high`), a
  bootstrap over prompts and repeats (`specdec.study.intervals`), beside the counts behind them
  (`num_prompts`, `num_repeats`, `steps`). Table cells read `1.36x [1.21, 1.50]`; `MARK` follows a
  speedup whose interval includes 1.0x, and any number that rests on fewer than `MIN_STEPS` steps or
  on a single prompt; a legend line under the table says so. Summaries written before intervals
  existed (`num_repeats` 0) are shown without them.

- ttft_s = the mean over prompts of each prompt's time to first token (its mean over turns for a
  multi-turn prompt). A latency: with batches every row of a batch has the batch's TTFT.
- reused_cache_tokens = prompt tokens taken from a previous turn's KV cache instead of prefilled; the
  run's policy (`cache_reuse` in summary.json: across_turns or none) holds for every method alike.

Timings are per prompt at batch_size 1; with larger batches each row carries an equal share of its
batch's wall, draft and verify times (see `experiment.py`), so per-category figures are approximate
there, totals exact.
- exact_greedy (per method): `on`, `off`, or `not applied: <why>` where a greedy run asked for it and
  the method cannot have it (docs/engine.md#numerics-and-exact-greedy); the table says so under its
  last line.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from collections.abc import Collection
from pathlib import Path

from specdec.core.metrics import ratio as _ratio
from specdec.study import intervals
from specdec.study.results import HEADLINE, WITH_INTERVALS, MethodResults, MethodSummary, PromptResult

BASELINE = "autoregressive"
OVERALL = "overall"
MARK = "~"  # after a cell that cannot be told from noise (`intervals.unclear`)


def summarize(rows: list[PromptResult], methods: str | list[str], info: dict, greedy: bool,
              exact_greedy: dict[str, str] | None = None, reference: str | None = None) -> dict:
    """summary.json: run info, the (first) method's overall numbers at the top (`HEADLINE`, for sweeps
    and W&B), and `methods.<name>` (`MethodResults`: overall and per category) for every method
    measured (the first one, those it was compared with, and the baseline). `exact_greedy`: per
    method, whether exact greedy applied ("on", "off", "not applied: <why>").

    `reference`: the name of exact greedy's plain decoding (scored at the run's widest k + 1), where
    the run measured one beside the one-token-wide baseline. Every speedup stays over the baseline;
    greedy tokens are checked against the reference (`matches_baseline`), whose own slowdown is
    `exact_greedy_cost` (baseline tokens/s over the reference's)."""
    methods = [methods] if isinstance(methods, str) else list(methods)
    method = methods[0]
    names = list(dict.fromkeys([*methods, BASELINE, *([reference] if reference else [])]))
    base = [r for r in rows if r.method == BASELINE]
    categories = list(dict.fromkeys(r.category for r in base))
    repeats = len({r.repeat for r in base})
    blocks = {name: MethodResults.measure([r for r in rows if r.method == name], base, categories, greedy,
                                          (exact_greedy or {}).get(name))
              for name in names}
    if reference and greedy:
        checked = [r for r in rows if r.method == reference]
        blocks = {name: _tokens_checked(block, [r for r in rows if r.method == name], checked)
                  for name, block in blocks.items()}
    head = blocks[method].overall
    summary = dict(info)
    summary.update({
        "method": method,
        "baseline": BASELINE,
        "lossless": blocks[method].lossless,
        "verifier": blocks[method].verifier,
        "num_prompts": len({r.prompt_id for r in base}),
        "repeats": repeats,
        "categories": categories,
        **{key: getattr(head, key) for key in HEADLINE},
        "baseline_tokens_per_s": blocks[BASELINE].overall.tokens_per_s,
        "per_category": {c: {key: getattr(blocks[method].categories[c], key) for key in PER_CATEGORY}
                         for c in categories},
        "intervals": {"level": intervals.LEVEL, "resamples": intervals.RESAMPLES, "seed": intervals.SEED,
                      "resampled": "repeats, then prompts within them" if repeats > 1 else "prompts",
                      "min_steps": intervals.MIN_STEPS},
    })
    if greedy:
        summary["matches_baseline"] = head.matches_baseline
        summary["tokens_checked_against"] = reference or BASELINE
    if reference:
        summary["exact_greedy_reference"] = reference
        summary["exact_greedy_cost"] = _ratio(blocks[BASELINE].overall.tokens_per_s,
                                              blocks[reference].overall.tokens_per_s)
    summary.update(_over_fastest_plain(blocks))
    summary["methods"] = {name: block.to_dict() for name, block in blocks.items()}
    return summary


def _over_fastest_plain(blocks: dict[str, MethodResults]) -> dict:
    """Speedups over the fastest plain decoding the run measured, whichever engine ran it (specdec's
    baseline, exact greedy's reference, `hf_generate`, `vllm`): a method that only removes overhead
    looks better over a slow baseline than it is. Plain: a method that drafted nothing."""
    plain = {name: b.overall.tokens_per_s for name, b in blocks.items()
             if b.overall.proposed == 0 and b.overall.steps and math.isfinite(b.overall.tokens_per_s)}
    if not plain:
        return {}
    fastest = max(plain, key=plain.get)
    return {"fastest_plain": fastest, "fastest_plain_tokens_per_s": plain[fastest],
            "speedup_over_fastest_plain": {name: _ratio(b.overall.tokens_per_s, plain[fastest])
                                           for name, b in blocks.items()}}


def _tokens_checked(block: MethodResults, results: list[PromptResult], reference: list[PromptResult]) -> MethodResults:
    """`block` with `matches_baseline` (overall and per category) taken against `reference`'s tokens:
    `MethodSummary.measure`'s own comparison, with the reference in the baseline's place."""
    def checked(summary: MethodSummary, category: str | None) -> MethodSummary:
        mine = [r for r in results if category is None or r.category == category]
        theirs = [r for r in reference if category is None or r.category == category]
        return dataclasses.replace(summary, matches_baseline=MethodSummary.measure(mine, theirs, True).matches_baseline)

    return dataclasses.replace(block, overall=checked(block.overall, None),
                               categories={c: checked(s, c) for c, s in block.categories.items()})


# The numbers of each category repeated under `per_category` in summary.json (W&B panels read them).
PER_CATEGORY = ("speedup", "speedup_ci_low", "speedup_ci_high", "mean_accepted_length", "mean_accepted_length_ci_low",
                "mean_accepted_length_ci_high", "num_prompts", "steps")


def markdown_table(head: list[str], rows: list[list[str]], left: Collection[int] = (0,)) -> list[str]:
    """The lines of a markdown table: the columns numbered in `left` (text) left-aligned, the rest
    (numbers) right-aligned."""
    align = ["---" if i in left else "---:" for i in range(len(head))]
    return ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|",
            *("| " + " | ".join(cells) + " |" for cells in rows)]


def csv_text(rows: list[dict]) -> str:
    """`rows` as the text of a CSV file, one column per key seen in any row."""
    columns = list(dict.fromkeys(c for r in rows for c in r))
    out = io.StringIO(newline="")
    writer = csv.DictWriter(out, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def write_csv(rows: list[dict], path: Path) -> Path:
    """`rows` as a CSV file, one column per key seen in any row (a run's or a sweep's table)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        f.write(csv_text(rows))
    return path


# ---------------------------------------------------------------- the table


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:{spec}}{suffix}"


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def interval_cell(value: float | None, low: float | None, high: float | None, steps: int | None, spec: str,
                  suffix: str = "", null: float | None = None, with_interval: bool = True, repeats: int = 1) -> str:
    """`1.36x [1.21, 1.50]`, with `MARK` after it where `intervals.unclear` (`null`: 1.0 for a speedup;
    `steps` summed over `repeats`). `with_interval` false (a summary written before intervals, the
    baseline's own speedup): the value alone."""
    text = _fmt(value, spec, suffix)
    if not with_interval or text == "-":
        return text
    if _finite(low) and _finite(high):
        text += f" [{low:{spec}}, {high:{spec}}]"
    return text + (MARK if intervals.unclear(low, high, steps, null, repeats) else "")


def summary_cell(m: MethodSummary, name: str, spec: str, suffix: str = "", baseline: bool = False) -> str:
    """The cell of `name` (one of `WITH_INTERVALS`) of a MethodSummary, its interval and mark included."""
    low, high = m.interval(name)
    shown = m.num_repeats > 0 and not (baseline and name == "speedup")
    return interval_cell(getattr(m, name), low, high, m.steps, spec, suffix, 1.0 if name == "speedup" else None,
                         shown, m.num_repeats)


def legend(repeats: int | None = 1) -> str:
    """The line under a table with intervals: what the brackets are and what `MARK` means (`repeats`
    None: the table's runs measured different numbers of repeats)."""
    over = ("prompts" if repeats == 1 else "repeats, then prompts within them, where a run measured several"
            if repeats is None else f"{repeats} repeats, then prompts within them")
    return (f"[low, high]: 95% interval, a bootstrap over {over} ({intervals.RESAMPLES:,} resamples, seed "
            f"{intervals.SEED}). {MARK}: a speedup whose interval includes 1.0x, or a number that rests on "
            f"fewer than {intervals.MIN_STEPS} steps (a repeat's) or on one prompt: not told apart from noise.")


def method_label(summary: dict) -> str:
    return summary["method"] + ("" if summary["lossless"] else " (lossy)")


def _model(summary: dict, role: str) -> str:
    """`name`, with the path when it says more than the name (a path overridden on the command line)."""
    name, path = summary.get(role), summary.get(f"{role}_path")
    return name if path in (None, name, "embedded", "tiny_random", "self") else f"{name} ({path})"


def _blocks(summary: dict) -> dict[str, MethodResults]:
    return {name: MethodResults.from_dict(block) for name, block in summary["methods"].items()}


def format_table(summary: dict) -> str:
    """A Spec-Bench-style markdown table: one line per category and one overall, for the run's method."""
    blocks = _blocks(summary)
    block, base = blocks[summary["method"]], blocks[BASELINE]
    greedy = "matches_baseline" in summary
    k = summary.get("num_speculative_tokens")
    repeats = summary.get("repeats", 1)
    with_intervals = block.overall.num_repeats > 0
    title = (f"{method_label(summary)}"
             + (f", k={k}" if summary["method"] != BASELINE else "")
             + f", verifier {summary['verifier']}, temperature {summary.get('temperature')}"
             + f" | target {_model(summary, 'target')}, draft {_model(summary, 'draft')}"
             + f" | {summary.get('data')}: {summary['num_prompts']} prompts"
             + (f" x {repeats} repeats" if repeats > 1 else "")
             + f" | {summary.get('device')} {summary.get('dtype')}")
    head = ["category", "speedup", "tau", "alpha", "predicted", "c", "tok/s", "base tok/s"]
    if with_intervals:
        head += ["prompts", "steps"]
    if greedy:
        head.append("= baseline")
    groups = [(c, block.categories[c], base.categories[c]) for c in summary["categories"]]
    groups.append((f"**{OVERALL}**", block.overall, base.overall))
    cells = []
    for name, m, b in groups:
        line = [name, summary_cell(m, "speedup", ".2f", "x", summary["method"] == BASELINE),
                summary_cell(m, "mean_accepted_length", ".2f"), summary_cell(m, "acceptance_rate", ".2f"),
                _fmt(m.predicted_speedup, ".2f", "x"), _fmt(m.c, ".2f"), _fmt(m.tokens_per_s, ".1f"),
                _fmt(b.tokens_per_s, ".1f")]
        if with_intervals:
            line += [str(m.num_prompts), str(m.steps)]
        if greedy:
            line.append(_fmt(m.matches_baseline, ".0%"))
        cells.append(line)
    notes = [f"exact greedy {state} for {name}" for name, state in _exact_greedy_notes(blocks)]
    if with_intervals:
        notes.insert(0, legend(repeats))
    return "\n".join([title, "", *markdown_table(head, cells), *(["", *notes] if notes else [])])


def table_rows(summary: dict) -> list[dict]:
    """The run's table.csv: one row per method and group (each category, then overall) with every number
    of `WITH_INTERVALS`, its interval, the counts behind it and whether a table marks it."""
    out = []
    for name, block in _blocks(summary).items():
        for group, m in [*block.categories.items(), (OVERALL, block.overall)]:
            row = {"method": name, "category": group, "num_prompts": m.num_prompts, "num_repeats": m.num_repeats,
                   "steps": m.steps, "new_tokens": m.new_tokens}
            for key in WITH_INTERVALS:
                low, high = m.interval(key)
                row.update({key: getattr(m, key), f"{key}_ci_low": low, f"{key}_ci_high": high})
            low, high = m.interval("speedup")
            row["speedup_unclear"] = name != BASELINE and intervals.unclear(low, high, m.steps, 1.0, m.num_repeats)
            row["few_steps"] = intervals.few_steps(m.steps, m.num_repeats)
            row.update(lossless=block.lossless, verifier=block.verifier)
            out.append({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()})
    return out


def _exact_greedy_notes(blocks: dict[str, MethodResults]) -> list[tuple[str, str]]:
    """(method, state) for the methods where exact greedy was asked for but did not apply."""
    return [(name, b.exact_greedy) for name, b in blocks.items()
            if b.exact_greedy is not None and b.exact_greedy.startswith("not applied")]


# The methods that are other engines (transformers' generate(), vLLM), by name: the comparison's last
# table puts each specdec method's tokens/s over theirs.
ANCHORS = ("hf_", "vllm")


def format_comparison(summary: dict) -> str:
    """One line per method measured in the run (experiment=vs_hf and other `compare` presets):
    tokens/s, speedup over the shared baseline, tau, alpha, measured / predicted speedup; then the
    ratios of each specdec method's tokens/s to each anchor's (`hf_*`, `vllm*`)."""
    blocks = _blocks(summary)
    head = ["method", "tok/s", "speedup", "per-prompt median (min-max)", "tau", "alpha", "predicted",
            "measured/predicted", "steps", "reused cache tokens", "lossless"]
    cells = []
    for name, block in blocks.items():
        m = block.overall
        spread = f"{_fmt(m.speedup_median, '.2f')} ({_fmt(m.speedup_min, '.2f')}-{_fmt(m.speedup_max, '.2f')})"
        cells.append([name, _fmt(m.tokens_per_s, ".1f"), summary_cell(m, "speedup", ".2f", "x", name == BASELINE),
                      spread, summary_cell(m, "mean_accepted_length", ".2f"), summary_cell(m, "acceptance_rate", ".2f"),
                      _fmt(m.predicted_speedup, ".2f", "x"), _fmt(m.measured_over_predicted, ".2f"), str(m.steps),
                      str(m.reused_cache_tokens), "yes" if block.lossless else "no (lossy)"])
    lines = [_cache_policy(summary), "", *markdown_table(head, cells, left=(0, len(head) - 1))]
    if any(b.overall.num_repeats for b in blocks.values()):
        lines += ["", legend(summary.get("repeats", 1))]
    fastest = summary.get("fastest_plain")
    if fastest and fastest != BASELINE:
        over = summary["speedup_over_fastest_plain"]
        lines += ["", f"Fastest plain decoding in this run: {fastest}, {_fmt(summary['fastest_plain_tokens_per_s'], '.1f')} "
                      "tok/s. Over it: " + ", ".join(f"{name} {_fmt(x, '.2f', 'x')}" for name, x in over.items()
                                                     if name != fastest) + "."]
    anchors = [n for n in blocks if n.startswith(ANCHORS)]
    ours = [n for n in blocks if not n.startswith(ANCHORS)]
    if anchors:
        rows = [[name, *(_fmt(_ratio(blocks[name].overall.tokens_per_s, blocks[a].overall.tokens_per_s), ".2f", "x")
                         for a in anchors)] for name in ours]
        lines += ["", *markdown_table(["specdec / anchor (tokens/s)", *anchors], rows)]
    return "\n".join(lines)


def _cache_policy(summary: dict) -> str:
    """The line that says how every method in the table treated a conversation's earlier turns."""
    policy = summary.get("cache_reuse")
    if policy == "across_turns":
        return "Cache reuse: every method continues a conversation from its previous turn's KV cache."
    if policy == "none":
        blocked = ", ".join(summary.get("cache_reuse_blocked_by") or []) or "a method in the run"
        return (f"Cache reuse: none; every method prefills each turn's whole conversation, since {blocked} "
                "cannot continue a cache.")
    return "Cache reuse: not recorded."


# ---------------------------------------------------------------- plots


def make_plots(summary: dict, out_dir: Path) -> dict[str, Path]:
    """The run's figures (`specdec.study.figures`), PNG and PDF, in `out_dir`: speedup and tau per
    category, acceptance per draft position (with the counts of results.jsonl, when it is there).
    Returns {name: PNG path}."""
    import json

    from specdec.study.figures import run_figures

    path = Path(out_dir) / "results.jsonl"
    results = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()] \
        if path.is_file() else None
    return run_figures(summary, Path(out_dir), results)
