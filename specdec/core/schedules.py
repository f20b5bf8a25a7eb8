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
- `cost_aware`: the policy that never loses: per step (and per row, for proposals without q) the number
                of drafts, including none, with the most expected tokens per second, from costs
                measured in this run per batch size and scoring width (`specdec.adaptive.policy`). For a
                proposer that drafts trees, the depth (a tree is priced at its node count, never cut).

A schedule picks k before proposing and may shorten a proposal after seeing it (`trim`). Every schedule
decides from the past and the draft's own output only (and cuts only proposals without q, whose tokens
are functions of the past), never from the target's answer for this step, so any of them keeps a
lossless verifier lossless.
"""

from __future__ import annotations

import torch

from specdec.adaptive.policy import Planner, StepClock, drafting, model_cost_hint, verified
from specdec.core.tree import TreeProposal
from specdec.core.types import Proposal


class ConstantSchedule:
    """Always k drafts."""

    name = "constant"
    uses_confidence = False  # True: proposers report each draft's top probability to keep_drafting
    # True: `trim` reads what each row offered (`proposal.lengths`) before the step's read, so a
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


class CostAwareSchedule(ConstantSchedule):
    """The policy that never loses: per step, draft as many tokens as pay for themselves, none
    when none do (see `specdec.adaptive.policy` for the cost model and the decisions).

    Before proposing (`next_k`) it asks the proposer for the k with the best expected tokens per
    second, counting drafting and scoring k + 1 tokens as measured in this run at this batch size
    (in units of a plain step); a proposer whose drafting is free (n-gram, suffix) is asked for k_max. After proposing
    (`trim`), a deterministic proposal (one without q) is cut to the width that pays best, given
    what each row actually offered: row b keeps min(its drafts, j) for the chosen j, which may be 0
    (a plain step). Costs depend on the batch's width only, so a row that offers less is never
    padded with more.

    It reads each row's offer before scoring (`reads_offers`): a lookup's lengths come to the host.

    Arguments: `min_k` (0 allows plain steps), `start` (k of the first speculative step at a new
    batch size), `margin` (a speculative plan must beat plain by this fraction), `explore` (time
    budget for exploring when drafting looks unprofitable), `prior`, `prior_weight`, `decay`
    (acceptance estimates), `window` (timings kept per measured key), `cheap` (drafting under this
    fraction of a plain step counts as free), `probe` (a plain step at least every `probe` steps, to
    keep measuring what the costs are ratios to), `width_error` (decisions price the learned extra
    cost of width at 1 + this times itself), `confirm` (measurements of a width before it alone can
    rule drafting out; 1: the first decides), `optimism` (exploring values a passed-over plan at its
    depth-1 acceptance plus this many standard deviations of the estimate; 0: at the estimate),
    `objective` (`makespan`: a step is worth what it takes off the longest row's remaining tokens,
    since a static batch ends with its last row; `throughput`: every row's tokens, for a server
    that refills finished rows; see `Planner.worth`).
    """

    name = "cost_aware"
    fixed_k = False
    source = "proposer"
    reads_offers = True

    def __init__(self, num_speculative_tokens: int = 8, min_k: int = 0, start: int = 1, margin: float = 0.02,
                 explore: float = 0.01, prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.98,
                 window: int = 16, cheap: float = 0.01, probe: int = 32, width_error: float = 0.5, confirm: int = 3,
                 optimism: float = 1.0, objective: str = "makespan"):
        super().__init__(num_speculative_tokens)
        try:
            self.planner = Planner(self.k_max, min_k, start, margin, explore, prior, prior_weight, decay, window,
                                   cheap, probe, width_error, confirm, optimism, objective)
        except ValueError as err:
            raise ValueError(f"schedule_args: {err}") from None
        self.min_k = min_k
        self.clock = StepClock()
        self.history: list[int] = []  # drafts scored per step (the longest row's), all generations
        self._asked = 0
        self._offered: list[int] = []
        self._trimmable = True  # the last proposal had no q (a lookup, or a draft model decoding greedily)
        self._drafted_before = False  # the proposer drafted in the previous step of this generation

    def bind(self, proposer, engine) -> None:
        """Called by the decoder with its proposer: one that runs a draft model is priced, until
        measured, at the draft's share of the target's parameters (`model_cost_hint`), not as free,
        so that the target drafting for itself is never tried blind."""
        hint = model_cost_hint(proposer, engine)
        if hint is None:
            self.planner.costs.hints.pop(self.source, None)
        else:
            self.planner.costs.hints[self.source] = hint

    def reset(self) -> None:
        self.clock.reset()
        self.planner.new_generation()
        self._drafted_before = False

    def next_k(self, state) -> int:
        self.clock.tick(self.planner.costs)
        self.planner.next_step()
        self._asked = self.planner.ask(self.source, state.batch_size, state.open_rows(), self._trimmable,
                                       switching=not self._drafted_before).k
        return self._asked

    def trim(self, state, proposal: Proposal) -> Proposal:
        if isinstance(proposal, TreeProposal):  # k was its depth; it scores its nodes, and is never cut
            # priced at the widest tree seen (a proposer's trees vary in size up to its budget); its
            # depths stay on the device until the step's read, which is where `observe` takes them
            self.planner.nodes[self.source] = max(self.planner.nodes.get(self.source, 0), proposal.tree.num_nodes)
            self._trimmable = False
            return proposal
        self._offered = proposal.drafted
        if proposal.max_length == 0:
            return proposal  # nothing to cut
        self._trimmable = proposal.probs is None
        if not self._trimmable:
            return proposal  # a sampled draft is never cut after the fact (see specdec.adaptive.policy)
        keep = self.planner.keep(self.source, state.batch_size, state.open_rows(), proposal.lengths, self._asked).k
        return proposal if keep >= proposal.max_length else cut(proposal, keep)

    def observe(self, outcome, draft_s: float, verify_s: float) -> None:
        b, p = len(outcome.active), outcome.proposal
        drafted = {self.source} if self._drafted_before else set()
        self.clock.done(b, 1 + p.max_length, draft_s, drafting([(self.source, self._asked, draft_s)], drafted))
        self._drafted_before = self._asked > 0
        self.planner.stepped(b, 1 + p.max_length)
        if self._asked > 0:
            if isinstance(p, TreeProposal):
                offered = p.drafted
            else:
                offered = self._offered if len(self._offered) == b else list(p.lengths)
            self.planner.model(self.source).observe_offers(
                self._asked, [n for n, on in zip(offered, outcome.active) if on])
        self.planner.observe(self.source, verified(p.drafted, outcome.accepted, outcome.active))
        self.history.append(p.max_length)

    def report(self) -> dict:
        return self.planner.report()


def cut(proposal: Proposal, k: int) -> Proposal:
    """The first min(lengths[b], k) drafts of each row (q kept for those positions). A tree is
    returned whole: its nodes are not a sequence, and a tree is never cut."""
    if isinstance(proposal, TreeProposal):
        return proposal
    probs = proposal.probs[:, :k] if proposal.probs is not None else None
    device_lengths = proposal.device_lengths.clamp(max=k) if proposal.device_lengths is not None else None
    return Proposal(proposal.tokens[:, :k], [min(n, k) for n in proposal.lengths], probs, device_lengths)


def make_schedule(spec, num_speculative_tokens: int, **args):
    """`method.schedule` + `method.schedule_args` -> a schedule object. `spec`: a name (a file in
    conf/method/schedule/, see `specdec.study.registry`), a `_target_` node, or a schedule object, returned
    as it is. The target is called with `num_speculative_tokens` and the args."""
    from specdec.study.registry import build

    return build("method/schedule", spec, "schedule", args, num_speculative_tokens=num_speculative_tokens)
