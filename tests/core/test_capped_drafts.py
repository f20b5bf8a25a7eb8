"""Drafts are capped at what a row can still emit less one, so no step drafts past `max_new_tokens`.

A drafter that is always right (the target drafting for itself, float32) then reports acceptance
1.0 for any answer length; before the cap its last step drafted k tokens where fewer could be
emitted, and those counted as rejected.
"""

import pytest

from specdec.core.decoding import SpeculativeDecoder
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramProposer

PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16, 17, 18]]


@pytest.mark.parametrize("new_tokens", [1, 2, 5, 9, 13])
@pytest.mark.parametrize("k", [1, 4])
def test_a_perfect_drafter_reports_acceptance_one(engine_factory, new_tokens, k):
    engine = engine_factory("self")
    out = SpeculativeDecoder(engine, DraftModelProposer(engine), k, eos_token_id=[]).generate(
        PROMPTS, max_new_tokens=new_tokens)
    total = out.stats.total
    assert [len(o) for o in out.output_ids] == [new_tokens] * len(PROMPTS)
    if new_tokens > 2:  # with one token left after the prefill's, a step drafts nothing
        assert total.proposed > 0 and total.accepted == total.proposed  # acceptance 1.0
    for row in out.stats.rows:  # every step of a row drafted at most what it could still emit less one
        room = new_tokens - 1  # after the prefill's token
        for drafted, accepted in zip(row.draft_lengths, row.accepted_lengths):
            assert drafted <= room - 1
            room -= accepted + 1


def test_rows_with_less_room_draft_less_in_the_same_step(engine_factory):
    """Ragged rooms: the step's k is the roomiest row's, each row is cut to its own."""
    engine = engine_factory("self")
    decoder = SpeculativeDecoder(engine, DraftModelProposer(engine), 4, eos_token_id=[])
    first = decoder.generate(PROMPTS[:1], max_new_tokens=3)  # one row: 2 left after the prefill -> 1 draft
    assert first.stats.rows[0].draft_lengths == [1]
    assert first.stats.total.accepted == 1


def test_lookups_are_capped_too(engine_factory):
    engine = engine_factory()
    repeating = [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]]
    out = SpeculativeDecoder(engine, NgramProposer(engine), 6, eos_token_id=[]).generate(repeating, max_new_tokens=4)
    for row in out.stats.rows:
        room = 3
        for drafted, accepted in zip(row.draft_lengths, row.accepted_lengths):
            assert drafted <= room - 1
            room -= accepted + 1
