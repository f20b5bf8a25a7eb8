"""What dynamo's guard evaluation costs a compiled decoding step, and what skipping it for known
entries (`specdec.accel.compiled.SKIP_KNOWN_GUARDS`) saves: the same compiled decoder, the switch on and off
in turn, interleaved after a warm-up that compiles every graph, medians of the repeats.

    python experiments/gpu/guards.py --out experiments/gpu/guards.json             # embedded SmolLM2, bfloat16
    python experiments/gpu/guards.py --model tiny_random --dtype float32 --repeats 3 \
        --heads-path tests/assets/tiny_random_eagle.safetensors                        # plumbing check

Methods: plain decoding (one compiled call a step) and EAGLE (the target's tree pass and the
drafter's passes: several compiled calls a step). Time is process CPU time per step (the machine
may be shared), one thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import specdec.accel.compiled as compiled
from specdec.accel.passes import Accelerated
from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.models import ModelSpec, load_model
from specdec.proposers.eagle import EagleProposer
from specdec.study.data import load_prompts


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--methods", default="plain,eagle")
    ap.add_argument("--heads-path", default="embedded", help="the EAGLE drafter's checkpoint")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load_model(ModelSpec(path=args.model))
    ids = [tokenizer.encode(load_prompts("spec_bench", limit=1, per_category=False)[0].turns[0])]
    engine = Engine(model, None, dtype=args.dtype, passes=Accelerated(compile="on"))
    results = {}
    for method in args.methods.split(","):
        # EAGLE as cpu_compile.py runs it: budget 4, top-4, width 4, depth 2, k = 2
        proposer = EagleProposer(engine, args.heads_path, budget=4, topk=4, width=4, depth=2) \
            if method == "eagle" else None
        decoder = SpeculativeDecoder(engine, proposer, num_speculative_tokens=2 if proposer else 1, eos_token_id=[])
        decoder.exact_greedy = False
        start = time.perf_counter()
        ref = decoder.generate(ids, max_new_tokens=args.max_new_tokens)  # warm-up: every graph compiles
        print(f"{method}: warm-up {time.perf_counter() - start:.0f} s, {engine.compile_report()}", flush=True)
        per_step = {True: [], False: []}
        for repeat in range(args.repeats):
            for skip in ((True, False) if repeat % 2 == 0 else (False, True)):
                compiled.SKIP_KNOWN_GUARDS = skip
                cpu = time.process_time()
                out = decoder.generate(ids, max_new_tokens=args.max_new_tokens)
                per_step[skip].append((time.process_time() - cpu) / out.stats.steps * 1e3)
                if out.output_ids != ref.output_ids:
                    raise SystemExit(f"{method}: skipping guards changed the output")
        compiled.SKIP_KNOWN_GUARDS = True
        on, off = statistics.median(per_step[True]), statistics.median(per_step[False])
        results[method] = {"ms_per_step_skipping": on, "ms_per_step_guarded": off, "saved_ms": off - on,
                           "ratio": off / on, "steps": out.stats.steps, "runs": {str(k): v for k, v in per_step.items()}}
        print(f"{method}: {off:.2f} ms/step with every guard, {on:.2f} skipping known entries' "
              f"({off - on:.2f} ms saved, {off / on:.3f}x)", flush=True)
    results["compile_report"] = engine.compile_report()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
