"""What the EAGLE drafter's output head costs an EAGLE step of the embedded SmolLM2 on this CPU, by
kernel: a linear layer's (`OutputHead.logits`) against `hidden @ weight.T` (what it ran before).

One Spec-Bench first turn of a category, EAGLE's default tree, 64 new tokens, greedy; after a
warm-up generation, the variants alternate for `--repeats` generations each; prints the median CPU
milliseconds per step (prefill included, the same in both).

    python experiments/gpu/eagle_head.py --category qa --compile on
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec import Engine, ModelSpec, SpeculativeDecoder, load_model
from specdec.accel.passes import Accelerated
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.heads import OutputHead
from specdec.study.data import build_turn_input, load_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--category", default="qa")
    ap.add_argument("--compile", default="on", choices=["on", "off"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model, tok = load_model(ModelSpec(path="embedded"))
    model.generation_config.eos_token_id = None  # every generation runs its 64 tokens
    engine = Engine(model, device="cpu", dtype="bfloat16", passes=Accelerated(compile=args.compile))
    prompt = load_prompts("spec_bench", limit=1, categories=[args.category])[0]
    ids = build_turn_input(tok, [], prompt.turns[0])
    decoder = SpeculativeDecoder(engine, EagleProposer(engine, "embedded", budget=4, topk=4, width=4, depth=2),
                                 num_speculative_tokens=2, tokenizer=tok, eos_token_id=[], exact_greedy=False)
    variants = {"linear": OutputHead.logits, "matmul": lambda head, hidden: hidden @ head.weight.T}
    times = {name: [] for name in variants}
    for repeat in range(args.repeats + 1):
        for name, logits in variants.items():
            OutputHead.logits = logits
            start = time.process_time()
            out = decoder.generate([ids], max_new_tokens=64)
            if repeat:  # the first round is the warm-up (and compiles)
                times[name].append((time.process_time() - start) / out.stats.steps * 1000)
    OutputHead.logits = variants["linear"]
    print(json.dumps({"category": args.category, "prompt_tokens": len(ids), "compile": args.compile,
                      "steps": out.stats.steps, "ms_per_step": {k: round(statistics.median(v), 2) for k, v in times.items()}}))


if __name__ == "__main__":
    main()
