"""The Python API says what is wrong with an argument: `generate(max_new_tokens=None)`, `seed=None`,
`temperature="0.5"` fail naming the argument and what it must be, before any model work."""

from __future__ import annotations

import pytest

from specdec.decoding import SpeculativeDecoder
from specdec.sampling import SamplingParams


@pytest.fixture(scope="module")
def decoder():
    from specdec.engine import Engine
    from specdec.models import tiny_random_model

    return SpeculativeDecoder(Engine(tiny_random_model(seed=0), dtype="float32"))


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": None}, r"max_new_tokens must be an integer, got None \(NoneType\)"),
    ({"max_new_tokens": 2.5}, r"max_new_tokens must be an integer, got 2\.5 \(float\)"),
    ({"max_new_tokens": 0}, r"max_new_tokens must be >= 1, got 0"),
    ({"seed": None}, r"seed must be an integer, got None \(NoneType\)"),
    ({"seed": "0"}, r"seed must be an integer, got '0' \(str\)"),
    ({"temperature": "0.5"}, r"generation.temperature must be a number, got '0.5' \(str\)"),
    ({"temperature": None}, r"generation.temperature must be a number, got None"),
    ({"top_k": None}, r"generation.top_k must be an integer, got None"),
    ({"top_k": True}, r"generation.top_k must be an integer, got True \(bool\)"),
    ({"top_p": "1"}, r"generation.top_p must be a number, got '1' \(str\)"),
])
def test_bad_generate_arguments_are_named(decoder, kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        decoder.generate([[5, 6, 7]], **{"max_new_tokens": 4, **kwargs})


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
    from specdec.engine import Engine
    from specdec.models import tiny_random_model

    with pytest.raises(ValueError, match=r"^device='tpu' is not a device torch knows; use auto, cpu, cuda or cuda:N$"):
        Engine(tiny_random_model(seed=0), device="tpu")
