"""Block verification against token-level speculative sampling on the same drafts, temperature 1.

On the embedded SmolLM2-135M (bfloat16), drafting with its own first layers (layer skip, exit_layer
below), every step's drafts and target distribution are judged by both rules: the decoding goes on
with block verification's result, and token-level verification judges the very same (p, q, drafts)
with its own random numbers. Printed per k: mean accepted drafts per step under each rule as
sampled, and as expected given each step's drafts (E[accepted | p, q, drafts], computed from each
rule's acceptance probabilities: the same drafts, without the noise of the uniforms), the paired
difference with its standard error, and the mean acceptance length (1 + accepted, as sampled).

    python experiments/measurement/block_vs_token.py [--k 2 4 8] [--tokens 64] [--per-category 2]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from specdec import SpeculativeDecoder
from specdec.core.sampling import probabilities
from specdec.core.verify import BlockVerifier, SpeculativeSamplingVerifier
from specdec.proposers.layer_skip import LayerSkipProposer

try:
    from exact_greedy_cost import embedded, spec_bench_first_turns
except ImportError:  # run as a module from the repository root
    from experiments.measurement.exact_greedy_cost import embedded, spec_bench_first_turns


class Paired:
    """Block verification for the decoding; token-level verification of the same step on the side."""

    name = "block"
    lossless = True

    def __init__(self, seed: int):
        self.block, self.token = BlockVerifier(), SpeculativeSamplingVerifier()
        self.generator = torch.Generator().manual_seed(seed)
        self.pairs: list[tuple[int, int]] = []  # (block accepted, token-level accepted) per row-step
        self.expected: list[tuple[float, float]] = []  # the same, expected given the step's drafts

    def __call__(self, logits, proposal, params, generator=None):
        p = probabilities(logits, params)
        out = self.block.verify_probs(p, proposal, generator)
        if proposal.k:
            token = self.token.verify_probs(p, proposal, self.generator)
            self.pairs += list(zip(out.accepted.tolist(), token.accepted.tolist()))
            self.expected += list(zip(self.expected_block(p, proposal).tolist(),
                                      self.expected_token(p, proposal).tolist()))
        return out

    def expected_block(self, p, proposal) -> torch.Tensor:
        """E[tau | drafts] = sum_i i h_i prod_{j>i} (1 - h_j), [B]."""
        q = self.block.draft_probs(p, proposal)
        h = self.block.keep_probabilities(p, q, proposal, self.block.weights(p, q, proposal))  # [B, k]
        later = torch.flip(torch.cumprod(torch.flip(1 - h, [1]), 1), [1])  # prod_{j>=i} (1 - h_j)
        later = torch.cat([later[:, 1:], torch.ones_like(h[:, :1])], 1)  # prod_{j>i}
        return (torch.arange(1, h.shape[1] + 1) * h * later).sum(1)

    def expected_token(self, p, proposal) -> torch.Tensor:
        """E[tau | drafts] = sum_i prod_{j<=i} min(1, p(x_j) / q(x_j)), [B]."""
        q = self.block.draft_probs(p, proposal)
        x = proposal.tokens
        p_x = p[:, : proposal.k].gather(-1, x[..., None]).squeeze(-1)
        q_x = q.gather(-1, x[..., None]).squeeze(-1)
        return torch.cumprod((p_x / q_x).clamp(max=1), 1).sum(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--exit-layer", type=int, default=12)
    ap.add_argument("--seeds", type=int, default=2, help="generations per prompt (different seeds)")
    args = ap.parse_args()
    engine, tok = embedded(with_draft=False)
    prompts = spec_bench_first_turns(tok, args.per_category)
    print(f"{len(prompts)} prompts x {args.seeds} seeds, {args.tokens} tokens, temperature 1, "
          f"layer skip exit_layer={args.exit_layer}, bfloat16\n")
    print("| k | steps | accepted/step: block | token-level | block - token (s.e.) | expected given the drafts: "
          "block | token-level | block - token (s.e.) | mean acceptance length: block | token-level |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k in args.k:
        verifier = Paired(seed=k)
        dec = SpeculativeDecoder(engine, LayerSkipProposer(engine, exit_layer=args.exit_layer), k,
                                 verifier=verifier, tokenizer=tok)
        for seed in range(args.seeds):
            for _, ids in prompts:
                dec.generate([ids], max_new_tokens=args.tokens, temperature=1.0, seed=seed)
        block = [b for b, _ in verifier.pairs]
        token = [t for _, t in verifier.pairs]
        diff = [b - t for b, t in verifier.pairs]
        se = statistics.stdev(diff) / len(diff) ** 0.5
        mb, mt = statistics.fmean(block), statistics.fmean(token)
        eb, et = (statistics.fmean(x) for x in zip(*verifier.expected))
        ese = statistics.stdev([b - t for b, t in verifier.expected]) / len(diff) ** 0.5
        print(f"| {k} | {len(diff)} | {mb:.3f} | {mt:.3f} | {mb - mt:+.3f} ({se:.3f}) | {eb:.3f} | {et:.3f} | "
              f"{eb - et:+.3f} ({ese:.3f}) | {1 + mb:.2f} | {1 + mt:.2f} |", flush=True)


if __name__ == "__main__":
    main()
