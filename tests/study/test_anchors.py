"""The anchors (`transformers` generate, assisted generation, prompt lookup) run through the same
interface as specdec's decoders and return the same result schema; greedy, they reproduce the
target's greedy output. No timing is asserted."""

import math

import pytest

from specdec.core.decoding import SpeculativeDecoder
from specdec.study.anchors import HFAssisted, HFGenerate, HFPromptLookup
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


def test_prompt_lookup_counts_its_steps_when_the_draft_is_the_target(engine_factory):
    # prompt lookup never runs a draft model, so draft=self must not hide its target passes
    prompt = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
    alone = HFPromptLookup(engine_factory(None), num_speculative_tokens=3, eos_token_id=[])
    with_self = HFPromptLookup(engine_factory("self"), num_speculative_tokens=3, eos_token_id=[])
    a, b = (d.generate(prompt, max_new_tokens=16) for d in (alone, with_self))
    assert b.stats.rows[0].steps == a.stats.rows[0].steps >= 1
    assert b.stats.mean_accepted_length == a.stats.mean_accepted_length > 1.0  # the prompt repeats: lookups hit


def _second_turns(first):
    """Turn 2 of each row: turn 1's input, a cut of its answer (the chat template re-renders it), a new message."""
    return [p + o[:7] + [11, 12, 13] for p, o in zip(first.prompt_ids, first.output_ids)]


def test_hf_generate_continues_a_conversation_from_its_cache(engine_factory):
    anchor = HFGenerate(engine_factory(), eos_token_id=[])
    first = anchor.generate(RAGGED_PROMPTS, max_new_tokens=10)
    turn2 = _second_turns(first)
    continued = anchor.generate(turn2, max_new_tokens=10, past=first)
    fresh = anchor.generate(turn2, max_new_tokens=10)
    assert continued.output_ids == fresh.output_ids
    # the shared prefix is turn 1's input and 7 answer tokens: the cache (input + 9 answers) is cropped to it
    assert continued.state.reuse == [len(p) + 7 for p in RAGGED_PROMPTS] and fresh.state.reuse is None
    assert [r.steps for r in continued.stats.rows] == [9, 9, 9]  # the prefill is one pass, as before


def test_a_past_is_continued_once_and_only_by_its_own_anchor(engine_factory):
    engine = engine_factory()
    anchor = HFGenerate(engine, eos_token_id=[])
    first = anchor.generate(RAGGED_PROMPTS, max_new_tokens=6)
    turn2 = _second_turns(first)
    anchor.generate(turn2, max_new_tokens=6, past=first)  # extends first's caches in place
    again = anchor.generate(turn2, max_new_tokens=6, past=first)
    other = HFGenerate(engine, eos_token_id=[]).generate(turn2, max_new_tokens=6, past=first)
    ours = SpeculativeDecoder(engine, eos_token_id=[]).generate(RAGGED_PROMPTS, max_new_tokens=6)
    foreign = anchor.generate(turn2, max_new_tokens=6, past=ours)
    fresh = anchor.generate(turn2, max_new_tokens=6)
    for out in (again, other, foreign):
        assert out.state.reuse is None and out.output_ids == fresh.output_ids


@pytest.mark.parametrize("anchor", [HFAssisted, HFPromptLookup])
def test_assisted_anchors_prefill_every_turn(engine_factory, unrelated_draft, anchor):
    decoder = anchor(engine_factory(unrelated_draft), num_speculative_tokens=3, eos_token_id=[])
    assert decoder.continues_cache is False
    first = decoder.generate(RAGGED_PROMPTS, max_new_tokens=8)
    turn2 = _second_turns(first)
    out = decoder.generate(turn2, max_new_tokens=8, past=first)
    assert out.state.reuse is None
    assert out.output_ids == decoder.generate(turn2, max_new_tokens=8).output_ids


def test_transformers_assisted_decoding_cannot_start_from_a_filled_cache(target):
    # Why HFAssisted and HFPromptLookup set continues_cache = False: given a cache that holds a prefix
    # of the input, transformers' assisted decoding still feeds the whole input on its first pass,
    # and the tokens come out wrong. If this starts to pass, continuing a cache has become possible.
    import torch
    from transformers import DynamicCache

    from specdec.study.anchors import CACHE_KWARG

    x = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7]])
    kw = {"attention_mask": torch.ones_like(x), "max_new_tokens": 10, "do_sample": False, "pad_token_id": 0,
          "prompt_lookup_num_tokens": 3}
    with torch.inference_mode():
        fresh = target.generate(x, **kw)
        cache = DynamicCache(config=target.config)
        target(x[:, :5], **{CACHE_KWARG: cache}, use_cache=True)
        continued = target.generate(x, **kw, **{CACHE_KWARG: cache})
    assert continued[0, 8:].tolist() != fresh[0, 8:].tolist()
