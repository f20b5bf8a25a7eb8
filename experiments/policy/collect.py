"""Tables of the policy study from its run folders (experiments/policy/run.sh):

    python experiments/policy/collect.py [RUN_FOLDER ...]    # default experiments/policy/runs

Several folders (repetitions of run.sh): speedups are taken per repetition and summarised by their
median (min-max); draft lengths, tau and the hybrid's choices are pooled.

speedup against batch size for every method, the policy's draft lengths (per step, from
results.jsonl), suffix decoding against n-gram lookup per category, and the hybrid's choices and
regret. Each run measured its methods and plain decoding interleaved batch by batch; speedup is
the method's tokens per second over plain decoding's on the same prompts of the same run, in CPU
time of the process (`cpu_s`: on a CPU shared with other work it moves far less with their load)
and in wall time.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from pathlib import Path

from specdec.core import metrics
from specdec.study.report import markdown_table

# Every method of the study; runs made before a method was added lack it, and it is left out of their tables.
METHODS = ["ngram", "ngram_ca", "suffix", "suffix_ca", "draft1", "draft_ca", "eagle", "eagle_ca", "hybrid", "hybrid_bs"]
LABELS = {"ngram": "ngram k=8", "ngram_ca": "ngram k<=8 + policy", "suffix": "suffix k<=8",
          "suffix_ca": "suffix k<=8 + policy", "draft1": "draft=self k=1", "draft_ca": "draft=self k<=4 + policy",
          "eagle": "eagle (tree of 4, depth 2)", "eagle_ca": "eagle depth<=2 + policy", "hybrid": "hybrid",
          "hybrid_bs": "hybrid, leader kept across requests (standing=batch_size)"}
POLICY = {"ngram_ca": "ngram", "suffix_ca": "suffix", "draft_ca": "draft1", "eagle_ca": "eagle"}
PARTS = {"suffix": "suffix", "ngram": "ngram", "draft": "draft1", "eagle": "eagle"}  # the hybrid's part -> the method running it alone


def load(run: Path) -> tuple[dict, list[dict]]:
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines() if line]
    return summary, rows


def batches(rows: list[dict], method: str) -> list[list[dict]]:
    """The method's rows grouped by batch: a batch's rows are written together and share its CPU
    time (`cpu_s` is the batch's); the order of the roles rotates between batches, so with two
    roles one of them ends a batch and starts the next."""
    groups: list[list[dict]] = []
    previous = None
    for r in rows:
        if r["method"] == method:
            if previous is None or previous["method"] != method or previous["cpu_s"] != r["cpu_s"]:
                groups.append([])
            groups[-1].append(r)
        previous = r
    return groups


def draft_lengths(rows: list[dict], method: str) -> tuple[Counter, float, int]:
    """Steps per scored draft length (batch level), the share of steps in which rows of one batch
    drafted different lengths, and the number of steps."""
    hist, mixed, steps = Counter(), 0, 0
    for group in batches(rows, method):
        hist.update(group[0]["step_draft_lengths"])
        lists = [g["draft_lengths"] for g in group]
        for i in range(max(map(len, lists))):
            seen = {xs[i] for xs in lists if i < len(xs)}
            steps += 1
            mixed += len(seen) > 1
    return hist, mixed / steps if steps else float("nan"), steps


BASE = "autoregressive"


def speed(rows: list[dict], clock: str) -> float:
    """Tokens per second of `clock` (wall_s or cpu_s) over the given rows."""
    return metrics.tokens_per_s(sum(r["new_tokens"] for r in rows), sum(r[clock] for r in rows))


def speedup(rows: list[dict], method: str, clock: str, keep=lambda r: True) -> float:
    """The method's speed over plain decoding's, on the same prompts of the same run."""
    mine = [r for r in rows if r["method"] == method and keep(r)]
    ids = {r["prompt_id"] for r in mine}
    base = [r for r in rows if r["method"] == BASE and r["prompt_id"] in ids]
    return metrics.speedup(speed(mine, clock), speed(base, clock)) if mine and base else float("nan")


def per_batch(rows: list[dict], method: str, clock: str) -> list[float]:
    """Speedups of the method's batches (each against plain decoding of the same batch)."""
    out = []
    for group in batches(rows, method):
        ids = {r["prompt_id"] for r in group}
        out.append(speedup(rows, method, clock, keep=lambda r, ids=ids: r["prompt_id"] in ids))
    return out


def tau(rows: list[dict], method: str) -> float:
    mine = [r for r in rows if r["method"] == method]
    return metrics.mean_accepted_length(sum(r["emitted"] for r in mine), sum(r["steps"] for r in mine))


def table(head: list[str], rows: list[list[str]], left=(0,)) -> None:
    print("\n".join(markdown_table(head, rows, left)))


def spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    """median (min-max), or the value alone for one."""
    xs = [x for x in xs if x == x]
    if not xs:
        return "-"
    if len(xs) == 1:
        return fmt.format(xs[0])
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def main(roots: list[Path]) -> None:
    """`roots`: one folder per repetition of run.sh, each holding b1, b4, b16. Speedups are per
    repetition (each against plain decoding interleaved in that run), then median (min-max) over
    repetitions; draft lengths, tau and the hybrid's choices are pooled."""
    sizes = [b for b in (1, 4, 16) if any((r / f"b{b}" / "summary.json").exists() for r in roots)]
    reps = {b: [load(r / f"b{b}")[1] for r in roots if (r / f"b{b}" / "summary.json").exists()] for b in sizes}
    pooled = {b: [row for rows in reps[b] for row in rows] for b in sizes}
    n = max(len(v) for v in reps.values())
    present = {r["method"] for rows in pooled.values() for r in rows}
    methods = [m for m in METHODS if m in present]
    policy = {m: fixed for m, fixed in POLICY.items() if m in present}
    parts = [p for p, m in PARTS.items() if m in present or p == "draft"]
    cell = "median (min-max) over repetitions" if n > 1 else "one run"

    print(f"## Speedup against batch size: CPU time, {cell}; wall time median; tau\n")
    by_size = ["method", *(f"batch {b}" for b in sizes)]
    table(by_size, [[LABELS[m], *(f"{spread([speedup(rows, m, 'cpu_s') for rows in reps[b]], '{:.2f}x')} "
                                   f"({statistics.median(speedup(rows, m, 'wall_s') for rows in reps[b]):.2f}x), "
                                   f"{tau(pooled[b], m):.2f}" for b in sizes)] for m in methods])
    print("\nplain decoding: " + ", ".join(
        f"batch {b}: {spread([speed([r for r in rows if r['method'] == BASE], 'cpu_s') for rows in reps[b]], '{:.1f}')} "
        f"tok/CPU-s, {spread([speed([r for r in rows if r['method'] == BASE], 'wall_s') for rows in reps[b]], '{:.1f}')}"
        " tok/s wall" for b in sizes))

    print("\n## Per-batch CPU-time speedup, all batches of all repetitions: median (min-max)\n")
    table(by_size, [[LABELS[m], *(spread([x for rows in reps[b] for x in per_batch(rows, m, "cpu_s")]) for b in sizes)]
                    for m in methods])

    print("\n## Draft lengths the policy chose (scored drafts per step, from results.jsonl)\n")
    lines = []
    for m in policy:
        for b in sizes:
            hist, mixed, steps = Counter(), 0.0, 0
            for rows in reps[b]:
                h, x, s_ = draft_lengths(rows, m)
                hist.update(h)
                mixed, steps = mixed + x * s_, steps + s_
            total = sum(hist.values()) or 1
            share = [sum(c for k, c in hist.items() if lo <= k <= hi) / total
                     for lo, hi in ((0, 0), (1, 2), (3, 4), (5, 8))]
            lines.append([LABELS[m], str(b), str(total), *(f"{x:.0%}" for x in share),
                          f"{metrics.ratio(mixed, steps):.0%}"])
    table(["method", "batch", "steps", "plain steps", "1-2", "3-4", "5-8", "rows differ"], lines)

    print(f"\n## Goals (CPU time, {cell})\n")
    for m, fixed in policy.items():
        for b in sizes:
            xs = [speedup(rows, m, "cpu_s") for rows in reps[b]]
            x = statistics.median(xs)
            line = f"- {LABELS[m]}, batch {b}: {spread(xs, '{:.2f}x')} vs plain ({'>=' if x >= 0.97 else '<'} 0.97)"
            if b == 1:
                ratios = [speedup(rows, m, "cpu_s") / speedup(rows, fixed, "cpu_s") for rows in reps[b]]
                line += f"; over fixed {LABELS[fixed]}: {spread(ratios, '{:.3f}')}"
            print(line)
    for b in sizes:  # the hybrid's parts run alone: with their fixed k, and also with the policy
        hybrid = [speedup(rows, "hybrid", "cpu_s") for rows in reps[b]]
        alone = [PARTS[p] for p in parts if PARTS[p] in present]
        for kind, names in (("alone", alone), ("alone or with the policy", alone + [m for m, f in policy.items() if f in alone])):
            speeds = {m: [speedup(rows, m, "cpu_s") for rows in reps[b]] for m in names}
            best = max(speeds, key=lambda m: statistics.median(speeds[m]))
            ratio = [h / max(speedup(rows, m, "cpu_s") for m in names) for h, rows in zip(hybrid, reps[b])]
            print(f"- hybrid, batch {b}: {spread(hybrid, '{:.2f}x')}; best part {kind}: {LABELS[best]} "
                  f"{spread(speeds[best], '{:.2f}x')}; hybrid over the best of them in the same run: {spread(ratio, '{:.3f}')}")

    if 1 in sizes:
        cats = list(dict.fromkeys(r["category"] for r in pooled[1]))
        print(f"\n## Suffix decoding against n-gram lookup per category (batch 1, requests in sequence), {cell}\n")
        print("CPU-time speedup (tau)\n")
        lines = []
        for m in [m for m in ("ngram", "suffix", "ngram_ca", "suffix_ca", "eagle", "hybrid") if m in present]:
            cells = []
            for c in cats:
                xs = [speedup([r for r in rows if r["category"] == c], m, "cpu_s") for rows in reps[1]]
                cells.append(f"{statistics.median(xs):.2f}x ({tau([r for r in pooled[1] if r['category'] == c], m):.2f})")
            overall = statistics.median(speedup(rows, m, "cpu_s") for rows in reps[1])
            lines.append([LABELS[m], f"{overall:.2f}x", *cells])
        table(["method", "overall", *cats], lines)

    print("\n## The hybrid: choices per step and regret against the best fixed option in hindsight\n")
    lines = []
    for b in sizes:
        counts, regrets, best, followed = Counter(), [], Counter(), Counter()
        for rows in reps[b]:
            for group in batches(rows, "hybrid"):
                for rep in group[0]["reports"]:
                    p = rep["proposer"]
                    counts.update(p["counts"])
                    followed.update(p.get("followed", {}))
                    if p["regret"] is not None:
                        regrets.append(p["regret"])
                        best[p["best_in_hindsight"]] += 1
        total = sum(counts.values()) or 1
        lines.append([str(b), str(total), *(f"{counts[p] / total:.0%}" for p in (*parts, "plain")),
                      spread(regrets, "{:.3f}"), ", ".join(f"{k} {v}" for k, v in best.most_common()),
                      ", ".join(f"{k} {v}" for k, v in followed.most_common())])
    table(["batch", "steps", *parts, "plain", "regret median (min-max)", "best in hindsight",
           "strategy followed (steps)"], lines, left=(len(parts) + 4, len(parts) + 5))


if __name__ == "__main__":
    main([Path(a) for a in sys.argv[1:]] or [Path("experiments/policy/runs")])
