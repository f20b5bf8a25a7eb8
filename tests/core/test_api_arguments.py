"""The Python API says what is wrong with an argument: `generate(max_new_tokens=None)`, `seed=None`,
`temperature="0.5"` fail naming the argument and what it must be, before any model work."""

from __future__ import annotations

import pytest

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.sampling import SamplingParams
from tests.conftest import make_engine


@pytest.fixture(scope="module")
def decoder():
    from specdec.models import tiny_random_model

    return SpeculativeDecoder(make_engine(tiny_random_model(seed=0)))


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": None}, r"max_new_tokens must be an integer, got None \(NoneType\)"),
    ({"max_new_tokens": 2.5}, r"max_new_tokens must be an integer, got 2\.5 \(float\)"),
    ({"max_new_tokens": 0}, r"max_new_tokens must be >= 1, got 0"),
    ({"seed": None}, r"seed must be an integer, got None \(NoneType\)"),
    ({"seed": "0"}, r"seed must be an integer, got '0' \(str\)"),
    ({"temperature": "0.5"}, r"generation.temperature must be a number, got '0.5' \(str\)"),
    ({"temperature": None}, r"generation.temperature must be a number, got None"),
    ({"temperature": float("nan")}, r"generation.temperature must be finite and >= 0 \(0 is greedy\), got nan"),
    ({"temperature": float("inf")}, r"generation.temperature must be finite and >= 0 \(0 is greedy\), got inf"),
    ({"temperature": -0.5}, r"generation.temperature must be finite and >= 0 \(0 is greedy\), got -0.5"),
    ({"top_k": None}, r"generation.top_k must be an integer, got None"),
    ({"top_k": True}, r"generation.top_k must be an integer, got True \(bool\)"),
    ({"top_p": "1"}, r"generation.top_p must be a number, got '1' \(str\)"),
    ({"reserve": -5}, r"reserve must be >= 0"),
    ({"on_tokens": 5}, r"on_tokens must be a callable"),
])
def test_bad_generate_arguments_are_named(decoder, kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        decoder.generate([[5, 6, 7]], **{"max_new_tokens": 4, **kwargs})


def test_no_prompts_at_all_is_named(decoder):
    with pytest.raises(TypeError, match="generate\\(\\) takes a list of prompts"):
        decoder.generate(None, max_new_tokens=4)


def test_good_arguments_of_other_numeric_types_still_work(decoder):
    import numpy as np

    out = decoder.generate([[5, 6, 7]], max_new_tokens=np.int64(3), seed=np.int64(1), temperature=1)
    assert len(out.output_ids[0]) == 3
    assert SamplingParams(temperature=np.float32(0.5), top_k=np.int32(2)).temperature == 0.5


@pytest.mark.parametrize("kwargs, message", [
    ({"num_speculative_tokens": 2.5}, r"num_speculative_tokens must be an integer, got 2\.5 \(float\)"),
    ({"num_speculative_tokens": "4"}, r"num_speculative_tokens must be an integer, got '4' \(str\)"),
    ({"max_len": None}, r"max_len must be an integer, got None"),
])
def test_bad_decoder_arguments_are_named(decoder, kwargs, message):
    from specdec.proposers.ngram import NgramProposer

    with pytest.raises(TypeError, match=message):
        SpeculativeDecoder(decoder.engine, NgramProposer(decoder.engine), **kwargs)


def test_an_unknown_device_is_named():
    from specdec.core.engine import Engine
    from specdec.models import tiny_random_model

    with pytest.raises(ValueError, match=r"^device='tpu' is not a device torch knows; use auto, cpu, cuda or cuda:N$"):
        Engine(tiny_random_model(seed=0), device="tpu")


def test_a_proposer_built_for_another_engine_is_refused():
    """A draft model's proposer drafts from its engine's draft and cache: with another engine's
    decoder it would propose from that engine's state (and crash mid-generation where the vocabularies
    differ). A proposer that needs no engine goes with any, and a name is not a proposer."""
    from specdec.adaptive.hybrid import HybridProposer
    from specdec.core.engine import Engine
    from specdec.models import tiny_random_model
    from specdec.proposers.draft_model import DraftModelProposer
    from specdec.proposers.ngram import NgramProposer

    target = tiny_random_model(seed=0)
    mine, other = (Engine(target, tiny_random_model(seed=1), dtype="float32") for _ in range(2))
    with pytest.raises(ValueError, match="DraftModelProposer was built for another Engine"):
        SpeculativeDecoder(mine, DraftModelProposer(other))
    with pytest.raises(ValueError, match=r"DraftModelProposer \(a part of HybridProposer\) was built for another"):
        SpeculativeDecoder(mine, HybridProposer(other, parts={"draft": DraftModelProposer}))
    with pytest.raises(TypeError, match="proposer must be a proposer object"):
        SpeculativeDecoder(mine, "ngram")
    out = SpeculativeDecoder(mine, NgramProposer(other)).generate([[5, 6, 5, 6, 5]], max_new_tokens=4)
    assert out.output_ids == SpeculativeDecoder(mine).generate([[5, 6, 5, 6, 5]], max_new_tokens=4).output_ids
    assert SpeculativeDecoder(mine, DraftModelProposer(mine)).generate([[5, 6]], max_new_tokens=3).output_ids
