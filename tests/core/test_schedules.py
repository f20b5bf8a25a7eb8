"""Draft-length schedules: the factory, and each rule on constructed step outcomes."""

from types import SimpleNamespace

import pytest
import torch

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.schedules import (
    ConfidenceSchedule,
    ConstantSchedule,
    HeuristicSchedule,
    make_schedule,
)
from specdec.proposers.base import Proposal
from specdec.proposers.draft_model import DraftModelProposer


def _outcome(lengths, accepted, active=None):
    k = max(lengths)
    proposal = Proposal(torch.zeros(len(lengths), k, dtype=torch.long), list(lengths))
    return SimpleNamespace(proposal=proposal, accepted=list(accepted), active=active or [True] * len(lengths))


def test_make_schedule_builds_each_and_refuses_unknown_names():
    assert isinstance(make_schedule("constant", 3), ConstantSchedule)
    assert make_schedule("heuristic", 6, start=2).k == 2
    assert make_schedule("confidence", 5, threshold=0.2).threshold == 0.2
    assert make_schedule("cost_aware", 7).k_max == 7
    with pytest.raises(ValueError, match="confidence, constant, cost_aware, heuristic"):
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


# The cost-aware policy's decisions are tested in tests/adaptive/test_policy.py.


def test_the_decoder_takes_a_schedule_by_name_and_refuses_what_is_not_one(engine_factory, unrelated_draft):
    engine = engine_factory(unrelated_draft)
    by_name = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=5, schedule="heuristic")
    assert isinstance(by_name.schedule, HeuristicSchedule) and by_name.schedule.k_max == 5 and by_name.k == 5
    prompts = [[5, 6, 7, 8, 9], [3, 4]]
    plain = SpeculativeDecoder(engine).generate(prompts, max_new_tokens=12).output_ids
    assert by_name.generate(prompts, max_new_tokens=12).output_ids == plain
    assert isinstance(SpeculativeDecoder(engine, DraftModelProposer(engine)).schedule, ConstantSchedule)
    with pytest.raises(ValueError, match="unknown schedule 'heuristc'"):
        SpeculativeDecoder(engine, DraftModelProposer(engine), schedule="heuristc")
    with pytest.raises(TypeError, match="got 3, which has no k_max.*subclass specdec.core.schedules.ConstantSchedule"):
        SpeculativeDecoder(engine, DraftModelProposer(engine), schedule=3)
