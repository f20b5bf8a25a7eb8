"""Modeled speedup of each batch of some run folders: plain decoding's steps over the method's
steps, each priced at the target pass it scored, rho(B, T), measured on this machine.

    python experiments/policy/modeled.py --widths WIDTHS.json RUN_FOLDER [RUN_FOLDER ...]

WIDTHS.json holds rho(B, T) (the target's pass over B x T tokens, over T = 1) for B = 1, 2, 4, 16
and T = 1..9; when the file does not exist it is measured first (`profile_step.width_costs`, the
embedded target in its default dtype, Spec-Bench qa, translation and math_reasoning prompts, 1
thread, about a minute) and written. A batch's step count and the width of each of its steps are
decided by the policy from what it measured, but once decided they are fixed numbers: priced with
one table, two methods compare without the machine's noise in between (CPU time of a batch of
identical work moved 0.9-1.5x between repetitions on a shared machine). What it leaves out:
drafting (the lookups', the drafters' passes) and the policy's own work, both on top.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from collect import BASE, batches, load, table  # noqa: E402

SIZES = (1, 2, 4, 16)


def measure(path: Path) -> dict[int, dict[int, float]]:
    import torch
    from profile_step import width_costs

    from specdec import Engine, ModelSpec, load_model
    from specdec.study.data import build_turn_input, load_prompts

    torch.set_num_threads(1)
    model, tok = load_model(ModelSpec(path="embedded"))
    engine = Engine(model)
    prompts = load_prompts("spec_bench", categories=["qa", "translation", "math_reasoning"], limit=6)
    ids = [build_turn_input(tok, [], p.turns[0]) for p in prompts]
    widths = {b: width_costs(engine, ids[:b], reps=7) for b in SIZES}
    path.write_text(json.dumps(widths, indent=1))
    return widths


def read(path: Path) -> dict[int, dict[int, float]]:
    return {int(b): {int(t): c for t, c in row.items()} for b, row in json.loads(path.read_text()).items()}


def modeled(rows: list[dict], method: str, widths: dict[int, dict[int, float]]) -> list[float]:
    """Per batch of `method` (in the order run): plain decoding's steps on that batch over the sum
    of rho(rows of the batch, 1 + drafts scored) over the method's steps."""
    plain = batches(rows, BASE)
    out = []
    for group, base in zip(batches(rows, method), plain):
        rho = widths[len(group)]
        out.append(len(base[0]["step_draft_lengths"]) / sum(rho[1 + n] for n in group[0]["step_draft_lengths"]))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", type=Path, required=True, help="rho(B, T) as JSON; measured and written if absent")
    ap.add_argument("runs", type=Path, nargs="+", help="run folders, each holding b4 and/or b16")
    args = ap.parse_args(argv)
    widths = read(args.widths) if args.widths.exists() else measure(args.widths)
    print("rho(B, T) on this machine:", "; ".join(
        f"B={b}: " + ", ".join(f"{widths[b][t]:.2f}" for t in sorted(widths[b])) for b in sorted(widths)))
    for b in (4, 16):
        reps = [load(r / f"b{b}")[1] for r in args.runs if (r / f"b{b}" / "summary.json").exists()]
        if not reps:
            continue
        methods = list(dict.fromkeys(r["method"] for r in reps[0] if r["method"] != BASE))
        per = {m: [modeled(rows, m, widths) for rows in reps] for m in methods}
        count = min(len(x) for runs in per.values() for x in runs)
        print(f"\nBatch size {b}: modeled speedup of each batch over plain decoding, median (min-max) over "
              f"{len(reps)} runs\n")
        table(["method", *(f"batch {i + 1} ({len(batches(reps[0], methods[0])[i])} rows)" for i in range(count))],
              [[m, *(f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})"
                     for v in ([run[i] for run in per[m]] for i in range(count)))] for m in methods])


if __name__ == "__main__":
    main()
