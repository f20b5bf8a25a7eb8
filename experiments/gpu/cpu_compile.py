"""compile=off against compile=on (and compile=autotune) on this CPU, every method against its own
baseline in the same mode.

Does `compile=on` keep each speculative method's speedup over plain decoding? One run measures
every (method, compile) pair on the same prompts, each method as `conf/method/<name>.yaml` sets it
up for the embedded target: plain decoding; n-gram drafting (k = 4); the EAGLE-style drafter (the
shipped checkpoint, tree budget 4, topk 4, width 4, depth 2, k = 2); the shipped Medusa heads
(default tree, k = 4); layer skipping (the first 8 of 30 layers, k = 3); suffix decoding (k = 8)
and its trees (budget 8, k = 8), both without their cross-request index (each compiled decoder
decodes a prompt untimed right before its timed run: an index would hand it its own output). Each
under `compile=off` and `compile=on` (`--modes`: also `autotune`, inductor's GEMM autotuning, and
`unpacked`, the eager path with `packed_linear=off`: its linear layers through MKL as `nn.Linear`
runs them, where `off` packs them for oneDNN in float32, `specdec.accel.packed_linear`).

- Engines: one per (method kind, compile mode), all sharing the model object (same device and
  dtype). EAGLE and Medusa get engines of their own because their target keeps hidden states in
  every pass, which the other methods must not pay for.
- Exact greedy is off for every decoder: `compile=on` cannot apply it (its widths and key lengths
  are bucketed), and on the eager path it would pad plain decoding to 8-wide passes over the whole
  cache buffer, so `compile=on` would be credited with removing exact greedy's cost. Outputs are
  greedy; in bfloat16 they may differ at near-ties between modes and methods (`same_tokens`).
- Warm-up, untimed: every eager decoder (`off`, `unpacked`) decodes the first prompt briefly; then, right before each
  prompt's timed runs, every compiled decoder decodes that prompt once (which compiles every graph
  its timed runs reach: the same greedy tokens, so the same widths and key buckets; the run
  reports any graph compiled while timed). So the results file, written after every prompt, holds
  complete prompts even when a run is cut short.
- Timed: per prompt, the pairs run one after another, the order rotated by one from prompt to
  prompt (and, with `--repeats`, from repeat to repeat). Per pair and prompt, tokens/s by wall time
  and by the process's CPU time (what `GenerationStats.cpu_s` records, which other work on the
  machine disturbs far less), the median of the repeats.
- Reported per method: medians over prompts of its speedup over plain decoding in the same compile
  mode (off and on), of its compiled/eager ratio, and of its tokens/s; whether its speedup under
  `on` is at least its speedup under `off`; and the CPU time of one of its steps over one plain
  decoding step, per mode (the engine's share of the speedup: the tokens a step accepts also move
  between modes, where bfloat16 outputs part at a near-tie and the method then drafts on other text).

EOS is ignored, so every call makes exactly --max-new-tokens tokens.

    python experiments/gpu/cpu_compile.py --prompts 6 --max-new-tokens 64 \\
        --methods autoregressive,ngram,eagle --out experiments/gpu/cpu_compile_run3.json
    python experiments/gpu/cpu_compile.py --modes off,on,autotune --methods autoregressive
    python experiments/gpu/cpu_compile.py --dtype float32 --modes off,unpacked --methods autoregressive,ngram
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from specdec import Engine, ModelSpec, SpeculativeDecoder, load_model
from specdec.accel.compiled import CompiledForward
from specdec.accel.passes import Accelerated
from specdec.core.schedules import make_schedule
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.layer_skip import LayerSkipProposer
from specdec.proposers.medusa import MedusaProposer
from specdec.proposers.ngram import NgramProposer
from specdec.proposers.suffix import SuffixProposer, SuffixTreeProposer
from specdec.study.data import build_turn_input, load_prompts

METHODS = ("autoregressive", "ngram", "eagle", "medusa", "layer_skip", "suffix", "suffix_tree")
MODES = ("off", "on", "autotune", "unpacked")  # `--modes` takes off and at least one of the others
COMPILES = {"off": "off", "on": "on", "autotune": "autotune", "unpacked": "off"}  # mode -> compile=
BASELINE = "autoregressive"
# wall: tokens / wall time; cpu: tokens / the process's CPU time; decode: the tokens after the first
# over the wall time after it (prefill excluded: it runs eagerly in both modes, so on long prompts it
# dilutes what compiling changes)
CLOCKS = ("wall", "cpu", "decode")
# conf/method/<name>.yaml's proposer arguments and k; suffix decoding without its cross-request index
# (max_cached_requests=0), because every compiled decoder decodes each prompt once untimed, right before
# its timed run, and an index would hand it its own earlier output
EAGLE_TREE = dict(budget=4, topk=4, width=4, depth=2)
NO_INDEX = dict(max_cached_requests=0)
K = {"autoregressive": 1, "ngram": 4, "eagle": 2, "medusa": 4, "layer_skip": 3, "suffix": 8, "suffix_tree": 8}
# methods whose target keeps hidden states for a drafter get engines of their own
ENGINE_KIND = {"eagle": "eagle", "medusa": "medusa"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs of every pair per prompt (medians)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    ap.add_argument("--source", default="builtin", help="the prompt set: builtin, or spec_bench (one prompt per "
                    "category in turn; first turns)")
    ap.add_argument("--model", default="embedded", help="embedded (SmolLM2), or tiny_random for the tests")
    ap.add_argument("--heads-path", default="embedded", help="the EAGLE drafter's checkpoint")
    ap.add_argument("--medusa-path", default="embedded", help="the Medusa heads' checkpoint")
    ap.add_argument("--medusa-tree", type=json.loads, default=None,
                    help="Medusa's tree as JSON rank paths, e.g. '[[0],[1],[0,0]]' (default: its DEFAULT_TREE)")
    ap.add_argument("--exit-layer", type=int, default=8, help="layer skipping's draft depth (conf/method/layer_skip.yaml)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (eager: the tests' quick capture)")
    ap.add_argument("--schedule", default="constant", help="the speculative methods' schedule (conf/method/"
                    "schedule/): constant (each method's k, every step) or one that chooses k, such as cost_aware")
    ap.add_argument("--modes", default="off,on", help=f"comma-separated compile modes, off and any of "
                    f"{', '.join(MODES[1:])}")
    ap.add_argument("--k", default="", help="method=k pairs, comma-separated, in place of each method's "
                    "default k (e.g. ngram=3)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.modes = args.modes.split(",")
    try:
        args.k = {**K, **{m: int(k) for m, k in (pair.split("=") for pair in args.k.split(",") if pair)}}
    except ValueError:
        ap.error(f"--k {args.k}: method=k pairs, such as ngram=3")
    if set(args.k) - set(METHODS) or min(args.k.values()) < 1:
        ap.error(f"--k {args.k}: methods from {', '.join(METHODS)}, each k >= 1")
    if args.modes[0] != "off" or len(args.modes) < 2 or not set(args.modes[1:]) <= set(MODES[1:]) \
            or len(set(args.modes)) < len(args.modes):
        ap.error(f"--modes {','.join(args.modes)}: off first (every compiled mode is measured against it), "
                 f"then one or more of {', '.join(MODES[1:])}")
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or BASELINE not in methods:
        ap.error(f"--methods {args.methods}: needs {BASELINE} (every method's baseline) and only "
                 f"{', '.join(METHODS)}; unknown: {', '.join(unknown) or 'none'}")
    if args.prompts < 1 or args.max_new_tokens < 2 or args.repeats < 1:
        ap.error("--prompts and --repeats must be >= 1 and --max-new-tokens >= 2 (the decode clock times the "
                 "tokens after the first)")
    return args


def build_decoders(model, tok, args) -> dict[tuple[str, str], SpeculativeDecoder]:
    """One decoder per (method, compile mode); methods whose target keeps no hidden states share an
    engine per mode."""
    engines: dict[tuple[str, str], Engine] = {}

    def engine(kind: str, mode: str) -> Engine:
        if (kind, mode) not in engines:
            e = Engine(model, device="cpu", dtype=args.dtype, passes=Accelerated(compile=COMPILES[mode], packed_linear="off" if mode == "unpacked" else "auto"))
            if e.compile:
                for m in (e.target, e.draft):
                    if m is not None:
                        m.compiled = CompiledForward(m, backend=args.backend, autotune=e.passes.autotune)
            engines[kind, mode] = e
        return engines[kind, mode]

    def proposer(method: str, e: Engine):
        if method == "autoregressive":
            return None
        if method == "eagle":
            return EagleProposer(e, args.heads_path, **EAGLE_TREE)
        if method == "medusa":
            return MedusaProposer(e, args.medusa_path, tree=args.medusa_tree)
        if method == "layer_skip":
            return LayerSkipProposer(e, exit_layer=args.exit_layer)
        if method == "suffix":
            return SuffixProposer(e, **NO_INDEX)
        if method == "suffix_tree":
            return SuffixTreeProposer(e, **NO_INDEX)
        return NgramProposer(e)

    decoders = {}
    for method in args.methods.split(","):
        for mode in args.modes:
            e = engine(ENGINE_KIND.get(method, "shared"), mode)
            schedule = make_schedule(args.schedule, args.k[method]) if method != BASELINE else None
            d = SpeculativeDecoder(e, proposer(method, e), num_speculative_tokens=args.k[method], tokenizer=tok,
                                   eos_token_id=[], schedule=schedule)
            d.exact_greedy = False
            decoders[method, mode] = d
    return decoders


def round_robin(prompts: list, category_map: dict[str, str]) -> list:
    """The prompts ordered first of every category (renamed by `category_map`), then second of every
    category, ...: the first N of them cover as many categories as N allows."""
    rank: dict[str, int] = {}
    keyed = []
    for i, p in enumerate(prompts):
        category = category_map.get(p.category, p.category)
        rank[category] = rank.get(category, -1) + 1
        keyed.append((rank[category], i, p))
    return [p for *_, p in sorted(keyed, key=lambda x: x[:2])]


def spec_bench_categories() -> dict[str, str]:
    """Spec-Bench's six categories: conf/data/spec_bench.yaml's category_map (MT-bench's eight as one)."""
    import yaml

    path = Path(__file__).resolve().parents[2] / "conf" / "data" / "spec_bench.yaml"
    return yaml.safe_load(path.read_text())["category_map"]


def median_ratio(rows: list[dict], num: str, den: str, key: str) -> dict:
    """Median, min and max over prompts of rows[i][num][key] / rows[i][den][key]."""
    ratios = [r[num][key] / r[den][key] for r in rows]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def step_cost(rows: list[dict], method: str, mode: str, new_tokens: int) -> dict:
    """Median, min and max over prompts of the method's process CPU time per step over plain
    decoding's in the same mode: the engine's share of a speedup, apart from how many tokens a
    step accepts (which differs between modes where bfloat16 outputs part at a near-tie)."""
    def per_step(cell):
        return new_tokens / cell["cpu"] / cell["steps"]

    ratios = [per_step(r[f"{method}/{mode}"]) / per_step(r[f"{BASELINE}/{mode}"]) for r in rows]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def summarize(rows: list[dict], methods: list[str], new_tokens: int, modes: list[str]) -> dict:
    """Per method: speedup over plain decoding per mode, each compiled mode over off (`on_over_off`,
    `autotune_over_off`), tokens/s medians, and the CPU time of a step relative to a plain decoding
    step per mode."""
    out = {}
    for method in methods:
        s = {"tok_s": {f"{mode}_{clock}": statistics.median(r[f"{method}/{mode}"][clock] for r in rows)
                       for mode in modes for clock in CLOCKS}}
        for mode in modes[1:]:
            for clock in CLOCKS:
                s[f"{mode}_over_off_{clock}"] = median_ratio(rows, f"{method}/{mode}", f"{method}/off", clock)
            s[f"same_tokens_{mode}_off"] = sum(r[f"{method}/{mode}"]["tokens"] == r[f"{method}/off"]["tokens"]
                                               for r in rows)
        if method != BASELINE:
            for mode in modes:
                for clock in CLOCKS:
                    s[f"speedup_{mode}_{clock}"] = median_ratio(rows, f"{method}/{mode}", f"{BASELINE}/{mode}", clock)
                s[f"step_cost_{mode}"] = step_cost(rows, method, mode, new_tokens)
            for mode in modes[1:]:
                s[f"keeps_speedup_{mode}"] = {
                    clock: s[f"speedup_{mode}_{clock}"]["median"] >= s[f"speedup_off_{clock}"]["median"]
                    for clock in CLOCKS}
        s["mean_accepted_length"] = {mode: statistics.median(r[f"{method}/{mode}"]["tau"] for r in rows)
                                     for mode in modes}
        out[method] = s
    return out


def graphs(decoder: SpeculativeDecoder) -> int:
    """Graphs compiled so far by the decoder's engine: target, draft and the proposers' own models."""
    return sum(r["graphs"] for r in decoder.engine.compile_report().values())


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"args": vars(args), "loadavg": {"start": os.getloadavg()}}
    model, tok = load_model(ModelSpec(path=args.model))
    model.generation_config.eos_token_id = None
    decoders = build_decoders(model, tok, args)
    methods = args.methods.split(",")
    per_category = -(-args.prompts // 6)  # the MT-bench categories are one: 8x this many load, fine
    mapping = spec_bench_categories() if args.source == "spec_bench" else {}
    prompts = round_robin(load_prompts(args.source, limit=per_category), mapping)[: args.prompts]
    inputs = [build_turn_input(tok, [], p.turns[0]) for p in prompts]
    compiled_modes = [mode for mode in args.modes[1:] if COMPILES[mode] != "off"]  # warmed up per prompt
    pairs = [(m, mode) for m in methods for mode in args.modes]

    start = time.perf_counter()
    for method in methods:  # the eager modes' warm-up (and the first packing of the linear layers)
        for mode in args.modes:
            if mode not in compiled_modes:
                decoders[method, mode].generate([inputs[0]], max_new_tokens=min(8, args.max_new_tokens))
    result["warmup_s"], result["graphs_compiled_while_timed"], rows = 0.0, {}, []
    for i, ids in enumerate(inputs):
        t = time.perf_counter()
        for method in methods:  # untimed: compiles every graph this prompt's timed runs reach
            for mode in compiled_modes:
                decoders[method, mode].generate([ids], max_new_tokens=args.max_new_tokens)
        result["warmup_s"] += time.perf_counter() - t
        print(f"warm-up of prompt {i} ({len(ids)} tokens): {time.perf_counter() - t:.0f} s", flush=True)
        warm = {(m, mode): graphs(decoders[m, mode]) for m in methods for mode in compiled_modes}
        row = {"prompt_tokens": len(ids), "order": []}
        runs: dict[str, list[dict]] = {}
        for r in range(args.repeats):  # each repeat in another order: rotated by one per prompt and repeat
            shift = (i + r) % len(pairs)
            order = pairs[shift:] + pairs[:shift]
            row["order"].append([f"{m}/{mode}" for m, mode in order])
            for method, mode in order:
                g = decoders[method, mode].generate([ids], max_new_tokens=args.max_new_tokens)
                st = g.stats
                runs.setdefault(f"{method}/{mode}", []).append(
                    {"wall": st.new_tokens / st.wall_s, "cpu": st.new_tokens / st.cpu_s,
                     "decode": (st.new_tokens - 1) / (st.wall_s - st.ttft_s),
                     "tau": st.mean_accepted_length, "steps": st.steps, "tokens": g.output_ids[0]})
        for key, cells in runs.items():  # the same tokens every repeat (greedy): the clocks' medians
            row[key] = cells[0] | {clock: statistics.median(c[clock] for c in cells) for clock in CLOCKS}
        for (m, mode), before in warm.items():  # the warm-up should have compiled every graph
            key = m if mode == "on" else f"{m}/{mode}"
            result["graphs_compiled_while_timed"][key] = (result["graphs_compiled_while_timed"].get(key, 0)
                                                          + graphs(decoders[m, mode]) - before)
        rows.append(row)
        print(f"prompt {i} ({len(ids)} tokens), {time.perf_counter() - start:.0f} s: " + ", ".join(
            f"{k} {row[k]['cpu']:.2f}" for k in row if "/" in k) + " tok/s (CPU time)", flush=True)
        result["loadavg"]["end"] = os.getloadavg()
        result["rows"] = rows
        result["summary"] = summarize(rows, methods, args.max_new_tokens, args.modes)
        result["compile_report"] = {m if mode == "on" else f"{m}/{mode}": decoders[m, mode].engine.compile_report()
                                    for m in methods for mode in compiled_modes}
        if args.out:  # after every prompt: a run cut short keeps its complete prompts
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
    for method, s in result["summary"].items():
        tok_s = " ".join(f"{mode} {s['tok_s'][f'{mode}_cpu']:.2f}" for mode in args.modes)
        over = ", ".join(f"{mode}/off {s[f'{mode}_over_off_cpu']['median']:.3f} (CPU) "
                         f"{s[f'{mode}_over_off_wall']['median']:.3f} (wall)" for mode in args.modes[1:])
        line = f"{method}: tok/s (CPU time) {tok_s}; {over}"
        if method != BASELINE:
            for clock, label in (("cpu", "CPU"), ("wall", "wall"), ("decode", "wall after the first token")):
                line += "; speedup " + " ".join(f"{mode} {s[f'speedup_{mode}_{clock}']['median']:.3f}"
                                                 for mode in args.modes) + f" ({label})"
            line += "; keeps it: " + ", ".join(f"{mode} {s[f'keeps_speedup_{mode}']}" for mode in args.modes[1:])
            line += "; CPU time of a step over a plain step: " + " ".join(
                f"{mode} {s[f'step_cost_{mode}']['median']:.3f}" for mode in args.modes)
        print(line, flush=True)
    print(f"warm-up {result['warmup_s']:.0f} s; graphs compiled while timed: {result['graphs_compiled_while_timed']}; "
          f"load average {result['loadavg']}", flush=True)
    return result


if __name__ == "__main__":
    main()
