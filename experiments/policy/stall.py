"""One stalled step: does the cost-aware policy recover, and what does confirming widths cost?

The policy learns what a scoring width costs from the run's own clocks. A step that stalls (another
process, a page fault) is measured as an expensive width; before `confirm`, the first measurement of
a width decided alone, and a width ruled out is never taken, so never measured again; the same holds for drafting costs. This
study decodes the embedded target with suffix decoding and n-gram lookup under
`method.schedule=cost_aware` with `confirm=1` (the first measurement decides) and `confirm=3` (the
default), each without a stall, with a 0.5 s sleep in the second 2-wide target pass of the run
(`scoring`; `--nth 1`: the first, which the policy does not measure since it pays one-time costs), and with one in the proposer's second proposal of the run (`drafting`: its first
steady one; the first after a plain step is priced apart), against plain decoding
(`exact_greedy=false`: widths as the policy chooses them, plain decoding one token wide),
interleaved prompt batch by prompt batch (the order rotates), after a warm-up.

Speedups are tokens per process-CPU-second over plain decoding's on the same batches (the sleep
costs wall time but no CPU time, so they compare the policy's decisions, not the stall itself).

    python experiments/policy/stall.py --reps 3 --out experiments/policy/runs/stall.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec import Engine, ModelSpec, SpeculativeDecoder, load_model
from specdec.core.schedules import make_schedule
from specdec.proposers.ngram import NgramProposer
from specdec.proposers.suffix import SuffixProposer
from specdec.study.data import build_turn_input, load_spec_bench

CATEGORIES = ("qa", "translation", "math_reasoning")
STALLS = (None, "scoring", "drafting")


def prompts_of(tok, per_category: int) -> list[list[int]]:
    chosen = []
    for category in CATEGORIES:
        chosen += [p for p in load_spec_bench() if p.category == category][:per_category]
    return [build_turn_input(tok, [], p.turns[0]) for p in chosen]


class Stall:
    """While `armed`, sleeps `seconds` once: in the `nth` target pass that scores 2 tokens per row
    (`scoring`), or in the second proposal of the proposer given to `drafting` (`drafting`)."""

    def __init__(self, engine: Engine, seconds: float, nth: int = 2):
        self.armed, self.seconds, self.proposals, self.nth, self.passes = None, seconds, 0, nth, 0
        forward = engine.target.forward

        def stalled(tokens: torch.Tensor, *args, **kwargs):  # tokens: [B, T]
            if self.armed == "scoring" and tokens.shape[1] == 2:
                self.passes += 1
                if self.passes == self.nth:
                    self.sleep()
            return forward(tokens, *args, **kwargs)

        engine.target.forward = stalled

    def sleep(self) -> None:
        self.armed = None
        time.sleep(self.seconds)

    def drafting(self, proposer):
        propose = proposer.propose

        def stalled(*args, **kwargs):
            if self.armed == "drafting":
                self.proposals += 1
                if self.proposals == 2:
                    self.sleep()
            return propose(*args, **kwargs)

        proposer.propose = stalled
        return proposer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--stall", type=float, default=0.5)
    ap.add_argument("--nth", type=int, default=2, help="the 2-wide target pass that stalls (scoring)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(ModelSpec(path="embedded"))
    engine = Engine(model, dtype="auto")
    stall = Stall(engine, args.stall, args.nth)
    prompts = prompts_of(tok, args.per_category)
    proposers = {"suffix": SuffixProposer, "ngram": lambda: NgramProposer(engine)}
    rows = []
    for b in args.batch:
        batches = [prompts[i:i + b] for i in range(0, len(prompts), b)]
        SpeculativeDecoder(engine, exact_greedy=False).generate(batches[0][:1], max_new_tokens=8)  # warm-up
        for rep in range(args.reps):
            # a fresh policy per condition and repetition: nothing learned before its first batch
            conditions = {"plain": SpeculativeDecoder(engine, exact_greedy=False)}
            for name, make in proposers.items():
                for confirm in (1, 3):
                    for stalled in STALLS:
                        conditions[(name, confirm, stalled)] = SpeculativeDecoder(
                            engine, stall.drafting(make()), num_speculative_tokens=8, exact_greedy=False,
                            schedule=make_schedule("cost_aware", 8, confirm=confirm))
            cpu = {key: 0.0 for key in conditions}
            tokens = {key: 0 for key in conditions}
            steps = {key: [0, 0] for key in conditions}  # [drafting steps, steps]
            order = list(conditions)
            for i, batch in enumerate(batches):
                for key in order[i % len(order):] + order[:i % len(order)]:
                    stall.armed, stall.proposals, stall.passes = (key[2] if i == 0 and key != "plain" else None), 0, 0
                    out = conditions[key].generate(batch, max_new_tokens=args.max_new)
                    cpu[key] += out.stats.cpu_s
                    tokens[key] += sum(len(o) for o in out.output_ids)
                    steps[key][0] += sum(n > 0 for n in out.stats.draft_lengths)
                    steps[key][1] += out.stats.steps
            plain_rate = tokens["plain"] / cpu["plain"]
            for key in order[1:]:
                name, confirm, stalled = key
                rows.append({"batch": b, "rep": rep, "proposer": name, "confirm": confirm, "stalled": stalled,
                             "speedup_cpu": tokens[key] / cpu[key] / plain_rate,
                             "drafting_steps": steps[key][0] / max(steps[key][1], 1), "steps": steps[key][1]})
            print(f"batch {b} rep {rep} done", flush=True)
    print(f"| batch | proposer | confirm | {args.stall} s stall in | CPU-time speedup, median (min-max) | "
          "steps drafting, median |")
    print("| ---: | --- | ---: | --- | --- | ---: |")
    for b in args.batch:
        for name in proposers:
            for confirm in (1, 3):
                for stalled in STALLS:
                    sel = [r for r in rows if (r["batch"], r["proposer"], r["confirm"], r["stalled"]) ==
                           (b, name, confirm, stalled)]
                    s = [r["speedup_cpu"] for r in sel]
                    d = statistics.median(r["drafting_steps"] for r in sel)
                    print(f"| {b} | {name} | {confirm} | {stalled or 'none'} | "
                          f"{statistics.median(s):.2f}x ({min(s):.2f}-{max(s):.2f}) | {d:.0%} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
