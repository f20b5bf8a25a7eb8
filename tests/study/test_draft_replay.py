"""experiments/peers/draft_replay.py: replaying a suffix drafter over plain decoding's greedy text
takes the steps that the engine takes decoding the same prompt with that drafter."""

import pytest

from specdec.core.decoding import SpeculativeDecoder
from specdec.proposers.suffix import SuffixProposer, SuffixTreeProposer
from tests.conftest import load_script


@pytest.mark.parametrize("kind", [SuffixProposer, SuffixTreeProposer])
def test_the_replay_takes_the_engines_steps(engine_factory, kind):
    replay = load_script("draft_replay", "experiments/peers")
    engine = engine_factory()
    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 11, 5, 6, 7]  # repeats: suffix matches to draft from
    text = SpeculativeDecoder(engine).generate([prompt], max_new_tokens=40).output_ids[0]
    make = lambda: kind(max_spec_factor=2.0, min_token_prob=0.05, max_cached_requests=0)  # noqa: E731
    out = SpeculativeDecoder(engine, make(), num_speculative_tokens=6).generate([prompt], max_new_tokens=40)
    row = out.stats.rows[0]
    steps, widths = replay.replay(make(), prompt, text, k=6)
    assert out.output_ids[0] == text
    assert row.accepted > 0  # the drafter was right at times: the count is not only one per step
    assert steps == row.steps
    if kind is SuffixProposer:  # a chain's width is its draft plus the root
        assert [w - 1 for w in widths] == row.draft_lengths
