"""The anchors (`transformers` generate, assisted generation, prompt lookup) run through the same
interface as specdec's decoders and return the same result schema; greedy, they reproduce the
target's greedy output. No timing is asserted."""

import math

import pytest

from specdec.anchors import HFAssisted, HFGenerate, HFPromptLookup
from specdec.decoding import SpeculativeDecoder
from tests.conftest import RAGGED_PROMPTS


@pytest.mark.parametrize("anchor", [HFGenerate, HFAssisted, HFPromptLookup])
def test_anchor_greedy_matches_specdec_greedy_and_reports_stats(engine_factory, unrelated_draft, anchor):
    engine = engine_factory(unrelated_draft)
    ref = SpeculativeDecoder(engine, eos_token_id=[]).generate(RAGGED_PROMPTS, max_new_tokens=12)
    out = anchor(engine, num_speculative_tokens=3, eos_token_id=[]).generate(RAGGED_PROMPTS, max_new_tokens=12)
    assert out.output_ids == ref.output_ids
    assert out.lossless and out.verifier == "greedy"
    assert [r.new_tokens for r in out.stats.rows] == [12, 12, 12]
    assert all(r.steps >= 1 for r in out.stats.rows) and out.stats.wall_s > 0 and out.stats.ttft_s > 0
    assert out.stats.mean_accepted_length >= 1.0
    assert math.isnan(out.stats.acceptance_rate)  # generate() does not expose it: unknown, not guessed


def test_plain_generate_takes_one_target_pass_per_token(engine_factory):
    out = HFGenerate(engine_factory(), eos_token_id=[]).generate(RAGGED_PROMPTS[:1], max_new_tokens=10)
    assert out.stats.rows[0].steps == 9 and out.stats.mean_accepted_length == 1.0


def test_assisted_needs_a_draft(engine_factory):
    with pytest.raises(ValueError, match="draft"):
        HFAssisted(engine_factory(None))


def test_prompt_tokens_equal_to_the_pad_id_are_not_taken_for_padding(engine_factory):
    # generate() infers a padding mask from the pad id when no mask is given; the anchors must not
    # let it hide real prompt tokens (chat templates' end-of-turn token is often the pad token).
    engine = engine_factory()
    prompt = [[5, 0, 7, 8, 0, 9]]  # 0 is the pad id the anchor passes when EOS is disabled
    ref = SpeculativeDecoder(engine, eos_token_id=[]).generate(prompt, max_new_tokens=8)
    assert HFGenerate(engine, eos_token_id=[]).generate(prompt, max_new_tokens=8).output_ids == ref.output_ids
