"""compile=off against compile=on on this CPU: embedded SmolLM2, plain decoding and n-gram drafting.

Both engines share the model (same device and dtype). The compiled engine first runs every prompt
once untimed (that compiles every graph the timed runs need: each key bucket the prompts reach);
then, per prompt, the two run interleaved (the order alternates), and the medians of the per-prompt
tokens/s and of the per-prompt ratio on/off are reported. EOS is ignored, so every call makes
exactly --max-new-tokens tokens.

    python experiments/gpu/cpu_compile.py --prompts 6 --max-new-tokens 64 --out experiments/gpu/cpu_compile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec import Engine, ModelSpec, SpeculativeDecoder, load_model
from specdec.data import build_turn_input, load_prompts
from specdec.proposers.ngram import NgramProposer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--methods", default="autoregressive,ngram")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model, tok = load_model(ModelSpec(path="embedded"))
    model.generation_config.eos_token_id = None
    engines = {c: Engine(model, device="cpu", dtype=args.dtype, compile=c) for c in ("off", "on")}
    prompts = load_prompts("builtin", limit=max(1, args.prompts // 6 + 1))[: args.prompts]
    inputs = [build_turn_input(tok, [], p.turns[0]) for p in prompts]

    def decoder(method: str, engine: Engine) -> SpeculativeDecoder:
        proposer = NgramProposer(engine) if method == "ngram" else None
        return SpeculativeDecoder(engine, proposer, num_speculative_tokens=4, tokenizer=tok, eos_token_id=[])

    result = {"args": vars(args), "methods": {}}
    for method in args.methods.split(","):
        decoders = {c: decoder(method, e) for c, e in engines.items()}
        t = time.perf_counter()
        for ids in inputs:  # untimed: compiles every graph the timed runs need (and warms eager)
            decoders["on"].generate([ids], max_new_tokens=args.max_new_tokens)
        warm_s = time.perf_counter() - t
        decoders["off"].generate([inputs[0]], max_new_tokens=8)
        rows = []
        for i, ids in enumerate(inputs):
            order = ("off", "on") if i % 2 == 0 else ("on", "off")
            out = {}
            for c in order:
                g = decoders[c].generate([ids], max_new_tokens=args.max_new_tokens)
                out[c] = (g.output_ids[0], g.stats.new_tokens / g.stats.wall_s, g.stats.new_tokens / g.stats.cpu_s)
            rows.append({"prompt_tokens": len(ids), "off_tok_s": out["off"][1], "on_tok_s": out["on"][1],
                         "ratio": out["on"][1] / out["off"][1], "cpu_ratio": out["on"][2] / out["off"][2],
                         "same_tokens": out["on"][0] == out["off"][0]})
        med = {k: statistics.median(r[k] for r in rows) for k in ("off_tok_s", "on_tok_s", "ratio", "cpu_ratio")}
        result["methods"][method] = {"rows": rows, "median": med, "warmup_compile_s": warm_s,
                                     "compile_report": engines["on"].compile_report()}
        print(f"{method}: off {med['off_tok_s']:.1f} tok/s, on {med['on_tok_s']:.1f} tok/s, median ratio "
              f"{med['ratio']:.3f} (min {min(r['ratio'] for r in rows):.3f}, max {max(r['ratio'] for r in rows):.3f}), "
              f"by process CPU time {med['cpu_ratio']:.3f} (min {min(r['cpu_ratio'] for r in rows):.3f}, "
              f"max {max(r['cpu_ratio'] for r in rows):.3f}), "
              f"identical {sum(r['same_tokens'] for r in rows)}/{len(rows)}, warm-up with compiling {warm_s:.0f} s, "
              f"{engines['on'].compile_report()}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
