"""Append one results.csv row per method of a study run (its summary.json), in the study's columns:
the drafter's vocabulary and tree shape, speedup over plain decoding (tau) overall and per Spec-Bench
category, alpha, acceptance per depth, measured/predicted, the fraction of outputs equal to plain
decoding's, and the command that made the run.

    python experiments/drafters/collect.py <run folder> <run name> "<command>" [--vocab method=size ...]
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
CATEGORIES = ("multi_turn", "translation", "summarization", "qa", "math_reasoning", "rag")
COLUMNS = ("run", "prompts", "method", "drafter", "draft_vocab", "tree", "overall", *CATEGORIES, "alpha", "acceptance_by_depth",
           "measured/predicted", "lossless", "command")


def cell(m: dict | None) -> str:
    return "-" if not m else f"{m['speedup']:.2f}x ({m['mean_accepted_length']:.2f})"


def drafter(config: dict, vocab: dict[str, str], name: str) -> tuple[str, str, str]:
    """(drafter folder's name, its draft vocabulary size, the tree shape) of a method's config."""
    path = config.get("heads_path")
    size = vocab.get(name, "-")
    folder = Path(str(path)) if path else None
    if folder is not None and (folder / "config.json").is_file():
        size = str(json.loads((folder / "config.json").read_text()).get("draft_vocab_size", size))
    p = config.get("proposer") or {}
    tree = f"budget {p['budget']}, depth {p['depth']}" if "budget" in p else "-"
    return (folder.name if folder else "-"), size, tree


def rows(summary: dict, run: str, command: str, vocab: dict[str, str]) -> list[dict]:
    out = []
    for name, m in summary["methods"].items():
        if name.startswith("autoregressive"):
            continue
        overall = m["overall"]
        depth = overall.get("per_position_acceptance_rate") or []
        folder, size, tree = drafter(summary["method_configs"].get(name, {}), vocab, name)
        out.append({"run": run, "prompts": overall["num_prompts"], "method": name, "drafter": folder,
                    "draft_vocab": size, "tree": tree,
                    "overall": cell(overall), **{c: cell(m["categories"].get(c)) for c in CATEGORIES},
                    "alpha": f"{overall['acceptance_rate']:.2f}",
                    "acceptance_by_depth": " / ".join(f"{x:.2f}" for x in depth),
                    "measured/predicted": f"{overall['measured_over_predicted']:.2f}",
                    "lossless": f"{overall['matches_baseline']:.2f}", "command": command})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("run")
    parser.add_argument("command")
    parser.add_argument("--vocab", nargs="*", default=[], help="method=draft vocabulary size")
    args = parser.parse_args()
    summary = json.loads((args.run_dir / "summary.json").read_text())
    new = rows(summary, args.run, args.command, dict(v.split("=", 1) for v in args.vocab))
    path = HERE / "results.csv"
    exists = path.is_file()
    with path.open("a", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, COLUMNS)
        if not exists:
            writer.writeheader()
        writer.writerows(new)
    for r in new:
        print(r["method"], r["overall"], r["alpha"], r["acceptance_by_depth"])


if __name__ == "__main__":
    main()
