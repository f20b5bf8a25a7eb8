"""Exact greedy in bfloat16: what it costs, and speed against the fastest plain decoding.

On the embedded SmolLM2-135M (bfloat16, one thread), for the first turn of Spec-Bench's prompts (2 per
category), five decoders run one after another on each prompt, their order rotating from prompt to
prompt:

- plain-w1:    plain decoding as fast as it goes (exact_greedy off: 1-token passes)
- plain-exact: plain decoding with exact greedy on (every pass WIDTH tokens wide, attention over the
               whole cache buffer): the baseline a greedy experiment compares against
- ngram, draft: n-gram lookup and the draft method (draft = the target itself), k = WIDTH - 1, exact
- ngram-w1:    n-gram lookup with exact greedy off (for the match rate without it)

Printed: tokens/s of each (total tokens / total seconds, and the median over prompts of the per-prompt
ratios), whether each output equals plain-exact's and plain-w1's, and the speedups against both
baselines.

    python experiments/measurement/exact_greedy_cost.py [--tokens 128] [--per-category 2] [--width 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import Engine, ModelSpec, SpeculativeDecoder, load_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramProposer
from specdec.study.data import Prompt, build_turn_input, load_prompts, select_prompts

# Spec-Bench reports the eight MT-bench categories as one (conf/data/spec_bench.yaml).
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def embedded(with_draft: bool) -> tuple[Engine, object]:
    """The embedded SmolLM2-135M in bfloat16 on one thread (as its own draft when `with_draft`)."""
    torch.set_num_threads(1)
    model, tok = load_model(ModelSpec(path="embedded"))
    return Engine(model, model if with_draft else None, dtype="bfloat16"), tok


def spec_bench_first_turns(tokenizer, per_category: int) -> list[tuple[str, list[int]]]:
    prompts = [Prompt(p.prompt_id, "multi_turn" if p.category in MT_BENCH else p.category, p.turns)
               for p in load_prompts("spec_bench")]
    chosen = select_prompts(prompts, per_category, None, True)
    return [(f"{p.category}/{p.prompt_id}", build_turn_input(tokenizer, [], p.turns[0])) for p in chosen]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--width", type=int, default=5, help="scoring width under exact greedy (k = width - 1)")
    args = ap.parse_args()
    engine, tok = embedded(with_draft=True)
    k = args.width - 1
    decoders = {
        "plain-w1": SpeculativeDecoder(engine, tokenizer=tok, exact_greedy=False),
        "plain-exact": SpeculativeDecoder(engine, tokenizer=tok),
        "ngram": SpeculativeDecoder(engine, NgramProposer(engine), k, tokenizer=tok),
        "draft": SpeculativeDecoder(engine, DraftModelProposer(engine), k, tokenizer=tok),
        "ngram-w1": SpeculativeDecoder(engine, NgramProposer(engine), k, tokenizer=tok, exact_greedy=False),
    }
    for d in decoders.values():
        d.score_width = args.width  # one width for every exact decoder, as an experiment sets it
    prompts = spec_bench_first_turns(tok, args.per_category)
    for d in decoders.values():  # warm-up
        d.generate([prompts[0][1]], max_new_tokens=8)

    names = list(decoders)
    secs = {n: [] for n in names}
    toks = {n: [] for n in names}
    outs = {n: [] for n in names}
    for i, (pid, ids) in enumerate(prompts):
        order = names[i % len(names):] + names[:i % len(names)]
        for n in order:
            t0 = time.perf_counter()
            out = decoders[n].generate([ids], max_new_tokens=args.tokens)
            secs[n].append(time.perf_counter() - t0)
            toks[n].append(len(out.output_ids[0]))
            outs[n].append(out.output_ids[0])
        same = {n: outs[n][-1] == outs["plain-exact"][-1] for n in names}
        print(f"{pid:24s} {len(ids):4d} prompt tokens  = plain-exact: {same}", flush=True)

    def tps(n: str) -> float:
        return sum(toks[n]) / sum(secs[n])

    def median_ratio(n: str, base: str) -> float:
        return statistics.median((toks[n][i] / secs[n][i]) / (toks[base][i] / secs[base][i])
                                 for i in range(len(prompts)))

    print(f"\n{len(prompts)} prompts, {args.tokens} new tokens, width {args.width}, bfloat16, 1 thread\n")
    print("| decoder | tok/s | vs plain-w1 (total; median per prompt) | vs plain-exact (total; median) "
          "| = plain-exact | = plain-w1 |")
    print("|---|---:|---:|---:|---:|---:|")
    for n in names:
        eq_exact = sum(a == b for a, b in zip(outs[n], outs["plain-exact"]))
        eq_w1 = sum(a == b for a, b in zip(outs[n], outs["plain-w1"]))
        print(f"| {n} | {tps(n):.1f} | {tps(n) / tps('plain-w1'):.2f}x; {median_ratio(n, 'plain-w1'):.2f}x "
              f"| {tps(n) / tps('plain-exact'):.2f}x; {median_ratio(n, 'plain-exact'):.2f}x "
              f"| {eq_exact}/{len(prompts)} | {eq_w1}/{len(prompts)} |")


if __name__ == "__main__":
    main()
