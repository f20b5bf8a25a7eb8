"""Why exact greedy needs a fixed pass shape: the logits of one token, scored in two ways.

The embedded SmolLM2-135M in bfloat16, random token contexts. For a pass starting at position s, the
token at s + j is scored (a) as row j of one pass over tokens s .. s+W-1, the way a speculative step
scores its drafts, and (b) as row 0 of its own pass starting at s + j, padded to width Wb, after
plain passes over s .. s+j-1, the way plain decoding scores it. Tokens before s are one prefill,
shared by both. Printed: how many of the W tokens get bitwise equal logits, per setting of the
widths and of the key length (fixed_kv_len: attention over the whole cache buffer).

    python experiments/measurement/shapes.py
"""

from __future__ import annotations

import torch

from specdec import Engine, ModelSpec, load_model

STARTS = (100, 129, 200, 300, 517, 700, 780)
SETTINGS = (  # (width of the speculative pass, width of plain decoding's passes, fixed key length)
    (5, 1, False), (5, 1, True), (5, 5, False), (8, 8, False), (5, 5, True), (8, 8, True),
)


def main() -> None:
    torch.set_num_threads(1)
    model, _ = load_model(ModelSpec(path="embedded"))
    target = Engine(model, dtype="bfloat16").target
    ids = torch.randint(100, 20000, (1, 1000), generator=torch.Generator().manual_seed(0))
    max_len = 1024

    def prefill(s: int, fixed: bool) -> None:
        target.reset(1, max_len)
        target.cache.fixed_kv_len = fixed
        target.forward(ids[:, :s])

    print("| speculative pass width | plain pass width | key length | equal logits |")
    print("|---:|---:|---|---:|")
    for w, wb, fixed in SETTINGS:
        equal = total = 0
        for s in STARTS:
            prefill(s, fixed)
            together = target.forward(ids[:, s : s + w])[0]
            target.rollback([s])
            for j in range(w):  # plain decoding: one pass per token, its padding rolled back
                alone = target.forward(ids[:, s + j : s + j + 1].expand(1, wb).contiguous())[0, 0]
                target.rollback([s + j + 1])
                equal += bool(torch.equal(together[j], alone))
                total += 1
        key = "whole buffer" if fixed else "as written"
        print(f"| {w} | {wb} | {key} | {equal}/{total} |", flush=True)


if __name__ == "__main__":
    main()
