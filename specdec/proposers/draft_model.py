"""Draft-model proposer: a smaller causal LM with its own KV cache drafts k tokens per step.

The draft's cache follows the committed sequence by bookkeeping alone. Each step it first catches
up on the tokens it has not fed yet: normally just the last emitted token, but two after a fully
accepted step (its own last draft, never fed to it, and the target's bonus token). Then it drafts
k tokens with k-1 single-token passes. After verification it rolls back to the accepted length.
A step with k = 0 (a schedule chose plain decoding) leaves the draft alone; it catches up on the
missed tokens, in one ragged pass, the next time it drafts.

Under compile=on a greedy draft with a fixed k runs its whole step, the catch-up pass and the k - 1
passes after it, as one compiled call (`CompiledForward.catch_up_chain`: one graph per catch-up
width and key bucket, one CUDA-graph replay a step on a GPU); after an eager catch-up (the draft's
prefill), the k - 1 passes as one (`CompiledForward.chain`).

A confidence schedule stops a row once its draft is unsure. Asking whether every row has stopped is
a read of the device, so only where reads are free (a CPU; `early_exit`) does the loop stop early;
elsewhere it runs its k passes, each row's length stays on the device (`Proposal.device_lengths`) and
comes back with the step's one read.
"""

from __future__ import annotations

import torch

from specdec.core.device import reads_are_free
from specdec.core.engine import CachedModel, Engine
from specdec.core.sampling import greedy_tokens, probabilities, sample
from specdec.proposers.base import Proposal


class DraftModelProposer:
    name = "draft"
    # With a confidence schedule: True stops drafting once every row has stopped (a read per pass),
    # False runs the k passes and leaves the lengths on the device; None: True where reads are free.
    early_exit: bool | None = None

    def __init__(self, engine: Engine):
        if engine.draft is None:
            raise ValueError("method=draft needs a draft model: set draft=self, draft=tiny_random or draft.path=...")
        self.engine = engine
        self.draft: CachedModel = engine.draft
        # Drafts fed to the draft model by the last propose, after the committed tokens (None: it
        # did not run the draft at all).
        self.fed: int | None = None

    def reset(self, state) -> None:
        state.attach(self.draft)  # the previous turn's cache if nothing touched it since, else a fresh one

    @torch.inference_mode()
    def propose(self, state, k: int) -> Proposal:
        self.fed = None
        if k == 0:
            return Proposal.empty(state.batch_size, state.tokens.device)
        # Only a confidence schedule stops rows early (and needs per-row lengths on the device);
        # reading `drafting` back is a host sync, so the other schedules run the k passes without one.
        confidence = state.schedule.uses_confidence
        chained = state.sampling.greedy and k > 1 and getattr(state.schedule, "fixed_k", False) \
            and not confidence and self.draft.compiled is not None
        if chained:  # compile=on, greedy, a k that stays: catch-up and k - 1 passes in one compiled call
            drafted = self.draft.catch_up_chain(state.tokens, state.seq_lens, k - 1)
            if drafted is not None:
                self.fed = k - 1
                return Proposal(drafted, [k] * state.batch_size)
        logits = self.draft.catch_up(state.tokens, state.seq_lens)  # [B, V]
        self.fed = 0
        tokens, probs = [], []
        early_exit = self.early_exit if self.early_exit is not None else reads_are_free(state.tokens.device)
        if confidence:
            lengths = torch.zeros(state.batch_size, dtype=torch.long, device=logits.device)
            drafting = torch.ones(state.batch_size, dtype=torch.bool, device=logits.device)
        elif chained:  # the catch-up ran eagerly (the draft's prefill): the k - 1 passes in one call
            first = greedy_tokens(logits)
            rest = self.draft.compiled.chain(first, k - 1)
            if rest is not None:
                self.fed = k - 1
                return Proposal(torch.cat([first[:, None], rest], dim=1), [k] * state.batch_size)
        for i in range(k):
            q = None if state.sampling.greedy else probabilities(logits, state.sampling)
            t = greedy_tokens(logits) if q is None else sample(q, state.generator)
            tokens.append(t)
            if q is not None:
                probs.append(q)
            if confidence:
                lengths += drafting
            if i == k - 1:
                break
            if confidence:
                top = (q if q is not None else torch.softmax(logits.float(), -1)).amax(-1)
                drafting &= state.schedule.keep_drafting(top)
                if early_exit and not drafting.any():
                    break
            logits = self.draft.forward(t[:, None])[:, 0]
            self.fed += 1
        tokens = torch.stack(tokens, dim=1)
        probs = torch.stack(probs, dim=1) if probs else None
        # Without a confidence schedule every row drafted all of them: known without asking.
        if not confidence:
            return Proposal(tokens, [tokens.shape[1]] * state.batch_size, probs)
        if early_exit:
            return Proposal(tokens, lengths.tolist(), probs)
        return Proposal(tokens, [tokens.shape[1]] * state.batch_size, probs, device_lengths=lengths)

    def observe_fed(self, state, outcome, fed: int) -> None:
        """`observe` a step whose drafting ran outside `propose` (a step runner that chained the
        draft's passes on the device) and fed the draft model `fed` drafts after the committed tokens."""
        self.fed = fed
        self.observe(state, outcome)

    def observe(self, state, outcome) -> None:
        # The draft was fed every committed token before `prev`, then `fed` drafts at prev, prev+1, ...
        # (counted here, not read from the proposal, which a schedule may have shortened since); the
        # accepted ones among those stay valid. The cap n - 1 leaves the last committed token to be
        # fed next step: it bites for a row that finished (cut at EOS or max_new_tokens, or done
        # after a fully accepted step, whose last draft was never fed) and for rows that sat this
        # step out (prev == n).
        if self.fed is None:
            return  # not fed this step; catch_up feeds what it missed
        self.draft.rollback([
            min(prev + min(a, self.fed), n - 1)
            for prev, a, n in zip(outcome.prev_seq_lens, outcome.accepted, state.seq_lens)
        ])
