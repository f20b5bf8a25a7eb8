"""Draft-length schedules: the factory, and each rule on constructed step outcomes."""

from types import SimpleNamespace

import pytest
import torch

from specdec.proposers.base import Proposal
from specdec.schedules import (
    ConfidenceSchedule,
    ConstantSchedule,
    CostAwareSchedule,
    HeuristicSchedule,
    make_schedule,
)


def _outcome(lengths, accepted, active=None):
    k = max(lengths)
    proposal = Proposal(torch.zeros(len(lengths), k, dtype=torch.long), list(lengths))
    return SimpleNamespace(proposal=proposal, accepted=list(accepted), active=active or [True] * len(lengths))


def test_make_schedule_builds_each_and_refuses_unknown_names():
    assert isinstance(make_schedule("constant", 3), ConstantSchedule)
    assert make_schedule("heuristic", 6, start=2).k == 2
    assert make_schedule("confidence", 5, threshold=0.2).threshold == 0.2
    assert make_schedule("cost_aware", 7).k_max == 7
    with pytest.raises(ValueError, match="constant, heuristic, confidence, cost_aware"):
        make_schedule("nope", 4)
    with pytest.raises(ValueError, match="start"):
        make_schedule("heuristic", 4, start=5)
    with pytest.raises(ValueError, match=">= 1"):
        make_schedule("constant", 0)


def test_heuristic_grows_after_full_acceptance_and_shrinks_after_rejection():
    s = HeuristicSchedule(6, start=3)
    s.observe(_outcome([3, 3], [3, 3]), 0, 0)
    assert s.next_k(None) == 5
    s.observe(_outcome([5, 5], [5, 5]), 0, 0)
    assert s.next_k(None) == 6  # capped at k_max
    s.observe(_outcome([6, 6], [6, 2]), 0, 0)  # one row rejected
    assert s.next_k(None) == 5
    s.observe(_outcome([0, 0], [0, 0]), 0, 0)  # nothing proposed: no evidence
    assert s.next_k(None) == 5
    for _ in range(10):
        s.observe(_outcome([1], [0]), 0, 0)
    assert s.next_k(None) == 1  # never below 1
    s.reset()
    assert s.next_k(None) == 3


def test_confidence_stops_below_threshold():
    s = ConfidenceSchedule(8, threshold=0.4)
    assert s.uses_confidence and s.next_k(None) == 8
    assert s.keep_drafting(torch.tensor([0.9, 0.4, 0.39])).tolist() == [True, True, False]


def _cost_aware(accept: float, verify, draft_per_token: float, k_max=8, **kw):
    """A cost-aware schedule whose estimates were fed: acceptance `accept` at every position,
    verification seconds `verify(T)` for every T, drafting `draft_per_token * k`."""
    s = CostAwareSchedule(k_max, decay=1.0, **kw)
    for t in range(1, k_max + 2):
        s._ema(s.verify_s, t, verify(t), 1.0)
    for k in range(1, k_max + 1):
        s._ema(s.draft_s, k, draft_per_token * k, 1.0)
    s.reached_at = [1e6] * k_max
    s.accepted_at = [1e6 * accept] * k_max
    return s


def test_cost_aware_picks_the_k_that_maximises_tokens_per_second():
    # Free drafting and flat verification: longer is always better.
    assert _cost_aware(0.8, lambda t: 0.04, 0.0).next_k(None) == 8
    # A useless draft that costs something: plain steps.
    assert _cost_aware(0.0, lambda t: 0.04, 0.005).next_k(None) == 0
    assert _cost_aware(0.0, lambda t: 0.04, 0.005, min_k=1).next_k(None) == 1
    # The classic optimum: alpha = 0.8, c = 0.1, flat verification -> argmax (1 - a^(k+1)) / ((1-a)(ck + 1)).
    s = _cost_aware(0.8, lambda t: 0.04, 0.004)
    a, c = 0.8, 0.1
    best = max(range(9), key=lambda k: (1 - a ** (k + 1)) / ((1 - a) * (c * k + 1)))
    assert s.next_k(None) == best == 6
    # Verification that grows with width pushes k down.
    assert _cost_aware(0.8, lambda t: 0.04 + 0.01 * t, 0.004).next_k(None) < best


def test_cost_aware_fits_unmeasured_widths_and_learns_acceptance():
    s = CostAwareSchedule(8, decay=1.0)
    assert s.next_k(None) == 8  # nothing measured: starts at k_max
    s._ema(s.verify_s, 1, 0.040, 1.0)
    s._ema(s.verify_s, 5, 0.060, 1.0)
    assert s._fit(s.verify_s, 9, through_zero=False) == pytest.approx(0.080)  # the line through both
    s._ema(s.draft_s, 4, 0.020, 1.0)
    assert s._fit(s.draft_s, 2, through_zero=True) == pytest.approx(0.010)  # proportional to k
    s.next_k(None)
    s._k = 4
    s.observe(_outcome([4, 4], [4, 1]), 0.02, 0.06)
    # row 0 reached positions 1-4 and accepted all; row 1 reached 1-2 and accepted 1
    assert s.reached_at == [2, 2, 1, 1, 0, 0, 0, 0]
    assert s.accepted_at == [2, 1, 1, 1, 0, 0, 0, 0]
    assert s.acceptance()[4] == pytest.approx(s.prior)  # never reached: the prior


def test_cost_aware_counts_a_row_without_drafts_as_a_miss():
    s = CostAwareSchedule(4, decay=1.0)
    s.next_k(None)
    s.observe(_outcome([0, 3], [0, 3]), 0.0, 0.05)  # an n-gram miss in row 0
    assert s.reached_at[0] == 2 and s.accepted_at[0] == 1
