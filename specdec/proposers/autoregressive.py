"""No drafting at all: every step is one target pass that emits one token.

This is the plain decoding baseline, run through the same engine, caches and loop as every
speculative method, so that speedups compare like with like.
"""

from __future__ import annotations

from specdec.proposers.base import Proposal


class NoDraftProposer:
    name = "autoregressive"

    def reset(self, state) -> None:
        pass

    def propose(self, state, k: int) -> Proposal:
        return Proposal.empty(state.batch_size, state.tokens.device)

    def observe(self, state, outcome) -> None:
        pass
