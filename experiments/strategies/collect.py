"""Print the study's tables from the summary.json files of its runs.

    python experiments/strategies/collect.py multirun/2026-11-29_*     # the sweep folders of run.sh
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CATEGORIES = ["multi_turn", "translation", "summarization", "qa", "math_reasoning", "rag"]


def label(s: dict) -> str:
    name = s["method"]
    if s.get("draft") not in (None, "none"):
        name += f"({s['draft']})"
    extra = s.get("method_overrides", "")
    return f"{name} k={s['num_speculative_tokens']} {s['schedule']}{extra}"


def load(dirs: list[str]) -> list[dict]:
    out = []
    for d in dirs:
        for path in sorted(Path(d).glob("**/summary.json")):
            s = json.loads(path.read_text())
            cfg = (path.parent / ".hydra" / "overrides.yaml")
            exit_layer = ""
            if cfg.is_file() and "exit_layer" in cfg.read_text():
                exit_layer = " exit=" + cfg.read_text().split("exit_layer=")[1].split()[0]
            s["method_overrides"] = exit_layer
            s["_dir"] = str(path.parent)
            out.append(s)
    return out


def f(x, spec=".2f", suffix=""):
    return "-" if x is None or x != x else f"{x:{spec}}{suffix}"


def main(dirs: list[str]) -> None:
    runs = load(dirs)
    for temp in sorted({s["temperature"] for s in runs}):
        group = [s for s in runs if s["temperature"] == temp]
        print(f"\n### temperature {temp}\n")
        print("| method | lossless | speedup | tau | alpha | predicted | c | verify cost | tok/s | base tok/s | = baseline |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for s in group:
            o = s["methods"][s["method"]]["overall"]
            print(f"| {label(s)} | {'yes' if s['lossless'] else '**no**'} | {f(o['speedup'], '.2f', 'x')} | "
                  f"{f(o['mean_accepted_length'])} | {f(o['acceptance_rate'])} | {f(o['predicted_speedup'], '.2f', 'x')} | "
                  f"{f(o['c'])} | {f(o.get('verify_cost'))} | {f(o['tokens_per_s'], '.1f')} | "
                  f"{f(s['baseline_tokens_per_s'], '.1f')} | {f(o.get('matches_baseline'), '.0%')} |")
        print("\nspeedup per category (tau in brackets)\n")
        print("| method | " + " | ".join(CATEGORIES) + " |")
        print("|---|" + "---:|" * len(CATEGORIES))
        for s in group:
            cats = s["methods"][s["method"]]["categories"]
            cells = [f"{f(cats[c]['speedup'], '.2f', 'x')} ({f(cats[c]['mean_accepted_length'])})" if c in cats else "-"
                     for c in CATEGORIES]
            print(f"| {label(s)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
