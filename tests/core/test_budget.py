"""The decoder owns its cache budget: `positions_needed` is what a request takes (a request at exactly
the context runs, one token more is refused before any model work), `reserve` sizes a conversation's
caches so that the next turn continues them, and the experiment asks the decoders instead of counting
itself (prompts dropped, k or max_new_tokens blamed)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from specdec.core.decoding import SpeculativeDecoder
from specdec.proposers.draft_model import DraftModelProposer
from specdec.study import experiment
from specdec.study.anchors import HFAssisted
from specdec.study.config import ConfigError
from specdec.study.data import Prompt

CONTEXT = 512  # the tiny models' max_position_embeddings


def _decoder(engine, k: int) -> SpeculativeDecoder:
    return SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=k)


def test_a_request_at_exactly_the_context_runs_and_one_token_more_is_refused(engine_factory):
    dec = _decoder(engine_factory("self"), 3)
    room = dec.positions_needed(0, 0)  # what a scoring pass writes past the answer: k drafts at least
    assert room >= 3 and dec.positions_needed(20, 10) == 20 + 10 + room
    assert dec.context_length == CONTEXT and dec.fits(CONTEXT) and not dec.fits(CONTEXT + 1)
    new = 6
    longest = CONTEXT - new - room  # positions_needed(longest, new) == CONTEXT
    out = dec.generate([[5] * longest, [7] * 9], max_new_tokens=new)
    assert out.state.max_len == CONTEXT  # the cache the request got is the one it was said to need
    assert [len(o) for o in out.output_ids] == [new, new]  # and it was enough: no row stopped early
    with pytest.raises(ValueError, match=f"= {CONTEXT + 1} exceeds the target's context of {CONTEXT} tokens"):
        dec.generate([[5] * (longest + 1)], max_new_tokens=new)


@pytest.mark.parametrize("k", [3, 10])
def test_the_refusal_adds_up(engine_factory, k):
    """The message's terms sum to its total: k, or exact greedy's scoring room where that is wider."""
    import re

    dec = _decoder(engine_factory("self"), k)
    with pytest.raises(ValueError) as err:
        dec.generate([[5] * (CONTEXT - 4)], max_new_tokens=5)
    terms = re.match(r"prompt \((\d+) tokens\) \+ max_new_tokens \((\d+)\) \+ (?:k \((\d+)\)|(\d+) positions of "
                     r"scoring room \(exact greedy scores \d+ positions a pass\)) = (\d+) exceeds", str(err.value))
    assert terms, str(err.value)
    prompt, new, k_term, room, total = terms.groups()
    assert (k_term is not None) == (k + 1 >= dec.score_width)  # k is named only where it is the room
    assert int(prompt) + int(new) + int(k_term or room) == int(total) == dec.positions_needed(CONTEXT - 4, 5)


def test_reserve_makes_room_for_the_next_turn_to_continue_the_cache(engine_factory):
    dec = _decoder(engine_factory("self"), 2)
    first = [[5, 6, 7, 8]]
    whole = dec.positions_needed(len(first[0]) + 8 + 3, 8)  # turn 1, its answer, turn 2's 3 tokens, then its answer
    for reserve, reused in ((0, False), (whole, True)):
        one = dec.generate(first, max_new_tokens=8, reserve=reserve)
        assert one.state.max_len == (whole if reserve else dec.positions_needed(4, 8))
        two = dec.generate([first[0] + one.output_ids[0] + [9, 10, 11]], max_new_tokens=8, past=one)
        assert (two.state.reuse is not None and two.state.reuse[0] > 0) is reused
    with pytest.raises(TypeError, match="reserve must be an integer"):
        dec.generate(first, max_new_tokens=4, reserve=1.5)


def test_an_anchor_answers_the_same_questions(engine_factory):
    anchor = HFAssisted(engine_factory("self"), num_speculative_tokens=5)
    assert anchor.positions_needed(20, 10) == 20 + 10 + 5  # the k candidates an assisted step holds
    assert anchor.context_length == CONTEXT and anchor.fits(CONTEXT) and not anchor.fits(CONTEXT + 1)


class Budget:
    """A decoder that needs `factor` positions per token and has a context of `context`: whatever the
    experiment keeps or refuses must follow from these answers, not from arithmetic of its own."""

    def __init__(self, factor: int, context: int, k: int = 0):
        self.factor, self.context_length, self.k = factor, context, k

    def positions_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        return self.factor * (prompt_len + max_new_tokens) + self.k

    def fits(self, positions: int) -> bool:
        return positions <= self.context_length


class Tokens:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * len(text.split())


def _cfg(max_new_tokens: int):
    return OmegaConf.create({"generation": {"max_new_tokens": max_new_tokens}, "data": {"system_prompt": None},
                             "method": {"name": "wide", "num_speculative_tokens": 7, "proposer": None}, "compare": {}})


def test_the_experiment_keeps_what_every_decoder_says_fits():
    prompts = [Prompt(str(n), "qa", (" ".join(["w"] * n),)) for n in (2, 6, 10)]  # "User: ...\nAssistant:" + n
    base = Budget(1, 100)
    setup = experiment.Setup(None, Tokens(), {"wide": Budget(5, 100)}, base)
    lengths = {p.prompt_id: len(Tokens().encode(f"User: {p.turns[0]}\nAssistant:")) for p in prompts}
    kept, dropped = experiment.drop_too_long(prompts, setup, _cfg(10))
    assert [p.prompt_id for p in kept] == [i for i, n in lengths.items() if 5 * (n + 10) <= 100]
    assert dropped == [i for i, n in lengths.items() if 5 * (n + 10) > 100] == ["10"]


def test_the_experiment_blames_k_or_max_new_tokens_as_the_decoder_answers():
    setup = experiment.Setup(None, Tokens(), {"wide": Budget(1, 100, k=100)}, Budget(1, 100))
    with pytest.raises(ConfigError, match=r"^method.num_speculative_tokens: .*up to 100 drafted tokens .*context of 100 tokens"):
        experiment.drop_too_long([Prompt("1", "qa", ("hi",))], setup, _cfg(10))
    setup.methods["wide"].k = 0
    with pytest.raises(ConfigError, match=r"^generation.max_new_tokens: max_new_tokens=200 .*lower generation"):
        experiment.drop_too_long([Prompt("1", "qa", ("hi",))], setup, _cfg(200))
