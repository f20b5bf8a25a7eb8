"""Draft-length schedules: how many tokens to propose at each step.

A schedule picks k before each step (`next_k`), may stop drafting early inside a step
(`keep_drafting`, asked by proposers that draft token by token), and learns from each outcome
(`observe`). `num_speculative_tokens` is k for `constant` and the upper bound `k_max` for the
adaptive ones (the decoder sizes its caches for k_max + 1 positions per step).

- `constant`:   k every step, the classic setting.
- `heuristic`:  transformers' assisted-generation rule: k += 2 after a step whose drafts were all
                accepted, k -= 1 after a rejection, kept within [1, k_max].
- `confidence`: draft up to k_max tokens but stop once the draft's top probability for the token
                just drafted falls below `threshold` (transformers' `assistant_confidence_threshold`).
- `cost_aware`: the policy that never loses, in `specdec.adaptive.schedules` (registered here under
                its name when `specdec.adaptive` is imported, as `import specdec` does).

A schedule picks k before proposing and may shorten a proposal after seeing it (`trim`). Every schedule
decides from the past and the draft's own output only (and cuts only proposals without q, whose tokens
are functions of the past), never from the target's answer for this step, so any of them keeps a
lossless verifier lossless.
"""

from __future__ import annotations

import torch

from specdec.core.arguments import build_named
from specdec.core.tree import TreeProposal
from specdec.core.types import Proposal


class ConstantSchedule:
    """Always k drafts."""

    name = "constant"
    uses_confidence = False  # True: proposers report each draft's top probability to keep_drafting
    # Sync-free hints (`specdec.core.types.SyncFreeHints`). True: `trim` reads what each row offered (`proposal.lengths`) before the step's read, so a
    # proposer must give exact lengths on the host (n-gram lookup then reads them on a GPU).
    reads_offers = False
    # True: k is the same from step to step, so a greedy draft under compile=on runs its passes as one
    # compiled chain (`CompiledForward.chain`): one graph per k, which a k that changes every step
    # would multiply (the tokens are the same either way). A subclass whose k varies sets False.
    fixed_k = True

    def __init__(self, num_speculative_tokens: int = 4):
        if num_speculative_tokens < 1:
            raise ValueError(f"method.num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.k_max = num_speculative_tokens

    def reset(self) -> None:
        """A new generation starts."""

    def next_k(self, state) -> int:
        return self.k_max

    def keep_drafting(self, top_probs: torch.Tensor) -> torch.Tensor:
        """top_probs: [B] the draft's highest probability for the token just drafted -> [B] bool."""
        return torch.ones_like(top_probs, dtype=torch.bool)

    def trim(self, state, proposal: Proposal) -> Proposal:
        """The proposal as it will be scored: a schedule may shorten rows after seeing it."""
        return proposal

    def observe(self, outcome, draft_s: float, verify_s: float) -> None:
        """The step's outcome and how long its drafting (propose + trim) and verification took (seconds)."""

    def report(self) -> dict | None:
        """What the schedule learned, for results (None: nothing to report)."""
        return None


def _drafting_rows(outcome) -> list[int]:
    """Rows that took part in the step and were proposed at least one draft."""
    lengths = outcome.proposal.lengths
    return [b for b, on in enumerate(outcome.active) if on and lengths[b] > 0]


class HeuristicSchedule(ConstantSchedule):
    """Grow k by `grow` after a step in which every drafting row accepted all its drafts, shrink it
    by `shrink` otherwise; start at `start` (default k_max) at every generation. The constants are
    transformers' (`num_assistant_tokens_schedule="heuristic"`: +2 / -1)."""

    name = "heuristic"
    fixed_k = False

    def __init__(self, num_speculative_tokens: int = 8, start: int | None = None, grow: int = 2, shrink: int = 1):
        super().__init__(num_speculative_tokens)
        self.start = self.k_max if start is None else start
        if not 1 <= self.start <= self.k_max:
            raise ValueError(f"schedule_args.start must be in [1, {self.k_max}], got {self.start}")
        if grow < 0 or shrink < 0:
            raise ValueError(f"schedule_args.grow and shrink must be >= 0, got {grow}, {shrink}")
        self.grow, self.shrink = grow, shrink
        self.k = self.start

    def reset(self) -> None:
        self.k = self.start

    def next_k(self, state) -> int:
        return self.k

    def observe(self, outcome, draft_s: float, verify_s: float) -> None:
        rows = _drafting_rows(outcome)
        if not rows:
            return  # nothing was proposed (an n-gram miss): no evidence either way
        full = all(outcome.accepted[b] >= outcome.proposal.lengths[b] for b in rows)
        self.k = min(self.k + self.grow, self.k_max) if full else max(self.k - self.shrink, 1)


class ConfidenceSchedule(ConstantSchedule):
    """Draft up to k_max tokens per row; a row stops after a draft whose top probability < threshold.
    The low-confidence draft itself is still proposed (as transformers does). Proposers without
    probabilities (n-gram) ignore it and draft k_max."""

    name = "confidence"
    fixed_k = False
    uses_confidence = True

    def __init__(self, num_speculative_tokens: int = 8, threshold: float = 0.4):
        super().__init__(num_speculative_tokens)
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"schedule_args.threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    def keep_drafting(self, top_probs: torch.Tensor) -> torch.Tensor:
        return top_probs >= self.threshold


def cut(proposal: Proposal, k: int) -> Proposal:
    """The first min(lengths[b], k) drafts of each row (q kept for those positions). A tree is
    returned whole: its nodes are not a sequence, and a tree is never cut."""
    if isinstance(proposal, TreeProposal):
        return proposal
    probs = proposal.probs[:, :k] if proposal.probs is not None else None
    device_lengths = proposal.device_lengths.clamp(max=k) if proposal.device_lengths is not None else None
    return Proposal(proposal.tokens[:, :k], [min(n, k) for n in proposal.lengths], probs, device_lengths)


# The schedules a name gives (`schedule="heuristic"`), each called with `num_speculative_tokens` and
# its arguments. `specdec.adaptive` adds `cost_aware`; the study layer builds named schedules from
# conf/method/schedule/ (which may name others) and hands the objects over.
SCHEDULES: dict[str, type] = {"constant": ConstantSchedule, "heuristic": HeuristicSchedule,
                              "confidence": ConfidenceSchedule}


def make_schedule(spec, num_speculative_tokens: int, **args):
    """A schedule object: `spec` a name of `SCHEDULES`, called with `num_speculative_tokens` and
    `args`; anything else (a schedule object) is returned as it is."""
    if not isinstance(spec, str):
        if args:
            raise ValueError(f"schedule arguments {sorted(args)} given with a schedule object; pass them to it")
        return spec
    return build_named("schedule", SCHEDULES, spec, args, num_speculative_tokens=num_speculative_tokens)
