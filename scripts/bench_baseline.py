"""Benchmark: specdec's autoregressive baseline against `transformers` generate(), greedy.

Same model, dtype, prompts and max_new_tokens; the two run interleaved prompt by prompt (the order
alternates) after a warm-up, and the medians of per-prompt tokens/s and of the per-prompt ratio are
reported. Both must produce the same number of tokens: EOS is ignored by both, so every call generates exactly max_new_tokens. The
script reports how many outputs are token-identical (in bfloat16 the two attention paths, a view of
a preallocated cache here and a growing concatenated one in transformers, round differently, so
texts can drift apart after a near-tie).

    python scripts/bench_baseline.py --prompts 12 --max-new-tokens 64 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from specdec import Engine, ModelSpec, SpeculativeDecoder, load_model
from specdec.core.metrics import speedup, tokens_per_s
from specdec.study.data import build_turn_input, load_prompts


def hf_generate(model, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        x = torch.tensor([ids])
        # An explicit mask: without one, generate() treats prompt tokens equal to the pad id as padding.
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12, help="built-in prompts used (spread over categories)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tok = load_model(ModelSpec(path="embedded"))
    engine = Engine(model, device="cpu", dtype=args.dtype)
    model.generation_config.eos_token_id = None  # both sides generate exactly max_new_tokens
    ours = SpeculativeDecoder(engine, tokenizer=tok, eos_token_id=[])
    prompts = load_prompts("builtin", limit=max(1, args.prompts // 6 + 1))[: args.prompts]
    inputs = [build_turn_input(tok, [], p.turns[0]) for p in prompts]

    ours.generate([inputs[0]], max_new_tokens=8)  # warm-up, not counted
    hf_generate(engine.target.model, inputs[0], 8)

    rows = []
    for i, ids in enumerate(inputs):
        def run_ours(ids=ids):
            t = time.perf_counter()
            out = ours.generate([ids], max_new_tokens=args.max_new_tokens).output_ids[0]
            return out, time.perf_counter() - t

        def run_hf(ids=ids):
            t = time.perf_counter()
            out = hf_generate(engine.target.model, ids, args.max_new_tokens)
            return out, time.perf_counter() - t

        first, second = (run_ours, run_hf) if i % 2 == 0 else (run_hf, run_ours)
        a, b = first(), second()
        (o, to), (h, th) = (a, b) if i % 2 == 0 else (b, a)
        if len(o) != len(h):
            raise SystemExit(f"prompt {prompts[i].prompt_id}: output lengths differ; the benchmark is void")
        ours_rate, hf_rate = tokens_per_s(len(o), to), tokens_per_s(len(h), th)
        rows.append({"prompt_id": prompts[i].prompt_id, "new_tokens": len(o), "same_tokens": o == h,
                     "specdec_tok_s": ours_rate, "hf_tok_s": hf_rate, "ratio": speedup(ours_rate, hf_rate)})

    med = {k: statistics.median(r[k] for r in rows) for k in ("specdec_tok_s", "hf_tok_s", "ratio")}
    spread = (min(r["ratio"] for r in rows), max(r["ratio"] for r in rows))
    print(f"{len(rows)} prompts, max_new_tokens={args.max_new_tokens}, dtype={args.dtype}, "
          f"threads={torch.get_num_threads()}, {platform.processor() or platform.machine()}")
    print("| | specdec autoregressive | transformers generate |\n|---|---|---|")
    print(f"| median tokens/s | {med['specdec_tok_s']:.1f} | {med['hf_tok_s']:.1f} |")
    print(f"identical outputs: {sum(r['same_tokens'] for r in rows)}/{len(rows)} prompts")
    print(f"median per-prompt ratio specdec/hf: {med['ratio']:.3f} (min {spread[0]:.3f}, max {spread[1]:.3f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "median": med, "ratio_range": spread}, f, indent=2)


if __name__ == "__main__":
    main()
