"""Host synchronisations per decoding step, per method: what a GPU would wait for, counted on the CPU.

Every method decodes the same ragged batch of three prompts (k = 4, 24 new tokens, tiny random
models and the tiny trained EAGLE and Medusa checkpoints of the tests), greedy and sampling, under
`specdec.accel.syncs.count_host_syncs`, after a two-token generation that does the once-per-process set-up.
Counts are deterministic: one run each.

    python experiments/gpu/host_syncs.py
    python experiments/gpu/host_syncs.py --root /path/to/another/checkout   # e.g. an older commit

`--root` imports specdec from another checkout (it needs `specdec/accel/syncs.py`: copy it there).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

METHODS = ("plain", "draft", "ngram", "suffix_tree", "eagle", "medusa")
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [3, 4], [10, 11, 12, 13, 14, 15, 16, 17, 18]]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[2]))
    ap.add_argument("--new-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    sys.path.insert(0, args.root)
    import torch

    from specdec.accel.syncs import count_host_syncs
    from specdec.core.decoding import SpeculativeDecoder
    from specdec.core.engine import Engine
    from specdec.models import tiny_random_model
    from specdec.proposers.draft_model import DraftModelProposer
    from specdec.proposers.eagle import EagleProposer
    from specdec.proposers.medusa import MedusaProposer
    from specdec.proposers.ngram import NgramProposer
    from specdec.proposers.suffix import SuffixTreeProposer

    torch.set_num_threads(1)
    assets = Path(args.root) / "tests" / "assets"
    target = tiny_random_model(seed=0, eos_token_id=None)
    draft = tiny_random_model(seed=1, num_layers=1, eos_token_id=None)

    def proposer(method, engine):
        return {"plain": lambda: None, "draft": lambda: DraftModelProposer(engine),
                "ngram": lambda: NgramProposer(engine),
                "suffix_tree": lambda: SuffixTreeProposer(max_spec_factor=2.0, budget=8),
                "eagle": lambda: EagleProposer(engine, str(assets / "tiny_random_eagle.safetensors"),
                                               budget=10, topk=3, width=3, depth=4),
                "medusa": lambda: MedusaProposer(engine, str(assets / "tiny_random_medusa.safetensors"),
                                                 tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]])}[method]()

    rows = []
    print("| method | temperature | steps | reads per step | by kind, per step |\n|---|---:|---:|---:|---|")
    for method in METHODS:
        for temperature in (0.0, 1.0):
            engine = Engine(target, draft, dtype="float32")
            decoder = SpeculativeDecoder(engine, proposer(method, engine), num_speculative_tokens=4)
            decoder.generate(PROMPTS, max_new_tokens=2)  # once-per-process set-up (a static tree's buffers)
            with count_host_syncs() as syncs:
                out = decoder.generate(PROMPTS, max_new_tokens=args.new_tokens, temperature=temperature)
            steps = out.stats.steps
            kinds = Counter({k: round(v / steps, 2) for k, v in syncs.by_kind.items()})
            rows.append({"method": method, "temperature": temperature, "steps": steps, "reads": syncs.total,
                         "by_kind": dict(syncs.by_kind)})
            print(f"| {method} | {temperature} | {steps} | {syncs.total / steps:.2f} | "
                  f"{', '.join(f'{k} {v}' for k, v in kinds.most_common())} |")
    return rows


if __name__ == "__main__":
    main()
