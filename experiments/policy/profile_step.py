"""Where a policy step's time goes: a speculative decoder whose policy picks 0 drafts against plain
decoding, per part of the step, interleaved.

    python experiments/policy/profile_step.py [--batch 16] [--rounds 3] [--tokens 32] [--categories qa,rag]

Every decoder decodes the same batch of Spec-Bench prompts (qa, translation, math_reasoning by
default, the first of each in turn) with the embedded SmolLM2 in its default dtype, 1 thread. The policy's
decoders are told never to draft (margin 1e9, no exploring): each of their steps scores one token
per row, like plain decoding, and whatever else the step does is overhead. Printed per decoder:
median milliseconds per step (wall, process CPU) over the rounds, and the mean milliseconds per
step spent in each part (the proposer, the schedule's next_k / trim / observe, the proposer's
observe). Then the target's pass at widths T = 1..9 at this batch size, over plain (the width cost
rho(B, T) the policy learns).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from specdec import Engine, ModelSpec, load_model
from specdec.adaptive.hybrid import HybridProposer
from specdec.core.decoding import SpeculativeDecoder
from specdec.core.schedules import make_schedule
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.ngram import NgramProposer
from specdec.proposers.suffix import SuffixProposer
from specdec.study.data import build_turn_input, load_prompts

NEVER = {"margin": 1e9, "explore": 0.0}  # the policy is free to draft and never does


class Clocked:
    """Wraps methods of an object, adding their wall time per call to `spent[label]`."""

    def __init__(self, spent: dict, obj, label: str, names: list[str]):
        for name in names:
            fn = getattr(obj, name)

            def timed(*args, _fn=fn, _key=f"{label}.{name}", **kwargs):
                start = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    spent[_key] += time.perf_counter() - start
            setattr(obj, name, timed)


def decoders(engine) -> dict[str, SpeculativeDecoder]:
    def ca():
        return make_schedule("cost_aware", 8, **NEVER)
    return {
        "plain": SpeculativeDecoder(engine, exact_greedy=False),
        "ngram_ca_k0": SpeculativeDecoder(engine, NgramProposer(), 8, schedule=ca(), exact_greedy=False),
        "suffix_ca_k0": SpeculativeDecoder(engine, SuffixProposer(), 8, schedule=ca(), exact_greedy=False),
        "hybrid_k0": SpeculativeDecoder(engine, HybridProposer(engine, {"suffix": SuffixProposer(),
                                                                        "ngram": NgramProposer()}, **NEVER),
                                        8, exact_greedy=False),
        # the target drafting for itself (draft=self): the policy prices it out, every step is plain
        "draft_ca_k0": SpeculativeDecoder(engine, DraftModelProposer(engine), 4, schedule=ca(), exact_greedy=False),
        # the trained drafter's tree (conf/method/eagle.yaml): its plain steps keep the target's hidden states
        "eagle_ca_k0": SpeculativeDecoder(engine, EagleProposer(engine, "embedded", budget=4, topk=4, width=4, depth=2),
                                          2, schedule=make_schedule("cost_aware", 2, **NEVER), exact_greedy=False),
    }


def width_costs(engine, ids: list[list[int]], widths=range(1, 10), reps: int = 5) -> dict[int, float]:
    """The target's pass over B x T tokens after a prefill, median seconds over plain (T = 1)."""
    target = engine.target
    longest = max(map(len, ids))
    tokens = torch.zeros(len(ids), longest + 16, dtype=torch.long)
    for i, p in enumerate(ids):
        tokens[i, :len(p)] = torch.tensor(p)
    target.reset(len(ids), longest + 16)
    target.catch_up(tokens, [len(p) for p in ids])
    base = list(target.lengths)
    times: dict[int, list[float]] = defaultdict(list)
    for _ in range(reps):
        for t in widths:  # interleaved widths
            chunk = tokens[:, :t]
            start = time.perf_counter()
            target.forward(chunk)
            times[t].append(time.perf_counter() - start)
            target.rollback(base)
    plain = statistics.median(times[1])
    return {t: statistics.median(v) / plain for t, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--categories", default="qa,translation,math_reasoning", help="Spec-Bench categories, comma-separated")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(ModelSpec(path="embedded"))
    engine = Engine(model, draft=model)
    prompts = load_prompts("spec_bench", categories=args.categories.split(","), limit=6)
    ids = [build_turn_input(tok, [], p.turns[0]) for p in prompts][:args.batch]
    decs = decoders(engine)
    spent = {name: defaultdict(float) for name in decs}
    for name, dec in decs.items():
        Clocked(spent[name], dec.proposer, "proposer", ["propose", "observe"])
        Clocked(spent[name], dec.schedule, "schedule", ["next_k", "trim", "observe"])
        dec.generate(ids[:1], max_new_tokens=8)  # warm-up
        spent[name].clear()
    per_step: dict[str, list[tuple[float, float]]] = defaultdict(list)
    steps: dict[str, int] = defaultdict(int)
    outputs = {}
    names = list(decs)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start, cpu = time.perf_counter(), time.process_time()
            out = decs[name].generate(ids, max_new_tokens=args.tokens)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            per_step[name].append((wall / out.stats.steps, cpu / out.stats.steps))
            steps[name] += out.stats.steps
            outputs[name] = out.output_ids
    base = statistics.median(c for _, c in per_step["plain"])
    print(f"batch {len(ids)}, {args.tokens} new tokens, {args.rounds} rounds")
    print(f"{'decoder':14s} {'wall ms/step':>12s} {'cpu ms/step':>12s} {'cpu / plain':>11s}  parts, ms per step")
    for name in names:
        wall = statistics.median(w for w, _ in per_step[name]) * 1e3
        cpu = statistics.median(c for _, c in per_step[name])
        parts = ", ".join(f"{k} {v / steps[name] * 1e3:.2f}" for k, v in sorted(spent[name].items()))
        same = "" if outputs[name] == outputs["plain"] else "  OUTPUT DIFFERS"
        print(f"{name:14s} {wall:12.1f} {cpu * 1e3:12.1f} {cpu / base:11.3f}  {parts}{same}")
    costs = width_costs(engine, ids)
    print("target pass at width T over T = 1:", ", ".join(f"{t}: {c:.2f}" for t, c in costs.items()))


if __name__ == "__main__":
    main()
