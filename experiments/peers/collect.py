"""Write experiments/peers/results.csv from the runs' summary.json files (experiments/peers/runs/<run>/).

    python experiments/peers/collect.py

One row per method and run: tokens per wall second and per CPU second, the CPU seconds per wall
second, speedup over specdec's plain decoding and over the fastest plain decoding of the run, tau, alpha, the fraction of prompts with the tokens of specdec's plain decoding,
vLLM's start-up, and the command that made the run (COMMANDS).

A run with `repeats=2` (the compiled ones) reports tokens/s from its last repeat: the first
compiles each new shape's graph while timed (specdec's; vLLM's n-gram also ran faster in its second
repeat). Suffix decoding keeps the outputs of earlier requests, so a second pass over the same
prompts would find its own answers: `cpu_suffix` turns both engines' cross-request caches off.
So, for the same reason, does vLLM's prefix cache since `cpu_tree4_2` (`specdec.study.peers.ENGINE_DEFAULTS`).
The runs before it ran with the cache on, vLLM's default then: with it, vLLM skipped the prefills of the
measured repeat. To run them as they ran, add `+compare.<key>.decoder.engine_args.enable_prefix_caching=true`
for each vLLM method (LOG.md 13).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUN = "SPECDEC_VLLM_PYTHON=~/vllm/bin/python python -m specdec experiment=spec_bench_greedy"
ANCHORS = "+method@compare.vllm=vllm +method@compare.vllm_ngram=vllm_ngram logger=none plots=false"
BASE = f"{RUN} method=ngram {ANCHORS}"
COMPILED = "data.limit=1 repeats=2 compile=on engine.compile_options.autotune=true"
UNPINNED = " compare.vllm.decoder.pin=false compare.vllm_ngram.decoder.pin=false"


def vllm_suffix(key: str, factor: int | None = None) -> str:
    """vLLM's suffix decoding as `compare.<key>`: k = 8, its cross-request cache off (a second repeat
    would find the first's answers), `suffix_decoding_max_spec_factor=factor` where given."""
    name = "" if key == "vllm_suffix" else f" compare.{key}.name={key}"
    args = f"+compare.{key}.decoder.speculative_args.suffix_decoding_"
    out = f"+method@compare.{key}=vllm_suffix{name} compare.{key}.num_speculative_tokens=8 {args}max_cached_requests=0"
    return out + (f" {args}max_spec_factor={factor}" if factor else "")


def corpus_run(name: str, corpus: str, options: str = "") -> str:
    """specdec's suffix decoding from the datastore `corpus` (under runs/) as `name`, with `options`,
    beside specdec's and vLLM's suffix decoding without one; cross-request caches off."""
    return (f"{RUN} method=suffix method.name={name} {ANCHORS} {COMPILED} method.proposer.max_cached_requests=0 "
            f"method.proposer.corpus=experiments/peers/runs/{corpus} {options}"
            f"+method@compare.suffix=suffix compare.suffix.proposer.max_cached_requests=0 {vllm_suffix('vllm_suffix')}")


# The larger datastore, drafts up to twice the match length, and vLLM's suffix method at both factors;
# four vLLM workers fit in memory with 1 GiB of KV cache each.
CORPUS_XL = (f"VLLM_CPU_KVCACHE_SPACE=1 {corpus_run('suffix_corpus_f2', 'corpus-xl.jsonl', 'method.proposer.max_spec_factor=2 ')} "
             f"{vllm_suffix('vllm_suffix_f2', 2)}")
# Suffix decoding's token trees from the same datastore beside vLLM's best method, its suffix decoding at
# factor 2, alone (with section 10's chain beside it, the run compiled both forms' graphs and did not fit
# in time or memory; LOG.md 12). experiments/peers/draft_replay.py chose the rules: budget 11 (12 wide at
# most), drafts up to 3x the match length, paths down to 3% under the counts; and budget 3 (4 wide at
# most: the widest pass whose products run on inductor's C++ GEMMs under autotune, LOG.md 13).
def tree_run(budget: int, factor: int) -> str:
    return (f"VLLM_CPU_KVCACHE_SPACE=1 {RUN} method=suffix_tree method.name=suffix_tree_corpus "
            f"method.proposer.budget={budget} method.proposer.max_spec_factor={factor} method.proposer.min_token_prob=0.03 "
            "method.proposer.max_cached_requests=0 method.proposer.corpus=experiments/peers/runs/corpus-xl.jsonl "
            f"{vllm_suffix('vllm_suffix_f2', 2)} logger=none plots=false {COMPILED}")


COMMANDS = {
    # vLLM's worker pinned to one core: the anchor's default since these runs; the two after it left it free
    **{run: f"{BASE} {COMPILED}{pin} hydra.run.dir=experiments/peers/runs/{run}"
       for run, pin in (("cpu_pinned", ""), ("cpu_pinned_2", ""), *((r, UNPINNED) for r in ("cpu_compiled", "cpu_compiled_2")))},
    # n-gram lookup at k = 8 beside k = 4, and vLLM's at both
    "cpu_k8": f"{BASE} {COMPILED} method.num_speculative_tokens=8 +method@compare.ngram4=ngram "
              "compare.ngram4.num_speculative_tokens=4 +method@compare.vllm_ngram8=vllm_ngram "
              "compare.vllm_ngram8.num_speculative_tokens=8 hydra.run.dir=experiments/peers/runs/cpu_k8",
    # suffix decoding in both engines, their cross-request caches off (the second repeat would find the first's answers)
    "cpu_suffix": f"{RUN} method=suffix {ANCHORS} {COMPILED} method.proposer.max_cached_requests=0 "
                  f"+method@compare.ngram=ngram {vllm_suffix('vllm_suffix')} hydra.run.dir=experiments/peers/runs/cpu_suffix",
    # suffix decoding with a datastore of the target's answers to other prompts (scripts/train_heads.py kind=corpus)
    # beside suffix decoding without one, in both engines; otherwise as cpu_suffix. cpu_corpus_2 repeats it.
    **{run: f"{corpus_run('suffix_corpus', 'corpus-large.jsonl')} hydra.run.dir=experiments/peers/runs/{run}"
       for run in ("cpu_corpus", "cpu_corpus_2")},
    **{run: f"{CORPUS_XL} hydra.run.dir=experiments/peers/runs/{run}" for run in ("cpu_corpus_xl", "cpu_corpus_xl_2")},
    "cpu_tree_only": f"{tree_run(11, 3)} hydra.run.dir=experiments/peers/runs/cpu_tree_only",
    **{run: f"{tree_run(3, 2)} hydra.run.dir=experiments/peers/runs/{run}" for run in ("cpu_tree4", "cpu_tree4_2", "cpu_tree4_3")},
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


def timed(run: Path) -> dict[str, tuple[float, float]]:
    """(tokens per wall second, tokens per CPU second) per method, new tokens over the seconds of
    the run's last repeat (module docstring). CPU seconds are the process's: vLLM's speculative
    methods keep a second thread busy, so there they exceed the wall's."""
    results = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    last = max(r["repeat"] for r in results)
    sums: dict[str, list[float]] = {}
    for r in results:
        if r["repeat"] == last:
            total = sums.setdefault(r["method"], [0.0, 0.0, 0.0])
            total[0] += r["new_tokens"]
            total[1] += r["wall_s"]
            total[2] += r["cpu_s"]
    return {m: (t / wall, t / cpu) for m, (t, wall, cpu) in sums.items()}


def rows() -> list[dict]:
    """The rows of every run in COMMANDS: read again from runs/<run>/ where that folder is here, else
    kept from results.csv (the runs' raw outputs stay out of git; their rows are the record)."""
    kept: dict[str, list[dict]] = {}
    if (HERE / "results.csv").exists():
        with (HERE / "results.csv").open(newline="") as f:
            for row in csv.DictReader(f):
                kept.setdefault(row["run"], []).append(row)
    out = []
    for name, command in COMMANDS.items():
        run = HERE / "runs" / name
        if not (run / "summary.json").exists():  # not made here: its recorded rows, if any
            out += kept.get(name, [])
            print(f"kept {len(kept.get(name, []))} rows of {name}: no {run / 'summary.json'}")
            continue
        s = json.loads((run / "summary.json").read_text())
        speeds = timed(run)
        plain = {m: speeds[m][0] for m, b in s["methods"].items()
                 if b["overall"]["proposed"] == 0 and b["overall"]["steps"]}  # the summary's own rule
        fastest = max(plain.values())
        own_plain = speeds["autoregressive"][0]
        for method, block in s["methods"].items():
            o = block["overall"]
            wall, cpu = speeds[method]
            out.append({
                "run": name, "dtype": s.get("dtype", ""), "prompts": o["num_prompts"], "method": method,
                "engine": "vLLM" if method.startswith("vllm") else "specdec",
                "tok/s": _num(wall, ".1f"), "tok/CPU-s": _num(cpu, ".1f"), "CPU/wall": _num(wall / cpu, ".2f"),
                "over specdec plain": _num(wall / own_plain, ".2f", "x"),
                "over fastest plain": _num(wall / fastest, ".2f", "x"),
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
