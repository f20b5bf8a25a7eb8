"""What the policy's decisions cost per step, on synthetic costs, as the hybrid makes them: two
lookups valued by their offers (`Planner.best_keep`), a draft model and a tree drafter valued
before running (`best_ask`), the choice among them (`choose`), a measured step in between.

    python experiments/policy/bench_decisions.py [--batch 4] [--steps 600] [--repeats 5]

Prints the median milliseconds of decisions per step over the repeats, and a digest of every
decision made: two versions of the policy that decide alike print the same digest, so a change
meant to be a pure speed-up can be checked to be one (run both, compare).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import time

from specdec.adaptive.policy import Planner


def run(batch: int, steps: int) -> tuple[float, str]:
    rnd = random.Random(0)
    p = Planner(8)
    p.nodes["eagle"] = 4
    p.costs.hints["draft"] = 1.0
    rows = list(range(batch))
    for source in ("suffix", "ngram", "draft", "eagle"):
        m = p.model(source)
        m.reached, m.accepted = [100.0] * 8, [40.0] * 8
    trace, spent = hashlib.sha256(), 0.0
    for _ in range(steps):
        t = rnd.choice([1, 1, 2, 3, 5])
        drafts = [("suffix", 8, 0.00005, True)] + ([("eagle", 2, 0.003, True)] if t == 5 else [])
        p.costs.add_step(batch, t, 0.03 * (1 + 0.1 * (t - 1)) * rnd.uniform(0.95, 1.05), drafts)
        p.next_step()
        offers = {s: [rnd.randint(0, 8) for _ in rows] for s in ("suffix", "ngram")}
        start = time.perf_counter()
        options = [(s, p.best_keep(s, batch, rows, offers[s], 0.002)) for s in ("suffix", "ngram")]
        options += [(s, p.best_ask(s, batch, rows, True, 0.002, cap=8)) for s in ("draft", "eagle")]
        name, plan = p.choose(options, p.plain(batch, rows, 0.002))
        spent += time.perf_counter() - start
        trace.update(repr((name, plan.k, round(plan.cost, 12), round(plan.tokens, 12))).encode())
        if name:
            p.observe(name, {r: (1, 2) for r in rows})
    return spent / steps * 1e3, trace.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    results = [run(args.batch, args.steps) for _ in range(args.repeats)]
    assert len({d for _, d in results}) == 1  # the decisions do not depend on the clock
    print(f"batch {args.batch}: {statistics.median(ms for ms, _ in results):.3f} ms of decisions per step, "
          f"decisions {results[0][1]}")


if __name__ == "__main__":
    main()
