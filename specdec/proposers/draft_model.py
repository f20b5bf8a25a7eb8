"""Draft-model proposer: a smaller causal LM with its own KV cache drafts k tokens per step.

The draft's cache follows the committed sequence by bookkeeping alone. Each step it first catches
up on the tokens it has not fed yet: normally just the last emitted token, but two after a fully
accepted step (its own last draft, never fed to it, and the target's bonus token). Then it drafts
k tokens with k-1 single-token passes. After verification it rolls back to the accepted length.
A step with k = 0 (a schedule chose plain decoding) leaves the draft alone; it catches up on the
missed tokens, in one ragged pass, the next time it drafts.
"""

from __future__ import annotations

import torch

from specdec.engine import CachedModel, Engine
from specdec.proposers.base import Proposal
from specdec.sampling import greedy_tokens, probabilities, sample


class DraftModelProposer:
    name = "draft"

    def __init__(self, engine: Engine):
        if engine.draft is None:
            raise ValueError("method=draft needs a draft model: set draft=self, draft=tiny_random or draft.path=...")
        self.draft: CachedModel = engine.draft

    def reset(self, state) -> None:
        if state.reuse is None or self.draft.cache is None:
            self.draft.reset(state.batch_size, state.max_len)
        else:
            self.draft.rollback([min(n, r) for n, r in zip(self.draft.lengths, state.reuse)])

    @torch.inference_mode()
    def propose(self, state, k: int) -> Proposal:
        if k == 0:
            return Proposal.empty(state.batch_size, state.tokens.device)
        logits = self.draft.catch_up(state.tokens, state.seq_lens)  # [B, V]
        tokens, probs = [], []
        lengths = torch.zeros(state.batch_size, dtype=torch.long, device=logits.device)
        drafting = torch.ones(state.batch_size, dtype=torch.bool, device=logits.device)
        for i in range(k):
            q = None if state.sampling.greedy else probabilities(logits, state.sampling)
            t = greedy_tokens(logits) if q is None else sample(q, state.generator)
            tokens.append(t)
            if q is not None:
                probs.append(q)
            lengths += drafting
            if state.schedule.uses_confidence:
                top = (q if q is not None else torch.softmax(logits.float(), -1)).amax(-1)
                drafting &= state.schedule.keep_drafting(top)
            if i == k - 1 or not drafting.any():
                break
            logits = self.draft.forward(t[:, None])[:, 0]
        return Proposal(
            tokens=torch.stack(tokens, dim=1),
            lengths=lengths.tolist(),
            probs=torch.stack(probs, dim=1) if probs else None,
        )

    def observe(self, state, outcome) -> None:
        # The draft fed the last token and drafts 1..k-1 (k = tokens drafted this step); of those,
        # the accepted ones stay valid.
        k = outcome.proposal.k
        if k == 0:
            return  # not fed this step; catch_up feeds what it missed
        self.draft.rollback([
            prev + min(a, k - 1) if on else n - 1  # finished rows idle: re-feed their last token
            for prev, a, on, n in zip(outcome.prev_seq_lens, outcome.accepted, state.active, state.seq_lens)
        ])
