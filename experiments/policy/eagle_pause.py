"""Does EAGLE draft worse after plain steps? Its depth-1 acceptance drafting every step, every 4th
and every 16th step.

The cost-aware policy learns a proposer's acceptance from the steps in which it drafts; under the
policy, EAGLE often drafts after a run of plain steps, when its drafter first catches up on the
tokens it missed. If catching up were lossy, the policy would learn a lower acceptance than steady
drafting has. The embedded SmolLM2 (bfloat16, one thread) with the shipped drafter and the default
tree (4 nodes, depth 2), `exact_greedy=false`, 64 new tokens, greedy, the first 2 Spec-Bench
prompts of each category; a schedule that drafts every `period`-th step and decodes plain between.

    python experiments/policy/eagle_pause.py --periods 1,4,16
"""

from __future__ import annotations

import argparse

import torch

from specdec import Engine, ModelSpec, SpeculativeDecoder, load_model
from specdec.core.schedules import ConstantSchedule
from specdec.proposers.eagle import EagleProposer
from specdec.study.data import build_turn_input, load_spec_bench

CATEGORIES = ("qa", "translation", "math_reasoning", "summarization", "rag", "multi_turn")


class Every(ConstantSchedule):
    """k drafts every `period`-th step of a generation, none in between."""

    fixed_k = False

    def __init__(self, k: int, period: int):
        super().__init__(k)
        self.period, self.step = period, 0

    def reset(self) -> None:
        self.step = 0

    def next_k(self, state) -> int:
        self.step += 1
        return self.k_max if self.step % self.period == 0 else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--periods", default="1,4,16")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(ModelSpec(path="embedded"))
    engine = Engine(model, dtype="auto")
    prompts = [build_turn_input(tok, [], p.turns[0]) for c in CATEGORIES
               for p in [q for q in load_spec_bench() if q.category == c][:args.per_category]]
    print("| drafting every | depth-1 drafts accepted / scored | acceptance |")
    print("| ---: | ---: | ---: |")
    for period in (int(p) for p in args.periods.split(",")):
        accepted = reached = 0
        for prompt in prompts:
            decoder = SpeculativeDecoder(engine, EagleProposer(engine, "embedded", budget=4, topk=4, width=4, depth=2),
                                         num_speculative_tokens=2, exact_greedy=False, schedule=Every(2, period))
            total = decoder.generate([prompt], max_new_tokens=args.max_new).stats.total
            accepted += total.accepted_at[0] if total.accepted_at else 0
            reached += total.reached_at[0] if total.reached_at else 0
        print(f"| {period} | {accepted} / {reached} | {accepted / max(reached, 1):.3f} |", flush=True)


if __name__ == "__main__":
    main()
