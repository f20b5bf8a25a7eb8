"""What grouped-query attention without repeated key heads (`specdec.core.attention.grouped_sdpa`) saves in
eager passes of the embedded SmolLM2 on this CPU, against transformers' own SDPA path.

One Spec-Bench first turn per category (40-769 tokens), prefilled once; then, interleaved, after a
warm-up, the one-token pass of plain decoding and a six-token pass (what n-gram lookup with k = 4 and
EAGLE's default tree score, padded to one width) are timed with each implementation, and rolled
back after every call. Prints and writes the median CPU milliseconds per pass and the ratios.

    python experiments/gpu/eager_attention.py --out experiments/gpu/eager_attention.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from unittest import mock

import torch

from specdec import Engine, ModelSpec, load_model
from specdec.accel.passes import Accelerated
from specdec.study.data import build_turn_input, load_prompts


def timed_pass(target, tokens: torch.Tensor, implementation) -> float:
    """CPU milliseconds of one pass of `tokens: [1, T]` after the cache's valid length (rolled back
    after each), the mean of two, under the context `implementation()`."""
    n = target.cache.lengths[0]
    with implementation():
        start = time.process_time()
        for _ in range(2):
            target.forward(tokens)
            target.rollback([n])
        return (time.process_time() - start) / 2 * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7, help="interleaved rounds; each times two calls per variant")
    ap.add_argument("--widths", default="1,6")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]

    model, tok = load_model(ModelSpec(path="embedded"))
    target = Engine(model, device="cpu", dtype=args.dtype, passes=Accelerated(compile="off")).target
    prompts = load_prompts("spec_bench", limit=1)
    # transformers' SDPA path: the engine's swap replaced by nothing
    implementations = {"transformers_sdpa": lambda: mock.patch("specdec.core.engine.grouped_attention",
                                                               lambda m: contextlib.nullcontext()),
                       "grouped": contextlib.nullcontext}
    rows = []
    for prompt in prompts:
        ids = build_turn_input(tok, [], prompt.turns[0])
        n = len(ids)
        target.reset(1, n + max(widths) + 1)
        tokens = torch.tensor([ids])
        target.forward(tokens)

        variants = [(w, i) for w in widths for i in implementations]
        for w, i in variants:  # warm-up
            timed_pass(target, tokens[:, -w:], implementations[i])
        times = {v: [] for v in variants}
        for _ in range(args.repeats):
            for w, i in variants:
                times[(w, i)].append(timed_pass(target, tokens[:, -w:], implementations[i]))
        row = {"category": prompt.category, "tokens": n}
        for w in widths:
            old, new = (statistics.median(times[(w, i)]) for i in implementations)
            row[f"width_{w}"] = {"transformers_sdpa_ms": round(old, 2), "grouped_ms": round(new, 2),
                                 "grouped_over_sdpa": round(new / old, 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
