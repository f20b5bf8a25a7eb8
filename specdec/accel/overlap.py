"""Overlapped plain decoding: the host one step behind the device.

Each plain step emits exactly one token per row that has room left, so the host knows every row's
length one step ahead without reading anything: it queues step n+1 (whose input token is step n's
output, written to the token buffer on the device) before it reads step n's tokens, and does step
n's bookkeeping (EOS, streaming, statistics) while the device runs step n+1. On a GPU that keeps the
device from waiting for the host (experiments/gpu/LOG.md); on a CPU, where nothing runs ahead,
`overlap=auto` leaves it off. The passes are the serial loop's, so the tokens are the same, bit for bit.
"""

from __future__ import annotations

from specdec.core.device import HostCopy, to_device
from specdec.core.types import Proposal

__all__ = ["OverlappedSteps"]


class OverlappedSteps:
    """A `StepRunner` for plain decoding (`SpeculativeDecoder` without a proposer): it runs every
    step, queued one ahead of its read, and commits through `SpeculativeDecoder.commit_tokens`.

    The read waits for step n alone: its copy to the host is queued right behind it, with an event.
    The cost: a row that ends on EOS at step n has already been given step n+1, whose token is
    dropped (its cache entry too), one extra pass at the end of a generation that stops on EOS."""

    def __init__(self, decoder, state, verifier, stats, start: float, on_tokens, draft_t, verify_t):
        self.decoder, self.state, self.verifier, self.stats = decoder, state, verifier, stats
        self.start, self.on_tokens, self.verify_t = start, on_tokens, verify_t

    def report(self) -> None:
        return None

    def run(self) -> None:
        """Plain steps until every row is done."""
        decoder, state, verifier, stats, start, on_tokens, verify_t = (
            self.decoder, self.state, self.verifier, self.stats, self.start, self.on_tokens, self.verify_t)
        target, sampling, b = decoder.engine.target, state.sampling, state.batch_size
        proposal = Proposal.empty(b, state.tokens.device)
        ahead = [0] * b  # per row, tokens queued whose step has not been read yet (0 or 1)
        pending = None  # (step's tokens on their way to the host, which rows it gave a token)
        while True:
            lens = [n + a for n, a in zip(state.seq_lens, ahead)]
            live = [on and n - p < state.max_new_tokens
                    for on, n, p in zip(state.active, lens, state.prompt_lens)]
            queued = None
            if any(live):
                target.rollback([n - 1 for n in lens])
                with verify_t:
                    logits = decoder.score(state, proposal, lens)
                    result = verifier(logits, proposal, sampling, state.generator)
                    rows = [r for r in range(b) if live[r]]
                    where = to_device([rows, [lens[r] for r in rows]], state.tokens.device)
                    state.tokens[where[0], where[1]] = result.tokens[where[0], 0]
                    queued = (HostCopy(result.tokens[:, 0]), live)
                ahead = [a + on for a, on in zip(ahead, live)]
                stats.steps += 1
                stats.draft_lengths.append(0)
            if pending is not None:
                copy, given = pending
                tokens = copy.read()
                counts = [int(g and on) for g, on in zip(given, state.active)]
                emitted = decoder.commit_tokens(state, [[t] for t in tokens], counts, stats, start, on_tokens, write=False)
                for r, n in enumerate(counts):
                    if n:
                        stats.rows[r].record(0, 0, emitted[r])
                # A row that ended drops what was queued after its end.
                ahead = [a - g if on else 0 for a, g, on in zip(ahead, given, state.active)]
            if queued is None:
                break
            pending = queued
        target.rollback([n - 1 for n in state.seq_lens])
