"""State that outlives one generate() call: a `past` is reused only when the caches are exactly as
it left them, one engine decodes one batch at a time, token ids are checked before any model work,
and an Engine's device and dtype stay true while it lives."""

import gc
import threading

import numpy as np
import pytest
import torch

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.models import tiny_random_model
from specdec.proposers.draft_model import DraftModelProposer

A = [5, 6, 7, 8, 9, 10, 11, 12]
OTHER = [40, 41, 42, 43, 44, 45, 46, 47]


def _turn2(first, prompt=A):
    return prompt + first.output_ids[0] + [20, 21]


# ---------------------------------------------------------------- past= (stale and foreign caches)


def test_past_after_another_generation_on_the_engine_is_prefilled_again(engine_factory):
    dec = SpeculativeDecoder(engine_factory(), max_len=128)
    first = dec.generate([A], max_new_tokens=10)
    dec.generate([OTHER], max_new_tokens=10)  # overwrites the caches `first` left
    reused = dec.generate([_turn2(first)], max_new_tokens=10, past=first)
    fresh = dec.generate([_turn2(first)], max_new_tokens=10)
    assert reused.state.reuse is None  # nothing reused, reported as such
    assert reused.output_ids == fresh.output_ids


def test_an_older_past_of_the_same_decoder_is_prefilled_again(engine_factory):
    engine = engine_factory("self")
    dec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=3, max_len=128)
    n = 1 + 2 * 4  # the prefill token and two full steps: no step is cut short
    first = dec.generate([A], max_new_tokens=n)
    second = dec.generate([_turn2(first)], max_new_tokens=n, past=first)
    assert second.state.reuse == [len(_turn2(first)) - 2]  # the valid case still reuses
    again = dec.generate([_turn2(first)], max_new_tokens=n, past=first)  # `second` moved the caches on
    assert again.state.reuse is None
    assert again.output_ids == second.output_ids
    assert again.stats.acceptance_rate == 1.0


def test_a_past_from_another_engine_is_prefilled_again(target):
    one, two = Engine(target, dtype="float32"), Engine(target, dtype="float32")
    dec_one, dec_two = SpeculativeDecoder(one, max_len=128), SpeculativeDecoder(two, max_len=128)
    dec_two.generate([OTHER], max_new_tokens=10)
    first = dec_one.generate([A], max_new_tokens=10)
    reused = dec_two.generate([_turn2(first)], max_new_tokens=10, past=first)
    assert reused.state.reuse is None
    assert reused.output_ids == dec_two.generate([_turn2(first)], max_new_tokens=10).output_ids


def test_a_stale_draft_cache_is_rebuilt_even_when_the_target_cache_is_current(engine_factory):
    """The target's cache continued a conversation (plain decoding) while the draft's still holds
    another one: reusing the draft's prefix would draft from the wrong context."""
    engine = engine_factory("self")
    spec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=3, max_len=128)
    plain = SpeculativeDecoder(engine, max_len=128)
    spec.generate([A], max_new_tokens=10)  # the draft's cache now holds conversation A
    b1 = plain.generate([OTHER], max_new_tokens=10)
    b2 = plain.generate([_turn2(b1, OTHER)], max_new_tokens=10, past=b1)
    turn3 = _turn2(b1, OTHER) + b2.output_ids[0] + [30]
    out = spec.generate([turn3], max_new_tokens=13, past=b2)  # 1 + 3 full steps of k + 1
    assert out.state.reuse == [len(turn3) - 1]  # the target's cache is reused
    assert out.stats.acceptance_rate == 1.0  # the draft drafted from conversation B, not A
    assert out.output_ids == plain.generate([turn3], max_new_tokens=13).output_ids


def test_past_must_be_a_generation(engine_factory):
    dec = SpeculativeDecoder(engine_factory(), max_len=128)
    with pytest.raises(TypeError, match="past"):
        dec.generate([A], max_new_tokens=4, past=[A])


# ---------------------------------------------------------------- one generation at a time


def _hold_first_call(dec_a, dec_b):
    """Start dec_a.generate in a thread and hold it inside its first on_tokens callback; call
    dec_b.generate meanwhile. Returns (dec_b's exception, dec_a's Generation)."""
    inside, release, result = threading.Event(), threading.Event(), {}

    def hold(row, tokens):
        inside.set()
        release.wait(30)

    thread = threading.Thread(target=lambda: result.setdefault("out", dec_a.generate([A], max_new_tokens=8,
                                                                                    on_tokens=hold)))
    thread.start()
    assert inside.wait(30)
    try:
        with pytest.raises(RuntimeError, match="already decoding") as refused:
            dec_b.generate([OTHER], max_new_tokens=8)
    finally:
        release.set()
        thread.join(30)
    return refused.value, result["out"]


def test_a_second_concurrent_call_on_one_decoder_is_refused(engine_factory):
    dec = SpeculativeDecoder(engine_factory())
    reference = dec.generate([A], max_new_tokens=8).output_ids
    _, out = _hold_first_call(dec, dec)
    assert out.output_ids == reference  # the first call was not disturbed
    assert dec.generate([A], max_new_tokens=8).output_ids == reference  # and the engine is free again


def test_a_second_decoder_on_a_busy_engine_is_refused(engine_factory):
    engine = engine_factory("self")
    spec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=3)
    plain = SpeculativeDecoder(engine)
    reference = plain.generate([A], max_new_tokens=8).output_ids
    _, out = _hold_first_call(spec, plain)
    assert out.output_ids == reference


def test_generate_from_inside_its_own_callback_is_refused(engine_factory):
    dec = SpeculativeDecoder(engine_factory())
    errors = []

    def reenter(row, tokens):
        if not errors:
            with pytest.raises(RuntimeError, match="already decoding") as e:
                dec.generate([OTHER], max_new_tokens=2)
            errors.append(e.value)

    dec.generate([A], max_new_tokens=4, on_tokens=reenter)
    assert errors


def test_threads_sharing_a_decoder_get_right_answers_or_a_clear_refusal(engine_factory):
    engine = engine_factory("self")
    dec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=3)
    prompts = [A, OTHER, [3, 4, 5], [60, 61, 62, 63, 64]]
    reference = [dec.generate([p], max_new_tokens=12).output_ids[0] for p in prompts]
    results, start = [], threading.Barrier(len(prompts))

    def work(i):
        start.wait(30)
        for _ in range(4):
            try:
                results.append((i, dec.generate([prompts[i]], max_new_tokens=12).output_ids[0]))
            except RuntimeError as e:
                results.append((i, e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 4 * len(prompts)
    for i, got in results:
        if isinstance(got, RuntimeError):
            assert "already decoding" in str(got)
        else:
            assert got == reference[i]
    assert any(not isinstance(got, RuntimeError) for _, got in results)


def test_threads_with_their_own_engines_may_share_the_model(target):
    prompts = [A, OTHER, [3, 4, 5]]
    decoders = [SpeculativeDecoder(Engine(target, dtype="float32")) for _ in prompts]
    reference = [decoders[0].generate([p], max_new_tokens=12).output_ids[0] for p in prompts]
    results = {}

    def work(i):
        results[i] = [decoders[i].generate([prompts[i]], max_new_tokens=12).output_ids[0] for _ in range(3)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {i: [reference[i]] * 3 for i in range(len(prompts))}


# ---------------------------------------------------------------- token ids


@pytest.mark.parametrize(
    "prompts, error, message",
    [
        ([[5.0, 6.7]], TypeError, r"prompt 0, token 0: 5.0 .*float"),
        ([[5, 6], [7, True]], TypeError, r"prompt 1, token 1: True .*bool"),
        ([[5, "6"]], TypeError, r"prompt 0, token 1: '6'"),
        ([[5, None]], TypeError, r"prompt 0, token 1: None"),
        ([[10**9]], ValueError, r"prompt 0, token 0: 1000000000 .*\[0, 256\)"),
        ([[3], [4, -1]], ValueError, r"prompt 1, token 1: -1 .*\[0, 256\)"),
        ([[3, 256]], ValueError, r"prompt 0, token 1: 256 .*\[0, 256\)"),
        ([torch.tensor([5.0, 6.0])], TypeError, r"prompt 0 .*float32"),
        ([torch.tensor([True, False])], TypeError, r"prompt 0 .*bool"),
        ([np.array([5.5, 6.0])], TypeError, r"prompt 0 .*float64"),
        ([torch.tensor([3, 300])], ValueError, r"prompt 0, token 1: 300 "),
        ([np.array([1, 2]), 7], TypeError, r"prompt 1"),
        (torch.tensor([5, 6]), TypeError, "list of prompts"),
    ],
)
def test_bad_token_ids_are_refused_before_model_work(engine_factory, prompts, error, message):
    engine = engine_factory("self")
    dec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=2)
    with pytest.raises(error, match=message):
        dec.generate(prompts, max_new_tokens=4)
    assert engine.target.cache is None and engine.draft.cache is None


def test_integer_token_ids_of_every_kind_are_accepted(engine_factory):
    dec = SpeculativeDecoder(engine_factory())
    want = dec.generate([A], max_new_tokens=4).output_ids
    for prompt in (np.array(A, dtype=np.int32), torch.tensor(A), [np.int64(t) for t in A],
                   [torch.tensor(t) for t in A], tuple(A)):
        assert dec.generate([prompt], max_new_tokens=4).output_ids == want


# ---------------------------------------------------------------- one device and dtype per model


def test_a_second_engine_may_not_convert_a_model_the_first_still_uses():
    model = tiny_random_model(seed=5, eos_token_id=None)
    first = Engine(model, dtype="float32")
    with pytest.raises(ValueError, match="float32.*bfloat16|bfloat16.*float32"):
        Engine(model, dtype="bfloat16")
    with pytest.raises(ValueError, match="draft"):
        Engine(tiny_random_model(seed=6), model, dtype="bfloat16")
    assert first.target.dtype == first.dtype == torch.float32  # untouched
    Engine(model, dtype="float32")  # the same device and dtype: fine, nothing is converted
    del first
    gc.collect()
    assert Engine(model, dtype="bfloat16").target.dtype == torch.bfloat16  # nobody else holds it now


def test_a_model_converted_behind_the_engines_back_is_refused_at_generate():
    model = tiny_random_model(seed=5, eos_token_id=None)
    dec = SpeculativeDecoder(Engine(model, dtype="float32"))
    model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        dec.generate([A], max_new_tokens=2)
