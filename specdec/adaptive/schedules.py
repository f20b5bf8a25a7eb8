"""The cost-aware schedule: per step, draft as many tokens as pay for themselves, none when none do.

Per step (and per row, for proposals without q) the number of drafts, including none, with the most
expected tokens per second, from costs measured in this run per batch size and scoring width
(`specdec.adaptive.policy`). For a proposer that drafts trees, the depth (a tree is priced at its
node count, never cut). Its name, `cost_aware`, is registered in the core's `SCHEDULES`.
"""

from __future__ import annotations

from specdec.adaptive.policy import Planner, StepClock, drafting, model_cost_hint, verified
from specdec.core.schedules import SCHEDULES, ConstantSchedule, cut
from specdec.core.tree import TreeProposal
from specdec.core.types import Proposal

__all__ = ["CostAwareSchedule"]


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


SCHEDULES["cost_aware"] = CostAwareSchedule
