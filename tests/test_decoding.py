"""The decoding loop: greedy speculative output is token-identical to plain greedy decoding, at
batch size 1 and in ragged batches, with a perfect and with a useless draft; EOS inside an accepted
block ends the row there; bad input is refused before any model work."""

import pytest

from specdec.decoding import SpeculativeDecoder, TextStreamer
from specdec.proposers.draft_model import DraftModelProposer
from tests.conftest import RAGGED_PROMPTS


def _decode(engine, k=None, prompts=RAGGED_PROMPTS, **kw):
    proposer = DraftModelProposer(engine) if k else None
    dec = SpeculativeDecoder(engine, proposer, num_speculative_tokens=k or 0)
    return dec.generate(prompts, **{"max_new_tokens": 24, **kw})


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("draft", ["self", "unrelated"])
@pytest.mark.parametrize("batch", ["single", "ragged"])
def test_greedy_speculative_equals_autoregressive(engine_factory, unrelated_draft, k, draft, batch):
    engine = engine_factory("self" if draft == "self" else unrelated_draft)
    prompts = RAGGED_PROMPTS[:1] if batch == "single" else RAGGED_PROMPTS
    ref = _decode(engine, prompts=prompts)
    out = _decode(engine, k, prompts=prompts)
    assert out.output_ids == ref.output_ids
    assert all(len(o) == 24 for o in out.output_ids)
    if draft == "self":
        assert out.stats.acceptance_rate == 1.0
        assert out.stats.per_position_acceptance == [1.0] * k
    else:
        assert out.stats.acceptance_rate < 0.2
    assert ref.stats.mean_accepted_length == 1.0


def test_ragged_batch_rows_equal_single_runs(engine_factory):
    engine = engine_factory("self")
    batch = _decode(engine, 4)
    for i, p in enumerate(RAGGED_PROMPTS):
        assert _decode(engine, 4, prompts=[p]).output_ids[0] == batch.output_ids[i]


def test_eos_inside_accepted_block_ends_the_row_there(engine_factory):
    engine = engine_factory("self")
    ref = _decode(engine, prompts=RAGGED_PROMPTS[:1])
    eos = ref.output_ids[0][5]  # make the 6th generated token the EOS: it lies inside a k=8 block
    first = ref.output_ids[0].index(eos)
    dec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=8, eos_token_id=eos)
    out = dec.generate(RAGGED_PROMPTS[:1], max_new_tokens=24)
    assert out.output_ids[0] == ref.output_ids[0][: first + 1]
    assert out.stats.steps == 1 and first > 0  # one step accepted past the EOS, and was cut there


def test_eos_ends_only_its_own_row_in_a_batch(engine_factory):
    engine = engine_factory("self")
    ref = _decode(engine)
    eos = ref.output_ids[1][3]
    dec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=4, eos_token_id=eos)
    out = dec.generate(RAGGED_PROMPTS, max_new_tokens=24)
    for got, want in zip(out.output_ids, ref.output_ids):
        assert got == (want[: want.index(eos) + 1] if eos in want else want)


def test_text_prompts_and_streaming(engine_factory):
    from specdec.models import tiny_random_tokenizer

    tok = tiny_random_tokenizer()
    engine = engine_factory("self")
    pieces = []
    dec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=3, tokenizer=tok)
    out = dec.generate(["t5 t6 t7"], max_new_tokens=10,
                       on_tokens=TextStreamer(tok, lambda row, text: pieces.append(text)))
    assert "".join(pieces) == out.texts[0]
    assert out.prompt_ids[0] == tok.encode("t5 t6 t7")


def test_continuation_reuses_the_cache_and_matches_a_fresh_run(engine_factory):
    engine = engine_factory("self")
    dec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=3, max_len=128)
    first = dec.generate(RAGGED_PROMPTS[:1], max_new_tokens=10)
    turn2 = RAGGED_PROMPTS[0] + first.output_ids[0] + [20, 21]
    reused = dec.generate([turn2], max_new_tokens=10, past=first)
    assert reused.state.reuse == [len(turn2) - 2]  # only the two new tokens were fed again
    fresh = dec.generate([turn2], max_new_tokens=10)
    assert reused.output_ids == fresh.output_ids


def test_sampling_is_reproducible_with_a_seed(engine_factory, unrelated_draft):
    engine = engine_factory(unrelated_draft)
    a = _decode(engine, 3, temperature=0.8, seed=7)
    b = _decode(engine, 3, temperature=0.8, seed=7)
    c = _decode(engine, 3, temperature=0.8, seed=8)
    assert a.output_ids == b.output_ids != c.output_ids
    assert a.verifier == "speculative_sampling" and a.lossless


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompts": [[]]}, "empty"),
        ({"prompts": [list(range(3, 500))], "max_new_tokens": 20}, "context"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(engine_factory, kwargs, message):
    engine = engine_factory("self")
    with pytest.raises(ValueError, match=message):
        _decode(engine, 2, **kwargs)
    assert engine.target.cache is None  # refused before any model work


def test_k_below_one_is_refused(engine_factory):
    engine = engine_factory("self")
    with pytest.raises(ValueError, match="k"):
        SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=0)


def test_engine_reports_cache_bytes(engine_factory, target):
    engine = engine_factory("self")
    out = _decode(engine, 2)
    cfg = target.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_layer = 2 * len(RAGGED_PROMPTS) * cfg.num_key_value_heads * out.state.max_len * head_dim * 4  # K+V, fp32
    assert engine.cache_bytes() == {"target": cfg.num_hidden_layers * per_layer,
                                    "draft": cfg.num_hidden_layers * per_layer}
