"""Tables of the policy study from its run folders (experiments/policy/run.sh):

    python experiments/policy/collect.py [experiments/policy/runs]

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

METHODS = ["ngram", "ngram_ca", "suffix", "suffix_ca", "draft1", "draft_ca", "hybrid"]
LABELS = {"ngram": "ngram k=8", "ngram_ca": "ngram k<=8 + policy", "suffix": "suffix k<=8",
          "suffix_ca": "suffix k<=8 + policy", "draft1": "draft=self k=1", "draft_ca": "draft=self k<=4 + policy",
          "hybrid": "hybrid (suffix, ngram, draft=self; k<=8)"}
POLICY = {"ngram_ca": "ngram", "suffix_ca": "suffix", "draft_ca": "draft1"}


def load(run: Path) -> tuple[dict, list[dict]]:
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines() if line]
    return summary, rows


def batches(rows: list[dict], method: str) -> list[list[dict]]:
    """The method's rows grouped by batch: a batch's rows are written together, and the roles
    alternate between batches."""
    groups: list[list[dict]] = []
    previous = None
    for r in rows:
        if r["method"] == method:
            if previous != method:
                groups.append([])
            groups[-1].append(r)
        previous = r["method"]
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
    seconds = sum(r[clock] for r in rows)
    return sum(r["new_tokens"] for r in rows) / seconds if seconds else float("nan")


def speedup(rows: list[dict], method: str, clock: str, keep=lambda r: True) -> float:
    """The method's speed over plain decoding's, on the same prompts of the same run."""
    mine = [r for r in rows if r["method"] == method and keep(r)]
    ids = {r["prompt_id"] for r in mine}
    base = [r for r in rows if r["method"] == BASE and r["prompt_id"] in ids]
    return speed(mine, clock) / speed(base, clock) if mine and base else float("nan")


def per_batch(rows: list[dict], method: str, clock: str) -> list[float]:
    """Speedups of the method's batches (each against plain decoding of the same batch)."""
    out = []
    for group in batches(rows, method):
        ids = {r["prompt_id"] for r in group}
        out.append(speedup(rows, method, clock, keep=lambda r, ids=ids: r["prompt_id"] in ids))
    return out


def tau(rows: list[dict], method: str) -> float:
    mine = [r for r in rows if r["method"] == method]
    steps = sum(r["steps"] for r in mine)
    return sum(r["emitted"] for r in mine) / steps if steps else float("nan")


def main(root: Path) -> None:
    runs = {b: root / f"b{b}" for b in (1, 4, 16) if (root / f"b{b}" / "summary.json").exists()}
    data = {b: load(p) for b, p in runs.items()}

    print("## Speedup against batch size: CPU time (wall time), tau\n")
    print("| method | " + " | ".join(f"batch {b}" for b in data) + " |")
    print("|---|" + "---:|" * len(data))
    for m in METHODS:
        cells = [f"{speedup(rows, m, 'cpu_s'):.2f}x ({speedup(rows, m, 'wall_s'):.2f}x), {tau(rows, m):.2f}"
                 for _, rows in data.values()]
        print(f"| {LABELS[m]} | " + " | ".join(cells) + " |")
    print("\nplain decoding: " + ", ".join(
        f"batch {b}: {speed([r for r in rows if r['method'] == BASE], 'cpu_s'):.1f} tok/CPU-s, "
        f"{speed([r for r in rows if r['method'] == BASE], 'wall_s'):.1f} tok/s wall" for b, (_, rows) in data.items()))

    print("\n## Per-batch CPU-time speedup: median (min-max)\n")
    print("| method | " + " | ".join(f"batch {b}" for b in data) + " |")
    print("|---|" + "---:|" * len(data))
    for m in METHODS:
        cells = []
        for _, rows in data.values():
            xs = per_batch(rows, m, "cpu_s")
            cells.append(f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})" if xs else "-")
        print(f"| {LABELS[m]} | " + " | ".join(cells) + " |")

    print("\n## Draft lengths the policy chose (scored drafts per step, from results.jsonl)\n")
    print("| method | batch | steps | plain steps | 1-2 | 3-4 | 5-8 | rows differ |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for m in POLICY:
        for b, (_, rows) in data.items():
            hist, mixed, steps = draft_lengths(rows, m)
            n = sum(hist.values()) or 1
            share = [sum(c for k, c in hist.items() if lo <= k <= hi) / n for lo, hi in ((0, 0), (1, 2), (3, 4), (5, 8))]
            print(f"| {LABELS[m]} | {b} | {n} | " + " | ".join(f"{x:.0%}" for x in share) + f" | {mixed:.0%} |")

    print("\n## Goals (CPU time; wall time in brackets)\n")
    for m, fixed in POLICY.items():
        for b, (_, rows) in data.items():
            x, w = speedup(rows, m, "cpu_s"), speedup(rows, m, "wall_s")
            line = f"- {LABELS[m]}, batch {b}: {x:.2f}x ({w:.2f}x) vs plain ({'>=' if x >= 0.97 else '<'} 0.97)"
            if b == 1:
                f = speedup(rows, fixed, "cpu_s")
                line += f"; fixed {LABELS[fixed]} {f:.2f}x: ratio {x / f:.3f}"
            print(line)
    for b, (_, rows) in data.items():
        parts = {m: speedup(rows, m, "cpu_s") for m in ("suffix", "ngram", "draft1")}
        best = max(parts, key=parts.get)
        print(f"- hybrid, batch {b}: {speedup(rows, 'hybrid', 'cpu_s'):.2f}x; best part {LABELS[best]} {parts[best]:.2f}x")

    if 1 in data:
        _, rows = data[1]
        cats = list(dict.fromkeys(r["category"] for r in rows))
        print("\n## Suffix decoding against n-gram lookup per category (batch 1, requests in sequence)\n")
        print("CPU-time speedup (tau)\n")
        print("| method | overall | " + " | ".join(cats) + " |")
        print("|---|---:|" + "---:|" * len(cats))
        for m in ("ngram", "suffix", "ngram_ca", "suffix_ca"):
            cells = []
            for c in cats:
                sub = [r for r in rows if r["category"] == c]
                cells.append(f"{speedup(sub, m, 'cpu_s'):.2f}x ({tau(sub, m):.2f})")
            print(f"| {LABELS[m]} | {speedup(rows, m, 'cpu_s'):.2f}x | " + " | ".join(cells) + " |")

    print("\n## The hybrid: choices per step and regret against the best fixed option in hindsight\n")
    print("| batch | steps | suffix | ngram | draft | plain | regret median (min-max) | best in hindsight "
          "| strategy followed (steps) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for b, (_, rows) in data.items():
        counts, regrets, best, followed = Counter(), [], Counter(), Counter()
        for group in batches(rows, "hybrid"):
            for rep in group[0]["reports"]:
                p = rep["proposer"]
                counts.update(p["counts"])
                followed.update(p.get("followed", {}))
                if p["regret"] is not None:
                    regrets.append(p["regret"])
                    best[p["best_in_hindsight"]] += 1
        n = sum(counts.values()) or 1
        reg = f"{statistics.median(regrets):.3f} ({min(regrets):.3f}-{max(regrets):.3f})" if regrets else "-"
        print(f"| {b} | {n} | " + " | ".join(f"{counts[p] / n:.0%}" for p in ("suffix", "ngram", "draft", "plain"))
              + f" | {reg} | " + ", ".join(f"{k} {v}" for k, v in best.most_common()) + " | "
              + ", ".join(f"{k} {v}" for k, v in followed.most_common()) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("experiments/policy/runs"))
