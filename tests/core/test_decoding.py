"""The decoding loop: greedy speculative output is token-identical to plain greedy decoding, at
batch size 1 and in ragged batches, with a perfect and with a useless draft; EOS inside an accepted
block ends the row there; bad input is refused before any model work."""

import pytest
import torch

from specdec.core.decoding import SpeculativeDecoder, TextStreamer
from specdec.core.engine import CachedModel
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
    if draft == "self":  # every draft that was verified was accepted (the last step may be cut short)
        assert out.stats.per_position_acceptance == [1.0] * k
    else:
        assert out.stats.acceptance_rate < 0.2
    assert ref.stats.mean_accepted_length == 1.0


@pytest.mark.parametrize("exact_greedy", [True, False])
@pytest.mark.parametrize("prompts", [[[5]], [[5], [7]], [[5], [3, 4, 9]]])
def test_one_token_prompts_decode_as_generate_does(engine_factory, target, prompts, exact_greedy):
    """Against transformers' own greedy `generate`, not specdec's plain decoding, which shared the
    defect: a one-token prompt's prefill over the whole cache buffer (exact greedy) attended to
    unwritten keys, because transformers skips the mask for a single query."""
    engine = engine_factory("self")
    with torch.no_grad():
        ref = [target.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
               for p in prompts]
    for k in (0, 3):
        dec = SpeculativeDecoder(engine, DraftModelProposer(engine) if k else None, num_speculative_tokens=k,
                                 exact_greedy=exact_greedy)
        assert dec.generate(prompts, max_new_tokens=12).output_ids == ref, f"k={k}"


def test_a_one_token_pass_over_the_whole_buffer_sees_only_written_keys(target):
    with torch.no_grad():
        fresh = target(torch.tensor([[5, 6, 7]])).logits[0]
    for fed in ([[5], [6], [7]], [[5, 6], [7]]):
        model = CachedModel(target)
        model.reset(1, 32)
        model.cache.fixed_kv_len = True  # every pass attends over all 33 key slots
        last = [model.forward(torch.tensor([chunk]))[0, -1] for chunk in fed]
        torch.testing.assert_close(last[-1], fresh[-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(last[0], fresh[len(fed[0]) - 1], rtol=1e-4, atol=1e-4)


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
        ({"prompts": [[3 + i % 200 for i in range(497)]], "max_new_tokens": 20}, "context"),
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
    # K+V in float32, max_len positions and one scratch position
    per_layer = 2 * len(RAGGED_PROMPTS) * cfg.num_key_value_heads * (out.state.max_len + 1) * head_dim * 4
    assert engine.cache_bytes() == {"target": cfg.num_hidden_layers * per_layer,
                                    "draft": cfg.num_hidden_layers * per_layer}


class _CheckedDraft(DraftModelProposer):
    """After every step, the draft's cache must equal a fresh pass over exactly the tokens it keeps,
    and keep each committed token it was fed (except the last, which the next step feeds again)."""

    def __init__(self, engine):
        super().__init__(engine)
        self.steps = 0

    def observe(self, state, outcome):
        super().observe(state, outcome)
        k = outcome.proposal.k
        if k == 0:
            return
        self.steps += 1
        for b, (prev, n) in enumerate(zip(outcome.prev_seq_lens, state.seq_lens)):
            # This step fed the draft its tokens up to `prev`, then drafts 1..k-1 at prev, prev+1, ...
            fed = outcome.proposal.tokens[b, : k - 1].tolist()
            committed = state.tokens[b, prev:n].tolist()
            matching = next((i for i, (f, c) in enumerate(zip(fed, committed)) if f != c), min(len(fed), len(committed)))
            assert self.draft.lengths[b] == min(prev + matching, n - 1), (b, prev, n, self.draft.lengths)
            _assert_cache_equals_fresh_pass(self.draft, b, state.tokens[b, : self.draft.lengths[b]])


def _assert_cache_equals_fresh_pass(model, row, tokens):
    ref = CachedModel(model.model, "reference")
    ref.reset(1, len(tokens) + 1)
    ref.forward(tokens[None])
    for layer in range(model.num_layers):
        k, v = model.cache.valid_kv(layer, row)
        k_ref, v_ref = ref.cache.valid_kv(layer, 0)
        assert k.shape == k_ref.shape
        assert torch.allclose(k, k_ref, atol=1e-5) and torch.allclose(v, v_ref, atol=1e-5)


@pytest.mark.parametrize(
    "draft, max_new_tokens, temperature",
    [
        ("self", 1 + 2 * 4, 0.0),  # every row ends on a fully accepted step (k = 3: 4 tokens a step)
        ("self", 7, 0.0),  # the last full step is cut by max_new_tokens
        ("unrelated", 20, 0.0),  # rejections at every position
        ("unrelated", 20, 1.0),  # sampled drafts
    ],
)
def test_draft_cache_after_each_step_equals_feeding_only_the_kept_tokens(
        engine_factory, unrelated_draft, draft, max_new_tokens, temperature):
    engine = engine_factory("self" if draft == "self" else unrelated_draft)
    proposer = _CheckedDraft(engine)
    dec = SpeculativeDecoder(engine, proposer, num_speculative_tokens=3)
    dec.generate(RAGGED_PROMPTS, max_new_tokens=max_new_tokens, temperature=temperature)
    assert proposer.steps >= 2


def test_draft_cache_stays_exact_when_one_row_ends_early(engine_factory):
    engine = engine_factory("self")
    ref = _decode(engine)
    eos = ref.output_ids[1][3]  # row 1 ends after a few tokens, the others go on
    proposer = _CheckedDraft(engine)
    dec = SpeculativeDecoder(engine, proposer, num_speculative_tokens=3, eos_token_id=eos)
    dec.generate(RAGGED_PROMPTS, max_new_tokens=24)
    assert proposer.steps >= 4


def test_continuing_after_a_fully_accepted_last_step_keeps_full_acceptance(engine_factory):
    """The target drafting for itself must be accepted everywhere in turn 2 as in turn 1, also when
    turn 1 ended on a step whose drafts were all accepted (its last draft was never fed)."""
    engine = engine_factory("self")
    k = 3
    dec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=k, max_len=200)
    first = dec.generate(RAGGED_PROMPTS[:1], max_new_tokens=1 + 2 * (k + 1))
    assert first.stats.acceptance_rate == 1.0
    turn2 = RAGGED_PROMPTS[0] + first.output_ids[0] + [20, 21]
    second = dec.generate([turn2], max_new_tokens=1 + 3 * (k + 1), past=first)  # no step cut short
    assert second.state.reuse == [len(turn2) - 2]
    assert second.stats.acceptance_rate == 1.0


def test_ragged_continuation_fits_when_each_row_fits(engine_factory):
    """Row 0 continues its conversation (2 new tokens after 50 reused), row 1 is a new 100-token
    prompt: each row needs at most 111 of the 128 positions, so nothing overflows."""
    dec = SpeculativeDecoder(engine_factory(), max_len=128)
    a, b = list(range(3, 43)), [7, 8, 9, 10, 11]
    first = dec.generate([a, b], max_new_tokens=10)
    a2, b2 = a + first.output_ids[0] + [20, 21], list(range(100, 200))
    second = dec.generate([a2, b2], max_new_tokens=10, past=first)
    assert second.state.reuse == [len(a2) - 2, 0]
    assert second.output_ids == [dec.generate([p], max_new_tokens=10).output_ids[0] for p in (a2, b2)]


def _record_pass_widths(model) -> list[int]:
    """Wrap `model.forward` (a CachedModel) to record the width T of every pass."""
    widths, forward = [], model.forward

    def recording(tokens, *args, **kwargs):
        widths.append(tokens.shape[1])
        return forward(tokens, *args, **kwargs)

    model.forward = recording
    return widths


@pytest.mark.parametrize("k", [0, 3])
def test_cache_length_is_what_the_longest_row_needs(engine_factory, k):
    """A row's last step starts with at most max_new_tokens - 1 tokens generated and writes its last
    token plus the rest of the pass after them; a finished row still takes part in later passes. So
    the longest prompt + max_new_tokens + (widest scoring pass - 1), and not a position more."""
    engine = engine_factory("self")
    widths = _record_pass_widths(engine.target)
    out = _decode(engine, k, max_new_tokens=10)
    assert out.state.max_len == max(len(p) for p in RAGGED_PROMPTS) + 10 + max(widths[1:]) - 1


def test_the_longest_row_finishing_first_still_fits(engine_factory, unrelated_draft):
    """The worst case for that size: the longest row reaches max_new_tokens a step before another
    row, and its cache then takes one more pass of k + 1 tokens after its last one."""
    engine = engine_factory(unrelated_draft)
    prompts = [RAGGED_PROMPTS[2], RAGGED_PROMPTS[0]]
    out = _decode(engine, 4, prompts=prompts)
    assert out.stats.rows[0].steps < out.stats.rows[1].steps  # the longest row finished first
    assert out.output_ids == _decode(engine, prompts=prompts).output_ids
