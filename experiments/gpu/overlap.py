"""Overlapped plain decoding (`overlap=on`) against the serial loop (`overlap=off`) on one device:
the same decoder's setting switched in turn, interleaved after a warm-up, medians of the repeats,
tokens compared. On a CPU there is nothing to overlap (every operator runs before the host goes
on), so this measures what the reordering costs there; on a GPU the device benchmark measures what
it gains (`scripts/bench_gpu.py`, "specdec compiled serial").

    python experiments/gpu/overlap.py --out experiments/gpu/overlap.json      # embedded SmolLM2, bfloat16
    python experiments/gpu/overlap.py --model tiny_random --dtype float32 --repeats 2   # plumbing check

Time per step is wall time on a GPU and process CPU time on a CPU (the machine may be shared), one
thread, Spec-Bench's first prompt of each category (those that fit the model), EOS honoured (so that a generation stopping on
EOS pays its extra pass).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec.accel.passes import Accelerated
from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine, synchronize
from specdec.models import ModelSpec, load_model
from specdec.study.data import load_prompts


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--compile", default="off")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load_model(ModelSpec(path=args.model))
    prompts = load_prompts("spec_bench", limit=1)
    ids = [tokenizer.encode(p.turns[0]) for p in prompts]
    engine = Engine(model, None, device=args.device, dtype=args.dtype, passes=Accelerated(compile=args.compile))
    decoder = SpeculativeDecoder(engine, None, tokenizer=tokenizer)
    decoder.exact_greedy = False  # plain decoding one token wide, as a baseline runs it alone
    ids = [p for p in ids if decoder.fits(decoder.positions_needed(len(p), args.max_new_tokens))]
    gpu = engine.device.type == "cuda"

    def clock() -> float:
        if gpu:
            synchronize(engine.device)
            return time.perf_counter()
        return time.process_time()

    per_step: dict[str, list[float]] = {"on": [], "off": []}
    steps: dict[str, list[int]] = {"on": [], "off": []}
    same, ref = True, None
    for repeat in range(args.repeats + 1):  # the first round is the warm-up
        for mode in (("on", "off") if repeat % 2 == 0 else ("off", "on")):
            decoder.overlap = mode
            outs, took, n = [], 0.0, 0
            for p in ids:
                t = clock()
                out = decoder.generate([p], max_new_tokens=args.max_new_tokens)
                took += clock() - t
                outs.append(out.output_ids[0])
                n += out.stats.steps
            ref = outs if ref is None else ref  # the warm-up's first run: every later run must equal it
            same &= outs == ref
            if repeat == 0:
                continue
            per_step[mode].append(took / n)
            steps[mode].append(n)
        print(f"repeat {repeat}: {({m: round(v[-1] * 1e3, 3) for m, v in per_step.items() if v})} ms/step",
              flush=True)
    med = {m: statistics.median(v) for m, v in per_step.items()}
    result = {"model": args.model, "dtype": args.dtype, "device": str(engine.device), "compile": args.compile,
              "prompts": len(ids), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
              "clock": "wall" if gpu else "process CPU", "ms_per_step": {m: v * 1e3 for m, v in med.items()},
              "serial_over_overlapped": med["off"] / med["on"], "steps": {m: v[0] for m, v in steps.items()},
              "tokens_equal": same, "runs_ms": {m: [x * 1e3 for x in v] for m, v in per_step.items()}}
    print(json.dumps({k: v for k, v in result.items() if k != "runs_ms"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
