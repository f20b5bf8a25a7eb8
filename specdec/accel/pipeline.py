"""Pipelined speculative steps: the host one step behind the device, for a draft model under compile=on.

A serial speculative step ends with a read: the host learns how many drafts each row accepted, and
only then builds the next step's inputs (which tokens the draft catches up on, where the target's
pass writes) and launches it. On a GPU running compiled graphs that read, the host's bookkeeping
and the next launches are time the device sits idle, waiting for the host (experiments/gpu/LOG.md,
"NVIDIA H200: first measurements").

Here nothing the next step needs goes through the host. Per row the device holds L, the tokens
committed (`seq_lens`), and a step works from it alone:

- score: the target's pass over [token L-1, d_1..d_k] at cache indices and positions L-1..L+k-1
  (`CompiledForward.forward_at`), then the verifier, on the device as always;
- commit: the emitted tokens go to the token buffer at L.., and L grows by accepted + 1 in the rows
  the host still decodes (`live`, uploaded with the step);
- draft the next step: the draft has fed every token before D = min(L_prev + min(a, k - 1), L - 1)
  (its accepted drafts, and never the last token: `DraftModelProposer.observe`'s rule), so it
  catches up on tokens D..L-1, one or two, and chains k - 1 greedy passes after them
  (`CompiledForward.catch_up_chain_at`).

So the host queues step n+1 before it reads step n's outcome, and does step n's bookkeeping (EOS,
max_new_tokens, streaming, statistics) while the device runs step n+1; the read waits for step n
alone (its copy to the host is queued right behind it, `specdec.accel.syncs.HostCopy`). Only bounds of
the lengths are needed on the host (the key bucket, the room left), and it has them: each step adds
at most k + 1. The target cache's host lengths follow each read (the serial loop's commit), the
draft's are settled when the pipeline drains (`_settle`). The passes and the verifier's draws are
the serial loop's, in the same order, so the tokens are too; what differs is the key bucket (from a
bound, so perhaps the next one up: masked keys, the same results in float32) and the draft's
catch-up width (always the width of two tokens). A row that ends on EOS at step n (or on
max_new_tokens, reached by more than one token) has been given step n+1 already, which is dropped:
as in overlapped plain decoding.

Under explicit CUDA graphs (`cuda_graphs="explicit"`) a step is then captured whole: drafting,
scoring, verifying and the commit, everything from the last step's outcome (L before and after it,
the drafts accepted) to this one's, as one graph per key (`CompiledForward.at_key` of its two
passes: the key buckets and clamps the host decides from its bounds), its compiled calls run inline
(`specdec.accel.compiled.inline_calls`). A step is then one replay, its inputs copied in and its outcome
copied out, instead of two graph calls and some forty small operators: the host's work of a step,
which the device waited for (experiments/gpu/LOG.md, "NVIDIA H200: run 3"). A verifier that draws gets its
uniforms as an input, drawn before the step as the serial loop draws them (`ForcedVerifier.draw`);
other verifiers than greedy and forced acceptance are not captured, and a capture the device refuses
leaves the steps uncaptured (a warning; `reports.pipeline.step_graph_error`). Captured steps time
their drafting with their verifying (`verify_s`).

It runs (`pipeline_blocked` says why not) for greedy drafting with a model (`DraftModelProposer`,
layer skipping's view included) under compile=on, a constant k >= 2 and any verifier of a chain of
drafts, while each row has room for a step ahead (`_fits`): the decoder allocates k + 1 positions
more for it where the context has them, and where it has not, the last few steps run serially again.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial

import torch

from specdec.accel.compiled import inline_calls
from specdec.accel.cuda_graphs import CapturedCall
from specdec.accel.syncs import HostCopy, to_device
from specdec.core.contract import check_proposal
from specdec.core.sampling import SamplingParams
from specdec.core.schedules import ConstantSchedule
from specdec.core.tree_verify import TreeVerifier
from specdec.core.types import DecodeState, Proposal, StepOutcome, Verification
from specdec.core.verify import GreedyVerifier
from specdec.proposers.draft_model import DraftModelProposer


def pipeline_blocked(decoder, sampling: SamplingParams, verifier) -> str | None:
    """Why a generation of `decoder` at `sampling` with `verifier` cannot be pipelined (None: it can)."""
    engine, proposer = decoder.engine, decoder.proposer
    if not isinstance(proposer, DraftModelProposer):
        return "only a draft model's steps (method=draft, layer_skip) are pipelined"
    if not sampling.greedy:
        return "the draft samples at temperature > 0 (its chain is greedy)"
    if type(decoder.schedule) is not ConstantSchedule or decoder.k < 2:
        return "a constant k >= 2 is needed (the draft's k - 1 passes chained in one graph)"
    if isinstance(verifier, TreeVerifier):
        return "token trees are not pipelined"
    for model in (engine.target, proposer.draft):
        if model.compiled is None:
            return f"the {model.name}'s passes run eagerly (compile=off)"
        if getattr(model, "_hidden_source", None) is not None:
            return f"the {model.name} keeps hidden states for a drafter"
    return None


@dataclass
class _Step:
    """One queued step: its drafts and outcome on the device, the copy of the outcome on its way to
    the host, and what the host knows about the lengths it ran at."""

    proposal: Proposal
    result: Verification
    before: torch.Tensor  # [B] L before the step, on the device
    after: torch.Tensor  # [B] L after it
    copy: HostCopy  # of [B, 1 + k + 1]: accepted, then the step's tokens
    live: list[bool]  # rows the step advanced


class PipelinedSteps:
    """The steps of one generation, queued one ahead of their reads (see the module's docstring);
    `run` returns when every row is done or the pipeline had to drain (the serial loop goes on)."""

    def __init__(self, decoder, state: DecodeState, verifier, stats, start: float, on_tokens, draft_t, verify_t):
        self.decoder, self.state, self.verifier, self.stats = decoder, state, verifier, stats
        self.start, self.on_tokens, self.draft_t, self.verify_t = start, on_tokens, draft_t, verify_t
        self.k = decoder.k
        self.target, self.draft = decoder.engine.target, decoder.proposer.draft
        self.device = state.tokens.device
        self.columns = torch.arange(self.k + 1, device=self.device)  # [k + 1]
        # Per row, L on the device after the last step read (host copy; rows the host finished are
        # still advanced by the steps queued before it knew).
        self.lens = list(state.seq_lens)
        # Per row, one less than the L at which it has emitted max_new_tokens: a step's drafts are cut on the device
        # to the row's room less one (`_verify`), as the serial loop cuts them on the host.
        self.last = to_device([p + state.max_new_tokens - 1 for p in state.prompt_lens], self.device)
        self.steps = 0
        self._live: dict[tuple, torch.Tensor] = {}
        # Steps captured whole (`_replay`): with explicit CUDA graphs for both models, and a verifier
        # that draws nothing or draws apart (`draw`, `decide`), one graph per key of the two passes.
        graphs = {self.target.compiled.graph_class, self.draft.compiled.graph_class}
        whole = isinstance(verifier, GreedyVerifier) or hasattr(verifier, "decide")
        self.graph_class = graphs.pop() if len(graphs) == 1 and None not in graphs and whole else None
        self._graphs: dict[tuple, CapturedCall] = {}
        self.graphed_steps = 0
        self.graph_error: str | None = None

    def run(self) -> None:
        state, k = self.state, self.k
        before = list(self.lens)  # per row, a bound on L before the step to queue: here L itself
        if not self._fits(before):
            return
        with self.draft_t:  # the first drafts: the host knows every length, the proposer's own step
            proposer = self.decoder.proposer
            proposal = check_proposal(proposer, proposer.propose(state, k), state, k, self.target.vocab_size)
        live = list(state.active)
        with self.verify_t:
            lens = to_device(state.seq_lens, self.device)
            pending = self._queued(lens, proposal, *self._verify(lens, proposal, self._live_rows(live), self._draw(),
                                                                 max(before)), live)
        while True:
            queued = None
            # L after the pending step, bounded from the last step read: at most k + 1 more per live row
            before = [n + (k + 1) * on for n, on in zip(self.lens, pending.live)]
            # Rows that may still decode after the pending step: it gives every row it advances a
            # token, so a row with room for one more ends with it.
            live = [on and not (ahead and state.room(b) <= 1)
                    for b, (on, ahead) in enumerate(zip(state.active, pending.live))]
            if any(live) and self._fits(before):
                queued = self._next(pending, max(before), live)
            outcome = self._read(pending)
            if queued is None or not any(state.active):
                break  # a step queued after every row ended is dropped, unread
            pending = queued
        self._settle(outcome)

    def report(self) -> dict:
        """For results: the steps this generation ran pipelined (the rest, if any, ran serially), and
        where steps are captured whole, how many ran as one replay and the graphs captured for them
        (or why capturing stopped)."""
        out = {"pipelined_steps": self.steps}
        if self.graph_class is not None or self.graph_error is not None:
            out |= {"graphed_steps": self.graphed_steps, "step_graphs": len(self._graphs)}
        if self.graph_error is not None:
            out["step_graph_error"] = self.graph_error
        return out

    def _fits(self, before: list[int]) -> bool:
        """Whether a step from lengths up to `before` fits: its tokens go to the buffer at L..L+k and
        the target's cache at L-1..L+k-1 (the draft's stay below), whatever the rows accept."""
        return max(before) + self.k + 1 <= self.state.max_len

    def _live_rows(self, live: list[bool]) -> torch.Tensor:
        key = tuple(live)
        if key not in self._live:  # a handful of patterns a generation: one upload each
            self._live[key] = to_device(list(key), self.device).long()
        return self._live[key]

    def _passes(self, bound: int) -> tuple[tuple[int, int, int], tuple[int, int]]:
        """The two passes of a step from lengths up to `bound`, as `CompiledForward.at_key` takes them:
        the draft's catch-up over 2 tokens and its k - 1 chained passes, bounded by bound + 1 (`_chain`),
        and the target's pass over k + 1 tokens, bounded by bound + k (`_verify`). One place for both
        the calls and the key their captured step replays under."""
        return (2, bound + 1, self.k - 1), (self.k + 1, bound + self.k)

    def _draw(self) -> torch.Tensor | None:
        """The step's uniforms where the verifier draws apart from deciding (`ForcedVerifier.draw`):
        drawn before the step is queued, as the serial loop would draw them (the greedy draft draws
        nothing), so that a step captured whole takes them as an input; else None."""
        draw = getattr(self.verifier, "draw", None)
        return None if draw is None else draw(self.state.batch_size, self.k, self.device, self.state.generator)

    def _verify(self, lens: torch.Tensor, proposal: Proposal, live: torch.Tensor, u: torch.Tensor | None,
                bound: int) -> tuple:
        """Score `proposal` from the lengths `lens: [B]` (device; each at most `bound`), verify, and
        commit on the device, advancing the rows of `live: [B]` (0/1). Returns the verification, L
        after the step `[B]` and the outcome for the host `[B, 1 + k + 1 + 1]` (accepted, the tokens,
        the drafts each row kept: k, or its room less one where that is less, 0 for a row not advanced)."""
        state = self.state
        kept = (self.last - lens).clamp(min=0, max=self.k) * live  # [B]
        proposal = Proposal(proposal.tokens, [self.k] * state.batch_size, device_lengths=kept)
        last = state.tokens.gather(1, (lens - 1)[:, None])  # [B, 1]
        _, end = self._passes(bound)[1]
        logits = self.target.compiled.forward_at(torch.cat([last, proposal.tokens], dim=1), lens - 1, end)
        if logits is None:
            raise RuntimeError("a pipelined step's target pass could not run compiled")
        if u is None:
            result = self.verifier(logits, proposal, state.sampling, state.generator)
        else:
            result = self.verifier.decide(logits, proposal, state.sampling, u, state.generator)
        accepted = result.accepted
        # Row b's emitted tokens to the buffer at L_b.., each column past them a copy of its last one.
        upto = torch.minimum(self.columns[None], accepted[:, None])  # [B, k + 1]
        state.tokens.scatter_(1, lens[:, None] + upto, result.tokens.gather(1, upto))
        after = lens + (accepted + 1) * live
        dtype = result.tokens.dtype
        return result, after, torch.cat([accepted[:, None].to(dtype), result.tokens, kept[:, None].to(dtype)], dim=1)

    def _chain(self, before: torch.Tensor, accepted: torch.Tensor, after: torch.Tensor, bound: int) -> Proposal:
        """The next step's k drafts from a step's outcome (L before and after it, the drafts
        accepted: `[B]` each, on the device; `bound` the longest L after it can be): the catch-up on
        tokens D..L-1 and the k - 1 chained passes after it, one call."""
        k = self.k
        width, end, n = self._passes(bound)[0]
        fed = torch.minimum(before + accepted.clamp(max=k - 1), after - 1)  # [B] D
        counts = after - fed  # [B] 1 or 2
        chunk = self.state.tokens.gather(1, fed[:, None] + self.columns[:width])  # [B, 2]; D + 1 <= L <= bound
        drafts = self.draft.compiled.catch_up_chain_at(chunk, fed, counts, n, end)
        if drafts is None:
            raise RuntimeError("a pipelined step's draft could not run compiled")
        return Proposal(drafts, [k] * self.state.batch_size)

    def _whole(self, before, accepted, after, live, *u, bound: int) -> tuple:
        """A step from the last one's outcome, drafts to commit, as the tensors a captured graph
        returns (its compiled calls run inline: `inline_calls`)."""
        with inline_calls():
            proposal = self._chain(before, accepted, after, bound)
            result, new_after, outcome = self._verify(after, proposal, live, u[0] if u else None, bound)
        return after.clone(), proposal.tokens, result.accepted, result.tokens, new_after, outcome

    def _next(self, step: _Step, bound: int, live: list[bool]) -> _Step:
        """Queue the step after `step` from its outcome on the device (`bound`: the longest L after
        it can be), captured whole where it can be (`_replay`), else as its passes and operators."""
        rows, u = self._live_rows(live), self._draw()
        args = (step.before, step.result.accepted, step.after, rows, *(() if u is None else (u,)))
        if self.graph_class is not None:
            with self.verify_t:  # one replay: the drafting is timed with the verifying
                out = self._replay(args, bound)
            if out is not None:
                lens, drafts, accepted, tokens, after, outcome = out
                return self._queued(lens, Proposal(drafts, [self.k] * len(live)), Verification(tokens, accepted),
                                    after, outcome, live)
        with self.draft_t:
            proposal = self._chain(step.before, step.result.accepted, step.after, bound)
        with self.verify_t:
            return self._queued(step.after, proposal, *self._verify(step.after, proposal, rows, u, bound), live)

    @torch.inference_mode()
    def _replay(self, args: tuple, bound: int) -> tuple | None:
        """The step as one replay of its graph, captured on its key's first step: the two passes'
        host decisions (`CompiledForward.at_key`), so that a replay is what the Python would launch.
        None where capturing failed (the steps go on uncaptured, and the report says why)."""
        draft, target = self._passes(bound)
        key = (self.draft.compiled.at_key(*draft), self.target.compiled.at_key(*target))
        graph = self._graphs.get(key)
        if graph is None:
            try:
                graph = CapturedCall(partial(self._whole, bound=bound), args, {}, None, self.graph_class(self.device))
            except RuntimeError as err:  # what ran before the failure is a step run once: runs again the same
                self.graph_class, self.graph_error = None, f"{type(err).__name__}: {err}"
                warnings.warn(f"a pipelined step could not be captured as one CUDA graph ({self.graph_error}); "
                              "its passes run one graph each", RuntimeWarning, stacklevel=2)
                return None
            self._graphs[key] = graph
        self.graphed_steps += 1
        return graph(args, {})

    def _queued(self, lens: torch.Tensor, proposal: Proposal, result: Verification, after: torch.Tensor,
                outcome: torch.Tensor, live: list[bool]) -> _Step:
        """A step queued on the device, its outcome's copy to the host queued behind it."""
        return _Step(proposal, result, lens, after, HostCopy(outcome), live)

    def _read(self, step: _Step) -> StepOutcome:
        """Wait for `step`'s outcome and commit it on the host with the serial loop's `commit_step`
        (the device's buffer holds the tokens already)."""
        state, stats = self.state, self.stats
        host = step.copy.read()
        accepted, tokens = [row[0] for row in host], [row[1:-1] for row in host]
        step.proposal.settle([row[-1] for row in host])  # the drafts each row kept
        outcome = self.decoder.commit_step(state, step.proposal, step.result, accepted, tokens, None, stats,
                                            self.start, self.on_tokens, write=False)
        stats.steps += 1
        stats.draft_lengths.append(step.proposal.max_length)
        self.steps += 1
        self.lens = [n + (a + 1) * on for n, a, on in zip(self.lens, accepted, step.live)]
        return outcome

    def _settle(self, outcome: StepOutcome) -> None:
        """The draft cache's host length after the last step read: what the proposer's own `observe`
        keeps after a step that fed k - 1 drafts (the target's was rolled back by `commit_step`)."""
        self.decoder.proposer.observe_fed(self.state, outcome, self.k - 1)
