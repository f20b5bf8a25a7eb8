"""From per-prompt results to what a researcher reads: summary numbers, a Spec-Bench-style table, plots.

Input: the rows of `results.jsonl`, one per prompt and method (the method, and the autoregressive
baseline measured on the same prompts in the same run). Output: `summarize` -> the dict written to
`summary.json` (per method, overall and per category), `format_table` -> the printed table,
`make_plots` -> PNG files.

Definitions (DESIGN.md's vocabulary), for a group of prompts (a category, or all of them):

- tokens_per_s = sum(new_tokens) / sum(wall_s); speedup = method tokens_per_s / baseline tokens_per_s.
  For greedy runs both produce the same tokens, so this equals baseline wall time / method wall time;
  with sampling the two may produce different numbers of tokens, and the rate is the fair ratio.
- The acceptance metrics (alpha, tau, the conditional a_i, vLLM's mean_acceptance_length,
  per-position rate and histograms) are defined once, in `specdec/metrics.py`, and applied here to
  the group's summed counts.
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
  (checked with forced acceptance in experiments/measurement). At batch size 1: with batches a
  row's ttft_s is its batch's.
- matches_baseline (greedy only): the fraction of prompts whose output tokens equal the baseline's.

- ttft_s = the mean over prompts of each prompt's time to first token (its mean over turns for a
  multi-turn prompt). A latency: with batches every row of a batch has the batch's TTFT.
- reused_cache_tokens = prompt tokens taken from a previous turn's KV cache instead of prefilled; the
  run's policy (`cache_reuse` in summary.json: across_turns or none) holds for every method alike.

Timings are per prompt at batch_size 1; with larger batches each row carries an equal share of its
batch's wall, draft and verify times (see `experiment.py`), so per-category figures are approximate
there, totals exact.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from specdec.metrics import (
    acceptance_histogram,
    acceptance_histogram_by_draft_length,
    acceptance_rate,
    expected_tokens_per_step,
    mean_acceptance_length,
    mean_accepted_length,
    num_spec_steps,
    per_position_acceptance,
    per_position_acceptance_rate,
    predicted_speedup,
    predicted_speedup_with_prefill,
    sum_lists,
)
from specdec.metrics import ratio as _ratio

BASELINE = "autoregressive"
OVERALL = "overall"
SUMMED = ("new_tokens", "wall_s", "steps", "proposed", "accepted", "emitted", "draft_s", "verify_s")


def totals(rows: list[dict]) -> dict:
    """Sums over rows of one method: counts, seconds, per-position counts; mean TTFT."""
    t = {key: sum(r[key] for r in rows) for key in SUMMED}
    t["accepted_per_position"] = sum_lists(r["accepted_per_position"] for r in rows)
    t["reached_per_position"] = sum_lists(r["reached_per_position"] for r in rows)
    t["proposed_per_position"] = sum_lists(r.get("proposed_per_position", []) for r in rows)
    # per step, every prompt's steps in turn (absent from rows written by older versions)
    t["draft_lengths"] = [n for r in rows for n in r.get("draft_lengths", [])]
    t["accepted_lengths"] = [n for r in rows for n in r.get("accepted_lengths", [])]
    t["ttft_s"] = sum(r["ttft_s"] for r in rows) / len(rows) if rows else float("nan")
    # prefill seconds and generations (turns), each giving one token (a row's ttft_s is its mean over turns)
    t["prefill_s"] = sum(r["ttft_s"] * r.get("turns", 1) for r in rows)
    t["generations"] = sum(r.get("turns", 1) for r in rows)
    t["num_prompts"] = len(rows)
    return t


def metrics(rows: list[dict], base_rows: list[dict], greedy: bool) -> dict:
    """The summary block of one method over one group of prompts (`base_rows`: the baseline's)."""
    t, b = totals(rows), totals(base_rows)
    per_position = per_position_acceptance(t["accepted_per_position"], t["reached_per_position"])
    spec_steps = num_spec_steps(t["draft_lengths"])
    t_base = _ratio(b["verify_s"], b["steps"])
    t_draft = _ratio(t["draft_s"], t["steps"])
    t_verify = _ratio(t["verify_s"], t["steps"])
    drafting = t["proposed"] > 0
    drafted = [_ratio(n, t["steps"]) for n in t["proposed_per_position"]] or None
    expected = expected_tokens_per_step(per_position, drafted)
    # Drafts made out of sight (the transformers anchors): no acceptance, so no prediction either.
    unknown = float("nan") if not all(r.get("acceptance_measured", True) for r in rows) else None
    out = {
        "num_prompts": t["num_prompts"],
        "new_tokens": t["new_tokens"],
        "wall_s": t["wall_s"],
        "tokens_per_s": _ratio(t["new_tokens"], t["wall_s"]),
        "speedup": _ratio(_ratio(t["new_tokens"], t["wall_s"]), _ratio(b["new_tokens"], b["wall_s"])),
        "acceptance_rate": acceptance_rate(t["accepted"], t["proposed"]),
        "mean_accepted_length": mean_accepted_length(t["emitted"], t["steps"]),
        "per_position_acceptance": per_position,
        # vLLM's per-request metrics, under vLLM's names (README, "Metrics")
        "mean_acceptance_length": mean_acceptance_length(t["accepted"], spec_steps),
        "per_position_acceptance_rate": per_position_acceptance_rate(t["accepted_per_position"], spec_steps),
        "acceptance_histogram": acceptance_histogram(t["draft_lengths"], t["accepted_lengths"]),
        "acceptance_histogram_by_draft_length": acceptance_histogram_by_draft_length(
            t["draft_lengths"], t["accepted_lengths"]),
        "num_spec_steps": spec_steps,
        "ttft_s": t["ttft_s"],
        "reused_cache_tokens": sum(r.get("reused_cache_tokens", 0) for r in rows),
        "steps": t["steps"],
        "proposed": t["proposed"],
        "accepted": t["accepted"],
        "t_draft_step_s": t_draft,
        "t_verify_step_s": t_verify,
        "t_baseline_step_s": t_base,
        "c": _ratio(_ratio(t["draft_s"], t["proposed"]), t_base) if drafting else float("nan"),
        "verify_cost": _ratio(t_verify, t_base),
        "expected_tokens_per_step": expected,
        # plain decoding predicts itself (1.0), once it has run at all
        "predicted_speedup": predicted_speedup(expected, t_base, t_draft + t_verify) if drafting else
        (1.0 if rows else float("nan")),
        "predicted_speedup_with_prefill": predicted_speedup_with_prefill(
            expected, t_draft + t_verify, t["prefill_s"], t["new_tokens"], t["generations"],
            _ratio(b["new_tokens"], b["wall_s"])) if drafting else (1.0 if rows else float("nan")),
    }
    if unknown is not None:
        out.update(c=unknown, expected_tokens_per_step=unknown, predicted_speedup=unknown,
                   predicted_speedup_with_prefill=unknown, mean_acceptance_length=unknown)
    # The spread over prompts: per-prompt speedups (tokens/s against the baseline's on that prompt).
    base_tps = {r["prompt_id"]: _ratio(r["new_tokens"], r["wall_s"]) for r in base_rows}
    per_prompt = sorted(_ratio(_ratio(r["new_tokens"], r["wall_s"]), base_tps.get(r["prompt_id"], float("nan")))
                        for r in rows)
    per_prompt = [x for x in per_prompt if x is not None and math.isfinite(x)]
    out["speedup_median"] = statistics.median(per_prompt) if per_prompt else float("nan")
    out["speedup_min"] = per_prompt[0] if per_prompt else float("nan")
    out["speedup_max"] = per_prompt[-1] if per_prompt else float("nan")
    if greedy:
        base_out = {r["prompt_id"]: r["output_token_ids"] for r in base_rows}
        same = [r["output_token_ids"] == base_out.get(r["prompt_id"]) for r in rows]
        out["matches_baseline"] = sum(same) / len(same) if same else float("nan")
    return out


def summarize(rows: list[dict], methods: str | list[str], info: dict, greedy: bool) -> dict:
    """summary.json: run info, the (first) method's overall numbers at the top (for sweeps and W&B),
    and `methods.<name>.overall` / `methods.<name>.categories.<category>` for every method measured
    (the first one, those it was compared with, and the baseline)."""
    methods = [methods] if isinstance(methods, str) else list(methods)
    method = methods[0]
    names = list(dict.fromkeys([*methods, BASELINE]))
    by_method = {name: [r for r in rows if r["method"] == name] for name in names}
    base = by_method[BASELINE]
    categories = list(dict.fromkeys(r["category"] for r in base))
    methods = {}
    for name in names:
        mine = by_method[name]
        block = {OVERALL: metrics(mine, base, greedy)}
        block["categories"] = {
            c: metrics([r for r in mine if r["category"] == c], [r for r in base if r["category"] == c], greedy)
            for c in categories
        }
        lossless = all(r["lossless"] for r in mine)
        block["lossless"] = lossless
        block["verifier"] = mine[0]["verifier"] if mine else None
        methods[name] = block
    head = methods[method][OVERALL]
    summary = dict(info)
    summary.update({
        "method": method,
        "baseline": BASELINE,
        "lossless": methods[method]["lossless"],
        "verifier": methods[method]["verifier"],
        "num_prompts": len(base),
        "categories": categories,
        "speedup": head["speedup"],
        "mean_accepted_length": head["mean_accepted_length"],
        "acceptance_rate": head["acceptance_rate"],
        "predicted_speedup": head["predicted_speedup"],
        "c": head["c"],
        "tokens_per_s": head["tokens_per_s"],
        "baseline_tokens_per_s": methods[BASELINE][OVERALL]["tokens_per_s"],
        "ttft_s": head["ttft_s"],
        # The first method's acceptance by draft position and speedup by category, at the top level too,
        # so that W&B panels across runs of different methods name one key (specdec.dashboard).
        "per_position_acceptance": head["per_position_acceptance"],
        "per_category": {c: {"speedup": methods[method]["categories"][c]["speedup"],
                             "mean_accepted_length": methods[method]["categories"][c]["mean_accepted_length"]}
                         for c in categories},
    })
    if greedy:
        summary["matches_baseline"] = head["matches_baseline"]
    summary["methods"] = methods
    return summary


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


def format_table(summary: dict) -> str:
    """A Spec-Bench-style markdown table: one line per category and one overall, for the run's method."""
    block = summary["methods"][summary["method"]]
    base = summary["methods"][BASELINE]
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
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    groups = [(c, block["categories"][c], base["categories"][c]) for c in summary["categories"]]
    groups.append((f"**{OVERALL}**", block[OVERALL], base[OVERALL]))
    for name, m, b in groups:
        cells = [name, _fmt(m["speedup"], ".2f", "x"), _fmt(m["mean_accepted_length"], ".2f"),
                 _fmt(m["acceptance_rate"], ".2f"), _fmt(m["predicted_speedup"], ".2f", "x"),
                 _fmt(m["c"], ".2f"), _fmt(m["tokens_per_s"], ".1f"), _fmt(b["tokens_per_s"], ".1f")]
        if greedy:
            cells.append(_fmt(m["matches_baseline"], ".0%"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_comparison(summary: dict) -> str:
    """One line per method measured in the run (experiment=vs_hf and other `compare` presets):
    tokens/s, speedup over the shared baseline, tau, alpha, measured / predicted speedup; then the
    ratios of each specdec method's tokens/s to each `hf_*` anchor's."""
    methods = summary["methods"]
    lines = [_cache_policy(summary), "",
             "| method | tok/s | speedup | per-prompt median (min-max) | tau | alpha | predicted | "
             "measured/predicted | reused cache tokens | lossless |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, block in methods.items():
        m = block[OVERALL]
        ratio = _ratio(m["speedup"], m["predicted_speedup"]) if m["proposed"] else float("nan")
        spread = (f"{_fmt(m['speedup_median'], '.2f')} ({_fmt(m['speedup_min'], '.2f')}-"
                  f"{_fmt(m['speedup_max'], '.2f')})")
        lines.append(f"| {name} | {_fmt(m['tokens_per_s'], '.1f')} | {_fmt(m['speedup'], '.2f', 'x')} | {spread} | "
                     f"{_fmt(m['mean_accepted_length'], '.2f')} | {_fmt(m['acceptance_rate'], '.2f')} | "
                     f"{_fmt(m['predicted_speedup'], '.2f', 'x')} | {_fmt(ratio, '.2f')} | "
                     f"{m.get('reused_cache_tokens', '-')} | {'yes' if block['lossless'] else 'no (lossy)'} |")
    anchors = [n for n in methods if n.startswith("hf_")]
    ours = [n for n in methods if not n.startswith("hf_")]
    if anchors:
        lines += ["", "| specdec / anchor (tokens/s) | " + " | ".join(anchors) + " |",
                  "|---|" + "---:|" * len(anchors)]
        for name in ours:
            tps = methods[name][OVERALL]["tokens_per_s"]
            cells = [_fmt(_ratio(tps, methods[a][OVERALL]["tokens_per_s"]), ".2f", "x") for a in anchors]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
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


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def make_plots(summary: dict, out_dir: Path) -> dict[str, Path]:
    """PNG files in `out_dir`: acceptance per draft position, speedup and tau per category.
    Uses matplotlib's object API (no pyplot), so no global backend or figure state is touched."""
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    block = summary["methods"][summary["method"]]
    label = method_label(summary)
    plots = {}

    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot()
    overall = block[OVERALL]["per_position_acceptance"]
    if overall:
        positions = range(1, len(overall) + 1)
        ax.bar(positions, [a if a is not None else float("nan") for a in overall], color="#c9d7ea",
               label="all prompts")
        for cat, m in block["categories"].items():
            ax.plot(range(1, len(m["per_position_acceptance"]) + 1), m["per_position_acceptance"],
                    marker="o", label=cat)
        ax.set_xticks(list(positions))
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no drafts (autoregressive)", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(draft i accepted | drafts before it accepted)")
    ax.set_title(f"{label}: acceptance per position")
    plots["acceptance_per_position"] = _save(fig, out_dir / "acceptance_per_position.png")

    cats = list(block["categories"])
    names = cats + [OVERALL]
    values = [block["categories"][c] for c in cats] + [block[OVERALL]]
    fig = Figure(figsize=(max(6.4, 1.1 * len(names)), 5.6))
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    ax1.bar(names, [m["speedup"] for m in values], color="#4c72b0")
    ax1.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax1.set_ylabel("speedup vs autoregressive")
    ax1.set_title(f"{label}: speedup and mean accepted length per category")
    ax2.bar(names, [m["mean_accepted_length"] for m in values], color="#55a868")
    ax2.set_ylabel("mean accepted length (tau)")
    ax2.tick_params(axis="x", labelrotation=30)
    plots["categories"] = _save(fig, out_dir / "categories.png")
    return plots
