"""Every metric against a hand-computed case: five steps of one row, one of which drafted nothing and
two of which were cut (EOS inside the accepted drafts, max_new_tokens right after the first draft).
The same counts give the same numbers through the decoder's statistics, the typed per-prompt result
and the method's summary, since all three apply the one definition in `specdec.core.metrics`."""

import dataclasses
import json
import math

import pytest

from specdec import Engine, SpeculativeDecoder
from specdec.core.metrics import (
    RowStats,
    acceptance_histogram,
    acceptance_histogram_by_draft_length,
    expected_tokens_per_step,
    mean_acceptance_length,
    per_position_acceptance_rate,
    predicted_speedup,
    predicted_speedup_with_prefill,
)
from specdec.proposers.draft_model import DraftModelProposer
from specdec.study.results import MethodSummary, PromptResult

# (proposed, accepted by the verifier, emitted after the EOS / max_new_tokens cut)
STEPS = [
    (4, 2, 3),  # two accepted, then the recovered token
    (4, 4, 5),  # all four accepted, then the bonus
    (0, 0, 1),  # nothing drafted: a plain decoding step
    (3, 3, 2),  # the second draft was EOS: the third, accepted by the verifier, is never emitted
    (4, 1, 1),  # max_new_tokens reached after the first draft: the recovered token is not emitted
]


@pytest.fixture
def row() -> RowStats:
    r = RowStats()
    for step in STEPS:
        r.record(*step)
    return r


def test_counts_leave_out_drafts_past_the_cut(row):
    assert (row.steps, row.proposed, row.emitted) == (5, 15, 12)
    assert row.accepted == 2 + 4 + 0 + 2 + 1  # not 10: the draft past EOS was not emitted
    assert row.proposed_at == [4, 4, 4, 3]
    assert row.reached_at == [4, 3, 2, 1]
    assert row.accepted_at == [4, 3, 1, 1]
    assert (row.bonus, row.recovered) == (1, 1)  # the cut steps emitted neither a bonus nor a recovered token
    assert row.draft_lengths == [4, 4, 0, 3, 4] and row.accepted_lengths == [2, 4, 0, 2, 1]


def test_each_metric_against_its_hand_computed_value(row):
    assert row.acceptance_rate == pytest.approx(9 / 15)  # alpha
    assert row.mean_accepted_length == pytest.approx(12 / 5)  # tau: every target pass counts
    assert row.num_spec_steps == 4
    assert row.mean_acceptance_length == pytest.approx(1 + 9 / 4)  # vLLM: steps that drafted only
    assert row.per_position_acceptance == pytest.approx([4 / 4, 3 / 3, 1 / 2, 1 / 1])  # conditional
    assert row.per_position_acceptance_rate == pytest.approx([4 / 4, 3 / 4, 1 / 4, 1 / 4])  # vLLM's
    assert row.acceptance_histogram == [0, 1, 2, 0, 1]
    assert row.acceptance_histogram_by_draft_length == {3: [0, 0, 1, 0], 4: [0, 1, 1, 0, 1]}


def test_definitions_on_edge_cases():
    assert mean_acceptance_length(0, 0) == 1.0  # nothing drafted: vLLM reports 1
    assert math.isnan(RowStats().acceptance_rate) and math.isnan(RowStats().mean_accepted_length)
    no_steps = per_position_acceptance_rate([3, 1], 0)
    assert len(no_steps) == 2 and all(math.isnan(r) for r in no_steps)  # NaN, not 0
    assert acceptance_histogram([2, 0, 2], [1, 0, 2], k=4) == [0, 1, 1, 0, 0]  # vLLM's dense length k + 1
    assert acceptance_histogram_by_draft_length([0, 0], [0, 0]) == {}
    # Leviathan et al.: (1 - alpha^(k+1)) / (1 - alpha) = 1.75 for alpha = 0.5, k = 2
    assert expected_tokens_per_step([0.5, 0.5]) == pytest.approx(1.75)
    # d_i: only half the steps drafted a second token
    assert expected_tokens_per_step([0.5, 0.5], [1.0, 0.5]) == pytest.approx(1 + 0.5 + 0.125)
    assert expected_tokens_per_step([0.5, float("nan")]) == pytest.approx(1.5)  # unknown positions stop it


def test_histogram_length_follows_the_longest_draft_not_the_longest_acceptance():
    # k = 3 was drafted but no step accepted more than one: entries 2 and 3 are still there, as zeros
    assert acceptance_histogram([3, 2, 0], [1, 0, 0]) == [1, 1, 0, 0]
    r = RowStats()
    r.record(3, 1, 2)
    r.record(2, 0, 1)
    assert r.acceptance_histogram == [1, 1, 0, 0]


def test_predicted_speedups_against_hand_computed_values():
    # E = 2 tokens per step; a baseline step 0.1 s, the method's step (drafting + scoring) 0.125 s
    assert predicted_speedup(2.0, 0.1, 0.125) == pytest.approx(1.6)
    # 41 tokens: the prefill's (0.5 s) and 40 more at 2 per 0.125 s step: 3.0 s, 13.67 tok/s against 10
    assert predicted_speedup_with_prefill(2.0, 0.125, 0.5, 41, 1, 10.0) == pytest.approx(41 / 3.0 / 10.0)


def test_merged_rows_add_counts_and_concatenate_steps(row):
    other = RowStats()
    other.record(2, 2, 3)
    total = RowStats.merged([row, other])
    assert (total.steps, total.proposed, total.accepted, total.emitted) == (6, 17, 11, 15)
    assert total.accepted_at == [5, 4, 1, 1] and total.reached_at == [5, 4, 2, 1]
    assert total.draft_lengths == [4, 4, 0, 3, 4, 2]
    assert total.mean_acceptance_length == pytest.approx(1 + 11 / 5)


def _result(r: RowStats, method: str) -> PromptResult:
    """A prompt's result carrying these counts."""
    return PromptResult("p", "c", method, new_tokens=r.emitted + 1, wall_s=1.0, steps=r.steps, proposed=r.proposed,
                        accepted=r.accepted, emitted=r.emitted, bonus=r.bonus, recovered=r.recovered, draft_s=0.1,
                        verify_s=0.5, ttft_s=0.1, accepted_per_position=r.accepted_at, reached_per_position=r.reached_at,
                        proposed_per_position=r.proposed_at, draft_lengths=r.draft_lengths,
                        accepted_lengths=r.accepted_lengths)


def test_a_prompt_result_applies_the_same_definitions_and_reads_back(row):
    result = _result(row, "draft")
    for name in PromptResult.DERIVED[1:]:
        assert getattr(result, name) == getattr(row, name), name
    assert result.tokens_per_s == 13.0  # 13 tokens in 1 s
    line = json.loads(json.dumps(result.to_dict()))  # a line of results.jsonl
    assert line["acceptance_rate"] == row.acceptance_rate and line["accepted_per_position"] == [4, 3, 1, 1]
    assert PromptResult.from_dict(line) == result
    # a line an older version wrote, without the per-step lists: it reads, with what it lacks empty
    old = {k: v for k, v in line.items() if k not in ("draft_lengths", "accepted_lengths", "proposed_per_position")}
    assert PromptResult.from_dict(old).acceptance_rate == row.acceptance_rate


def test_the_summary_applies_the_same_definitions(row):
    base = RowStats()
    for _ in range(12):
        base.record(0, 0, 1)
    m = MethodSummary.measure([_result(row, "draft")], [_result(base, "autoregressive")], greedy=True)
    assert m.acceptance_rate == row.acceptance_rate
    assert m.mean_accepted_length == row.mean_accepted_length
    assert m.mean_acceptance_length == row.mean_acceptance_length
    assert m.per_position_acceptance == row.per_position_acceptance
    assert m.per_position_acceptance_rate == row.per_position_acceptance_rate
    assert m.acceptance_histogram == [0, 1, 2, 0, 1]
    assert m.acceptance_histogram_by_draft_length == {3: [0, 0, 1, 0], 4: [0, 1, 1, 0, 1]}
    assert m.num_spec_steps == 4
    # costs: the baseline's 12 steps in 0.5 s, the method's 5 in 0.1 + 0.5 s; prefill 0.1 s, 13 tokens
    e = m.expected_tokens_per_step
    assert m.predicted_speedup == pytest.approx(predicted_speedup(e, 0.5 / 12, 0.6 / 5))
    assert m.predicted_speedup_with_prefill == pytest.approx(
        predicted_speedup_with_prefill(e, 0.6 / 5, 0.1, 13, 1, 13 / 1.0))
    assert m.speedup == pytest.approx(13 / 13)
    assert m.c == pytest.approx((0.1 / 15) / (0.5 / 12))  # drafting seconds per drafted token, per baseline step
    # a block of summary.json: the histogram's draft lengths come back as numbers
    assert MethodSummary.from_dict(json.loads(json.dumps(m.to_dict()))).acceptance_histogram_by_draft_length == \
        {3: [0, 0, 1, 0], 4: [0, 1, 1, 0, 1]}


def test_c_is_not_given_where_steps_timed_their_drafting_with_their_verifying(row):
    """Pipelined steps captured whole run drafting and verifying in one CUDA graph, timed as verifying:
    their c would be the first step's drafting alone, so it is not given; the predicted speedup, from
    the two times' sum, is."""
    base = RowStats()
    for _ in range(12):
        base.record(0, 0, 1)
    result = _result(row, "draft")
    assert result.drafting_timed_apart
    result = dataclasses.replace(result, reports=[{"turn": 0, "pipeline": {"pipelined_steps": 5, "graphed_steps": 4}}])
    m = MethodSummary.measure([result], [_result(base, "autoregressive")], greedy=True)
    assert not result.drafting_timed_apart and math.isnan(m.c)
    assert m.predicted_speedup == pytest.approx(predicted_speedup(m.expected_tokens_per_step, 0.5 / 12, 0.6 / 5))
    result = dataclasses.replace(result, reports=[{"turn": 0, "pipeline": {"pipelined_steps": 5}}])  # not captured
    assert MethodSummary.measure([result], [_result(base, "autoregressive")], greedy=True).c > 0


def test_the_summary_weighs_each_position_by_the_steps_that_drafted_it(row):
    """E = 1 + sum_i d_i prod_{j<=i} a_j with d_i over every step, the one that drafted nothing included:
    d = proposed_at / 5 steps = (0.8, 0.8, 0.8, 0.6) and a = (1, 1, 0.5, 1)."""
    base = RowStats()
    for _ in range(12):
        base.record(0, 0, 1)
    m = MethodSummary.measure([_result(row, "draft")], [_result(base, "autoregressive")], greedy=True)
    assert m.expected_tokens_per_step == pytest.approx(1 + 0.8 * 1 + 0.8 * 1 + 0.8 * 0.5 + 0.6 * 0.5)  # 3.3
    # predicted = E * t_base / t_step: the baseline's 0.5 s over 12 steps, the method's 0.6 s over 5
    assert m.predicted_speedup == pytest.approx(3.3 * (0.5 / 12) / (0.6 / 5))


def test_decoder_does_not_count_drafts_past_max_new_tokens(engine_factory):
    # The target is its own draft, so the verifier accepts every draft (float32). With k = 4 and
    # max_new_tokens = 7: the prefill gives 1 token, step 1 emits 4 drafts + bonus, step 2 has room for
    # one token, so it drafts nothing (a draft there could never be emitted) and emits the target's.
    engine = engine_factory("self")
    dec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=4, eos_token_id=[])
    out = dec.generate([[5, 6, 7]], max_new_tokens=7)
    r = out.stats.rows[0]
    assert len(out.output_ids[0]) == 7
    assert (r.proposed, r.accepted, r.emitted) == (4, 4, 6)
    assert r.draft_lengths == [4, 0] and r.accepted_lengths == [4, 0]
    assert r.acceptance_histogram == [0, 0, 0, 0, 1]  # the step that drafted nothing is left out
    assert r.reached_at == [1, 1, 1, 1] and r.acceptance_rate == 1.0
    assert out.stats.mean_acceptance_length == pytest.approx(1 + 4 / 1)


def test_generation_stats_sum_the_rows(engine_factory):
    engine: Engine = engine_factory("self")
    dec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=2, eos_token_id=[])
    out = dec.generate([[5, 6, 7], [3, 4]], max_new_tokens=6)
    rows = out.stats.rows
    assert out.stats.acceptance_rate == pytest.approx(sum(r.accepted for r in rows) / sum(r.proposed for r in rows))
    assert out.stats.total.draft_lengths == rows[0].draft_lengths + rows[1].draft_lengths


def test_expected_tokens_curve_by_hand():
    from specdec.core.metrics import expected_tokens_curve, expected_tokens_per_step

    # E(0) = 1; E(1) = 1 + 0.5; E(2) = 1.5 + 0.5 * 0.5 * 0.5 (position 2 offered half the time)
    assert expected_tokens_curve([0.5, 0.5], [1.0, 0.5]) == [1.0, 1.5, 1.625]
    assert expected_tokens_per_step([0.5, 0.5], [1.0, 0.5]) == 1.625
    assert expected_tokens_curve([0.8, float("nan"), 0.9]) == [1.0, 1.8]  # stops at the first unknown a_i
