"""Write experiments/peers/results.csv from the runs' summary.json files (experiments/peers/runs/<run>/).

    python experiments/peers/collect.py

One row per method and run: tokens/s, speedup over specdec's plain decoding and over the fastest plain
decoding of the run, tau, alpha, the fraction of prompts with the tokens of specdec's plain decoding,
vLLM's start-up, and the command that made the run (COMMANDS).

A run with `repeats=2` (the compiled one) reports tokens/s from its last repeat: the first
compiles each new shape's graph while timed (specdec's; vLLM's n-gram also ran faster in its second
repeat). Suffix decoding's rows would come from the first: it keeps the outputs of earlier requests,
so a second pass over the same prompts would find its own answers.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE = ("SPECDEC_VLLM_PYTHON=~/vllm/bin/python python -m specdec experiment=spec_bench_greedy "
        "method=ngram +method@compare.vllm=vllm +method@compare.vllm_ngram=vllm_ngram logger=none plots=false")
COMMANDS = {
    **{run: f"{BASE} data.limit=1 repeats=2 compile=on engine.compile_options.autotune=true "
               f"hydra.run.dir=experiments/peers/runs/{run}" for run in ("cpu_compiled", "cpu_compiled_2")},
    "cpu_2": f"{BASE} data.limit=2 +method@compare.suffix=suffix hydra.run.dir=experiments/peers/runs/cpu_2",
    "cpu_float32": f"{BASE} data.limit=1 generation.max_new_tokens=64 dtype=float32 "
                   "hydra.run.dir=experiments/peers/runs/cpu_float32",
}


def _num(x, spec: str, suffix: str = "") -> str:
    return "-" if x is None or x != x else f"{x:{spec}}{suffix}"


def startup(run: Path, method: str) -> float | None:
    for line in (run / "results.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["method"] == method:
            return next((t["vllm"]["startup_s"] for t in row["reports"] if "vllm" in t), None)
    return None


def repeat_speeds(run: Path) -> dict[str, float]:
    """Tokens/s per method, new tokens over wall seconds, over the run's last repeat (suffix
    decoding's: its first; module docstring)."""
    results = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    last = max(r["repeat"] for r in results)
    tokens: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for r in results:
        if r["repeat"] == (0 if "suffix" in r["method"] else last):
            tokens[r["method"]] = tokens.get(r["method"], 0) + r["new_tokens"]
            seconds[r["method"]] = seconds.get(r["method"], 0) + r["wall_s"]
    return {m: tokens[m] / seconds[m] for m in tokens}


def rows() -> list[dict]:
    out = []
    for name, command in COMMANDS.items():
        run = HERE / "runs" / name
        s = json.loads((run / "summary.json").read_text())
        speeds = {m: b["overall"]["tokens_per_s"] for m, b in s["methods"].items()}
        if "repeats=2" in command:
            speeds = repeat_speeds(run)
        plain = {m: speeds[m] for m, b in s["methods"].items()
                 if b["overall"]["proposed"] == 0 and b["overall"]["steps"]}  # the summary's own rule
        fastest = max(plain.values())
        own_plain = speeds["autoregressive"]
        for method, block in s["methods"].items():
            o = block["overall"]
            out.append({
                "run": name, "dtype": s.get("dtype", ""), "prompts": o["num_prompts"], "method": method,
                "engine": "vLLM" if method.startswith("vllm") else "specdec",
                "tok/s": _num(speeds[method], ".1f"), "over specdec plain": _num(speeds[method] / own_plain, ".2f", "x"),
                "over fastest plain": _num(speeds[method] / fastest, ".2f", "x"),
                "tau": _num(o["mean_accepted_length"], ".2f"), "alpha": _num(o["acceptance_rate"], ".2f"),
                "same tokens": _num(o["matches_baseline"], ".2f"),
                "start-up s": _num(startup(run, method), ".0f") if method.startswith("vllm") else "-",
                "command": command})
    return out


def main() -> None:
    table = rows()
    with (HERE / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)


if __name__ == "__main__":
    main()
