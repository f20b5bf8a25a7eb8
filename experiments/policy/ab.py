"""Every method of some run folders side by side, for A/B runs of policy settings (a method and its
variant with one setting changed, as separate `compare.<name>` entries of one run):

    python experiments/policy/ab.py RUN_FOLDER [RUN_FOLDER ...]   # each holding b1, b4, b16

Per method and batch size: CPU-time speedup over plain decoding interleaved in the same run, median
(min-max) over the folders (repetitions), and the share of steps that drafted, pooled; then the
steps each batch took (its longest row's: a static batch ends with it) and how many of them
drafted, median over the folders, batch by batch. Unlike `collect.py` it takes whatever methods the
runs hold, under their own names.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from collect import BASE, batches, load, speedup, spread, table  # noqa: E402


def drafting_share(rows: list[dict], method: str) -> float:
    steps = [n for r in rows if r["method"] == method for n in r["step_draft_lengths"]]
    return sum(n > 0 for n in steps) / max(len(steps), 1)


def batch_steps(runs: list[list[dict]], method: str) -> str:
    """Per batch (in the order run): steps / drafting steps, medians over the runs."""
    per_run = [[(len(g[0]["step_draft_lengths"]), sum(n > 0 for n in g[0]["step_draft_lengths"]))
                for g in batches(rows, method)] for rows in runs]
    cells = []
    for i in range(min(map(len, per_run), default=0)):
        steps = statistics.median(run[i][0] for run in per_run)
        drafting = statistics.median(run[i][1] for run in per_run)
        cells.append(f"{steps:g} / {drafting:g}")
    return ", ".join(cells)


def main(roots: list[Path]) -> None:
    sizes = [b for b in (1, 4, 16) if any((r / f"b{b}" / "summary.json").exists() for r in roots)]
    reps = {b: [load(r / f"b{b}")[1] for r in roots if (r / f"b{b}" / "summary.json").exists()] for b in sizes}
    methods = list(dict.fromkeys(r["method"] for rows in reps[sizes[0]] for r in rows if r["method"] != BASE))
    print(f"CPU-time speedup over plain decoding, median (min-max) over {len(roots)} runs; share of steps drafting\n")
    table(["method", *(f"batch {b}" for b in sizes)],
          [[m, *(f"{spread([speedup(rows, m, 'cpu_s') for rows in reps[b]], '{:.2f}x')}, "
                 f"{drafting_share([r for rows in reps[b] for r in rows], m):.0%}" for b in sizes)] for m in methods])
    print("\nSteps of each batch, in the order run / steps of it that drafted (medians over the runs)\n")
    table(["method", *(f"batch {b}" for b in sizes)],
          [[m, *(batch_steps(reps[b], m) for b in sizes)] for m in [*methods, BASE]])


if __name__ == "__main__":
    main([Path(a) for a in sys.argv[1:]])
