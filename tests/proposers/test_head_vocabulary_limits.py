"""A Medusa tree rank or an EAGLE topk the heads' vocabulary cannot give is refused when the proposer
is made, naming the setting and the vocabulary (it failed at the first step with `selected index k
out of range`); the largest that fit decode."""

from pathlib import Path

import pytest

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.errors import InvalidInput
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.medusa import MedusaProposer
from tests.conftest import make_engine

ASSETS = Path(__file__).resolve().parents[1] / "assets"
MEDUSA, EAGLE = str(ASSETS / "tiny_random_medusa.safetensors"), str(ASSETS / "tiny_random_eagle.safetensors")
HEADS_VOCAB = 128  # both checkpoints keep the 128 most frequent of the tiny target's 256 tokens


@pytest.fixture(scope="module")
def engine(tiny_target):
    return make_engine(tiny_target)


def _decodes(engine, proposer) -> None:
    out = SpeculativeDecoder(engine, proposer, num_speculative_tokens=2).generate([[5, 6, 7]], max_new_tokens=4)
    assert len(out.output_ids[0]) == 4


def test_a_medusa_rank_beyond_the_heads_vocabulary_is_refused(engine):
    with pytest.raises(InvalidInput, match=rf"method.tree: rank {HEADS_VOCAB} asks each head for more guesses than "
                                           rf"the {HEADS_VOCAB} tokens .*reduced the vocabulary.*below {HEADS_VOCAB}"):
        MedusaProposer(engine, MEDUSA, tree=[[0], [HEADS_VOCAB]])
    _decodes(engine, MedusaProposer(engine, MEDUSA, tree=[[0], [HEADS_VOCAB - 1]]))


def test_an_eagle_topk_beyond_the_heads_vocabulary_is_refused(engine):
    with pytest.raises(InvalidInput, match=rf"method.proposer.topk={HEADS_VOCAB + 1}: the drafter proposes from "
                                           rf"{HEADS_VOCAB} tokens .*at most {HEADS_VOCAB}"):
        EagleProposer(engine, EAGLE, budget=4, topk=HEADS_VOCAB + 1, width=2, depth=2)
    _decodes(engine, EagleProposer(engine, EAGLE, budget=4, topk=HEADS_VOCAB, width=2, depth=2))
