"""From per-prompt results to what a researcher reads: summary.json, a Spec-Bench-style table, plots.

Input: the `PromptResult`s of a run (results.jsonl), one per prompt and method (the method, and the
autoregressive baseline measured on the same prompts in the same run). Output: `summarize` -> the
dict written to `summary.json` (per method a `MethodResults`: overall and per category),
`format_table` / `format_comparison` -> the printed tables,
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
- matches_baseline (greedy only): the fraction of prompts whose output tokens equal the baseline's.

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
import math
from collections.abc import Collection
from pathlib import Path

from specdec.core.metrics import ratio as _ratio
from specdec.study.results import HEADLINE, MethodResults, PromptResult

BASELINE = "autoregressive"
OVERALL = "overall"


def summarize(rows: list[PromptResult], methods: str | list[str], info: dict, greedy: bool,
              exact_greedy: dict[str, str] | None = None) -> dict:
    """summary.json: run info, the (first) method's overall numbers at the top (`HEADLINE`, for sweeps
    and W&B), and `methods.<name>` (`MethodResults`: overall and per category) for every method
    measured (the first one, those it was compared with, and the baseline). `exact_greedy`: per
    method, whether exact greedy applied ("on", "off", "not applied: <why>")."""
    methods = [methods] if isinstance(methods, str) else list(methods)
    method = methods[0]
    names = list(dict.fromkeys([*methods, BASELINE]))
    base = [r for r in rows if r.method == BASELINE]
    categories = list(dict.fromkeys(r.category for r in base))
    blocks = {name: MethodResults.measure([r for r in rows if r.method == name], base, categories, greedy,
                                          (exact_greedy or {}).get(name))
              for name in names}
    head = blocks[method].overall
    summary = dict(info)
    summary.update({
        "method": method,
        "baseline": BASELINE,
        "lossless": blocks[method].lossless,
        "verifier": blocks[method].verifier,
        "num_prompts": len(base),
        "categories": categories,
        **{key: getattr(head, key) for key in HEADLINE},
        "baseline_tokens_per_s": blocks[BASELINE].overall.tokens_per_s,
        "per_category": {c: {"speedup": blocks[method].categories[c].speedup,
                             "mean_accepted_length": blocks[method].categories[c].mean_accepted_length}
                         for c in categories},
    })
    if greedy:
        summary["matches_baseline"] = head.matches_baseline
    summary["methods"] = {name: block.to_dict() for name, block in blocks.items()}
    return summary


def markdown_table(head: list[str], rows: list[list[str]], left: Collection[int] = (0,)) -> list[str]:
    """The lines of a markdown table: the columns numbered in `left` (text) left-aligned, the rest
    (numbers) right-aligned."""
    align = ["---" if i in left else "---:" for i in range(len(head))]
    return ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|",
            *("| " + " | ".join(cells) + " |" for cells in rows)]


def write_csv(rows: list[dict], path: Path) -> Path:
    """`rows` as a CSV file, one column per key seen in any row (a run's or a sweep's table)."""
    columns = list(dict.fromkeys(c for r in rows for c in r))
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


# ---------------------------------------------------------------- the table


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:{spec}}{suffix}"


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
    title = (f"{method_label(summary)}"
             + (f", k={k}" if summary["method"] != BASELINE else "")
             + f", verifier {summary['verifier']}, temperature {summary.get('temperature')}"
             + f" | target {_model(summary, 'target')}, draft {_model(summary, 'draft')}"
             + f" | {summary.get('data')}: {summary['num_prompts']} prompts"
             + f" | {summary.get('device')} {summary.get('dtype')}")
    head = ["category", "speedup", "tau", "alpha", "predicted", "c", "tok/s", "base tok/s"]
    if greedy:
        head.append("= baseline")
    groups = [(c, block.categories[c], base.categories[c]) for c in summary["categories"]]
    groups.append((f"**{OVERALL}**", block.overall, base.overall))
    cells = []
    for name, m, b in groups:
        line = [name, _fmt(m.speedup, ".2f", "x"), _fmt(m.mean_accepted_length, ".2f"), _fmt(m.acceptance_rate, ".2f"),
                _fmt(m.predicted_speedup, ".2f", "x"), _fmt(m.c, ".2f"), _fmt(m.tokens_per_s, ".1f"),
                _fmt(b.tokens_per_s, ".1f")]
        if greedy:
            line.append(_fmt(m.matches_baseline, ".0%"))
        cells.append(line)
    notes = [f"exact greedy {state} for {name}" for name, state in _exact_greedy_notes(blocks)]
    return "\n".join([title, "", *markdown_table(head, cells), *(["", *notes] if notes else [])])


def _exact_greedy_notes(blocks: dict[str, MethodResults]) -> list[tuple[str, str]]:
    """(method, state) for the methods where exact greedy was asked for but did not apply."""
    return [(name, b.exact_greedy) for name, b in blocks.items()
            if b.exact_greedy is not None and b.exact_greedy.startswith("not applied")]


def format_comparison(summary: dict) -> str:
    """One line per method measured in the run (experiment=vs_hf and other `compare` presets):
    tokens/s, speedup over the shared baseline, tau, alpha, measured / predicted speedup; then the
    ratios of each specdec method's tokens/s to each `hf_*` anchor's."""
    blocks = _blocks(summary)
    head = ["method", "tok/s", "speedup", "per-prompt median (min-max)", "tau", "alpha", "predicted",
            "measured/predicted", "reused cache tokens", "lossless"]
    cells = []
    for name, block in blocks.items():
        m = block.overall
        spread = f"{_fmt(m.speedup_median, '.2f')} ({_fmt(m.speedup_min, '.2f')}-{_fmt(m.speedup_max, '.2f')})"
        cells.append([name, _fmt(m.tokens_per_s, ".1f"), _fmt(m.speedup, ".2f", "x"), spread,
                      _fmt(m.mean_accepted_length, ".2f"), _fmt(m.acceptance_rate, ".2f"),
                      _fmt(m.predicted_speedup, ".2f", "x"), _fmt(m.measured_over_predicted, ".2f"),
                      str(m.reused_cache_tokens), "yes" if block.lossless else "no (lossy)"])
    lines = [_cache_policy(summary), "", *markdown_table(head, cells, left=(0, len(head) - 1))]
    anchors = [n for n in blocks if n.startswith("hf_")]
    ours = [n for n in blocks if not n.startswith("hf_")]
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
