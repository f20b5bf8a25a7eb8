"""Pipelined speculative steps (`specdec.accel.pipeline`, `overlap=` with a greedy draft model under
compile=on): the host queues step n+1, drafts included, before it reads step n's outcome. It must
give the serial loop's tokens, statistics, streaming and caches exactly (the target's own greedy
decoding, float32), with drafts that are all accepted, none, or some; rows ending on EOS and on
max_new_tokens at different steps; forced acceptance's draws; a conversation continued; a cache too
short to stay ahead to the end. And it must really queue ahead: the order of passes and reads is
checked, not assumed. Compiled with dynamo's quick backend (the same graphs, shapes and buckets)."""

import pytest
import torch

from specdec.accel.passes import Accelerated
from specdec.accel.pipeline import pipeline_blocked
from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.core.sampling import SamplingParams
from specdec.core.schedules import HeuristicSchedule
from specdec.core.verify import ForcedVerifier, GreedyVerifier
from specdec.models import tiny_random_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.layer_skip import LayerSkipProposer
from specdec.proposers.ngram import NgramProposer
from tests.conftest import RAGGED_PROMPTS, make_engine
from tests.taped_graph import taped_engine

DRAFTS = ("self", "unrelated", "layer_skip")  # every draft accepted, almost none, some


def _decoder(engine, kind, overlap, k=4, **kw) -> SpeculativeDecoder:
    proposer = LayerSkipProposer(engine, exit_layer=1) if kind == "layer_skip" else DraftModelProposer(engine)
    return SpeculativeDecoder(engine, proposer, num_speculative_tokens=k, overlap=overlap, **kw)


@pytest.fixture
def engines(target, unrelated_draft):
    """draft kind -> a compiled engine for it."""
    drafts = {"self": target, "unrelated": unrelated_draft, "layer_skip": None}
    return {kind: make_engine(target, draft, compile="on") for kind, draft in drafts.items()}


def _rows(out):
    return [(r.new_tokens, r.steps, r.accepted, r.emitted, r.draft_lengths, r.accepted_lengths) for r in out.stats.rows]


def _stream(decoder, prompts, **kw):
    seen = []
    out = decoder.generate(prompts, on_tokens=lambda row, ids: seen.append((row, list(ids))), **kw)
    return out, seen


@pytest.mark.parametrize("kind", DRAFTS)
@pytest.mark.parametrize("k", [2, 4])
def test_pipelined_equals_serial_and_the_targets_greedy(target, engines, kind, k):
    engine = engines[kind]
    plain = SpeculativeDecoder(Engine(target, dtype="float32"), None).generate(RAGGED_PROMPTS, max_new_tokens=30)
    serial = _decoder(engine, kind, "off", k).generate(RAGGED_PROMPTS, max_new_tokens=30, reserve=64)
    serial_caches = [m.cache.lengths for m in (engine.target, _draft(engine, serial))]
    serial_kv = _valid_kv(engine.target, serial)
    assert "pipeline" not in serial.reports  # overlap=off: the serial loop
    out = _decoder(engine, kind, "on", k).generate(RAGGED_PROMPTS, max_new_tokens=30, reserve=64)
    assert out.output_ids == serial.output_ids == plain.output_ids
    assert _rows(out) == _rows(serial) and out.stats.steps == serial.stats.steps
    assert set(out.reports["pipeline"]) == {"pipelined_steps"}
    _every_step_pipelined(out)
    _same_caches(engine, out, serial_caches)
    _same_kv(_valid_kv(engine.target, out), serial_kv)


def _every_step_pipelined(out) -> int:
    """Every step after the prefill ran pipelined, the last ones too (their drafts cut on the device
    to each row's room, as the serial loop cuts them). Returns the count."""
    pipelined = out.reports["pipeline"]["pipelined_steps"]
    assert pipelined == out.stats.steps
    return pipelined


def _same_caches(engine, out, serial: list[list[int]]) -> None:
    """The target's cache holds what the serial loop's does: the committed tokens' entries. The
    draft's holds at least as much, never past them: where a row's room cut its last step's drafts,
    the serial loop fed the draft fewer of them than the pipeline, which drafts k on the device and
    keeps the accepted ones (valid entries either way)."""
    target, draft = engine.target.cache.lengths, _draft(engine, out).cache.lengths
    assert target == serial[0]
    assert all(s <= d <= t for s, d, t in zip(serial[1], draft, target)), (serial[1], draft, target)


def _draft(engine, out):
    """The draft model of the decoder that produced `out` (layer skipping's view for that kind)."""
    return engine.draft if engine.draft is not None else next(iter(engine._proposer_models))


def _same_kv(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """The valid cache entries agree to float32 rounding. Not bit for bit: a step the pipeline cuts on
    the device can run at another width than the serial loop's, and some CPUs' BLAS kernels, chosen by
    row count, round the last bit differently (seen: 3e-7 at a row's last entry). A wrong entry (a
    rolled-back draft's key, another position's) differs by far more than that."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def _valid_kv(model, out):
    return [model.cache.valid_kv(0, b)[0].clone() for b in range(len(out.output_ids))]


def test_pipelined_rows_ending_on_eos_and_max_new_tokens(engines):
    """Rows end on EOS at different steps (one perhaps never): the tokens, the streamed pieces and
    the statistics are the serial loop's; the step queued after a row's end is dropped."""
    engine = engines["layer_skip"]
    ref = _decoder(engine, "layer_skip", "off").generate(RAGGED_PROMPTS, max_new_tokens=30)
    eos = [ref.output_ids[0][6], ref.output_ids[2][11]]
    kw = dict(max_new_tokens=30, reserve=64)
    serial, serial_seen = _stream(_decoder(engine, "layer_skip", "off", eos_token_id=eos), RAGGED_PROMPTS, **kw)
    out, seen = _stream(_decoder(engine, "layer_skip", "on", eos_token_id=eos), RAGGED_PROMPTS, **kw)
    assert any(len(o) < 30 for o in serial.output_ids)  # EOS really cut some row short
    assert out.output_ids == serial.output_ids and seen == serial_seen
    assert _rows(out) == _rows(serial) and out.state.seq_lens == serial.state.seq_lens
    assert engine.target.lengths == [n - 1 for n in out.state.seq_lens]
    _every_step_pipelined(out)


def test_forced_acceptance_pipelined_draws_as_the_serial_loop(engines):
    """The verifier's random draws come in the same order: forced acceptance (a benchmark's lossy
    verifier) accepts the same drafts, pipelined or not."""
    engine = engines["unrelated"]
    outs = [_decoder(engine, "unrelated", mode, verifier=ForcedVerifier(0.7)).generate(
        RAGGED_PROMPTS, max_new_tokens=30, seed=5, reserve=64) for mode in ("off", "on")]
    assert outs[0].output_ids == outs[1].output_ids and _rows(outs[0]) == _rows(outs[1])
    assert sum(r.accepted for r in outs[1].stats.rows) > 0 and not outs[1].lossless
    _every_step_pipelined(outs[1])


def test_a_pass_is_queued_before_the_previous_step_is_read(engines, monkeypatch):
    """The property itself: after the first step, each step's outcome is read after the next step's
    target pass was queued."""
    import specdec.accel.syncs as syncs

    engine = engines["self"]
    events = []
    forward_at, read = engine.target.compiled.forward_at, syncs.HostCopy.read
    monkeypatch.setattr(engine.target.compiled, "forward_at", lambda *a, **kw: events.append("pass") or forward_at(*a, **kw))
    monkeypatch.setattr(syncs.HostCopy, "read", lambda self: events.append("read") or read(self))
    out = _decoder(engine, "self", "on").generate(RAGGED_PROMPTS[:1], max_new_tokens=30, reserve=64)
    steps = out.stats.steps
    # the first step's pass, then each next pass before the previous read; the last step read alone
    # or, when its row could have gone on, after one more pass that is dropped
    assert events[:3] == ["pass", "pass", "read"] and events.count("read") == steps
    assert events in (["pass"] + ["pass", "read"] * (steps - 1) + ["read"], ["pass"] + ["pass", "read"] * steps)


def test_continuation_after_a_pipelined_turn(engines):
    """A conversation continued from a pipelined generation reuses its caches and gives the serial
    loop's tokens: the caches' lengths were settled after the steps queued ahead."""
    engine = engines["layer_skip"]
    outs = {}
    for mode in ("off", "on"):
        decoder = _decoder(engine, "layer_skip", mode, max_len=160, eos_token_id=[])
        first = decoder.generate(RAGGED_PROMPTS, max_new_tokens=20)
        follow = [p + o + [21, 22] for p, o in zip(RAGGED_PROMPTS, first.output_ids)]
        second = decoder.generate(follow, max_new_tokens=20, past=first)
        assert second.state.reuse is not None
        outs[mode] = (first.output_ids, second.output_ids, _rows(second))
    assert outs["on"] == outs["off"]


@pytest.mark.parametrize("captured", [False, True])
def test_room_for_a_step_ahead_and_a_context_without_it(unrelated_draft, captured):
    """The decoder allocates k + 1 positions more for the step ahead, so the steps stay pipelined to
    the end; where the context has no room for them (a request that fills it), the last steps run
    serially, with the same tokens; captured whole too, up to the serial steps."""
    target = tiny_random_model(seed=0, eos_token_id=None, max_position_embeddings=64)
    draft = tiny_random_model(seed=1, num_layers=1, eos_token_id=None, max_position_embeddings=64)
    # a token a step: the longest row nears the cache's end step by step
    engine = taped_engine(target, draft) if captured else make_engine(target, draft, compile="on")
    prompts, k = RAGGED_PROMPTS, 4
    # the second fills the context: the longest prompt, 9, and exact greedy's room, 7 (the width 8 less one)
    for new_tokens in (30, 64 - 9 - 7):
        serial = SpeculativeDecoder(engine, DraftModelProposer(engine), k, overlap="off").generate(prompts, new_tokens)
        out = SpeculativeDecoder(engine, DraftModelProposer(engine), k, overlap="on").generate(prompts, new_tokens)
        assert out.output_ids == serial.output_ids and _rows(out) == _rows(serial)
        assert out.state.max_len == min(serial.state.max_len + k + 1, 64)
        pipelined = out.reports["pipeline"]["pipelined_steps"]
        assert 0 < pipelined <= out.stats.steps and (pipelined == out.stats.steps) is (new_tokens == 30)
        if captured:
            assert out.reports["pipeline"]["graphed_steps"] > 0 and "step_graph_error" not in out.reports["pipeline"]


def test_reads_once_a_step(engines):
    from specdec.accel.syncs import count_host_syncs

    engine = engines["layer_skip"]
    decoder = _decoder(engine, "layer_skip", "on")
    decoder.generate(RAGGED_PROMPTS, max_new_tokens=8, reserve=64)  # warm
    with count_host_syncs() as syncs:
        out = decoder.generate(RAGGED_PROMPTS, max_new_tokens=24, reserve=64)
    assert syncs.total <= out.stats.steps + 1  # a read a step and the prefill's


def test_what_is_not_pipelined(target, engines):
    """Each case that cannot be pipelined says why, and runs serially with the same tokens."""
    engine = engines["self"]
    greedy, sampled = SamplingParams(0.0), SamplingParams(0.8)

    def blocked(decoder, sampling=greedy):
        return pipeline_blocked(decoder, sampling, GreedyVerifier())

    assert blocked(_decoder(engine, "self", "on")) is None
    assert "draft model" in blocked(SpeculativeDecoder(engine, NgramProposer(engine), overlap="on"))
    assert "temperature" in blocked(_decoder(engine, "self", "on"), sampled)
    assert "constant k" in blocked(_decoder(engine, "self", "on", k=1))
    assert "constant k" in blocked(_decoder(engine, "self", "on", schedule=HeuristicSchedule(4)))
    assert "compile=off" in blocked(_decoder(make_engine(target, target, compile="off"), "self", "on"))
    assert not _decoder(engine, "self", "off").pipelines(greedy, GreedyVerifier())  # overlap=off: never asked
    # at temperature > 0 the steps run serially: the same tokens as overlap=off
    outs = [_decoder(engine, "self", mode).generate(RAGGED_PROMPTS, max_new_tokens=12, temperature=0.8, seed=2)
            for mode in ("off", "on")]
    assert outs[0].output_ids == outs[1].output_ids and "pipeline" not in outs[1].reports


def test_overlap_auto_pipelines_on_cuda_only(engines):
    decoder = _decoder(engines["self"], "self", "auto")
    assert decoder.pipelines(SamplingParams(0.0), GreedyVerifier()) is (decoder.engine.device.type == "cuda")


def test_pipelined_with_unrelated_models_of_more_layers():
    """A deeper target and draft than the shared fixtures (3 and 2 layers), prompts of one token and
    longer ones, batch 4: the same tokens as the serial loop."""
    target, draft = tiny_random_model(seed=11, num_layers=3, eos_token_id=None), tiny_random_model(seed=12, eos_token_id=None)
    engine = make_engine(target, draft, compile="on")
    prompts = [[7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [30, 31], [9, 9, 9, 9]]
    serial = SpeculativeDecoder(engine, DraftModelProposer(engine), 3, overlap="off").generate(prompts, 25, reserve=64)
    out = SpeculativeDecoder(engine, DraftModelProposer(engine), 3, overlap="on").generate(prompts, 25, reserve=64)
    assert out.output_ids == serial.output_ids and _rows(out) == _rows(serial)
    _every_step_pipelined(out)


@pytest.mark.slow
def test_inductor_pipelined_equals_eager(target, unrelated_draft):
    """What compile=on runs on a CPU (inductor's kernels), pipelined: a ragged batch at k = 4, the
    eager serial loop's tokens and acceptance."""
    eager = _decoder(make_engine(target, unrelated_draft, compile="off"), "unrelated", "off").generate(RAGGED_PROMPTS, 24)
    engine = Engine(target, unrelated_draft, dtype="float32", passes=Accelerated(compile="on"))
    out = _decoder(engine, "unrelated", "on").generate(RAGGED_PROMPTS, 24)
    assert out.output_ids == eager.output_ids and _rows(out) == _rows(eager)
    _every_step_pipelined(out)


@pytest.mark.parametrize("kind", DRAFTS)
def test_steps_captured_whole_equal_serial(target, unrelated_draft, kind):
    """Under explicit graphs each pipelined step after the first is one replay of a graph captured
    on its key's first step (drafting, scoring, verifying, commit): the serial loop's tokens,
    statistics and caches, over a generation long enough to move the key bucket (64 -> 128 keys),
    so that a second graph is captured and each replays under its own key."""
    engine = taped_engine(target, {"self": target, "unrelated": unrelated_draft, "layer_skip": None}[kind])
    serial = _decoder(engine, kind, "off").generate(RAGGED_PROMPTS, max_new_tokens=72, reserve=64)
    caches = [m.cache.lengths for m in (engine.target, _draft(engine, serial))]
    kv = _valid_kv(engine.target, serial)
    out = _decoder(engine, kind, "on").generate(RAGGED_PROMPTS, max_new_tokens=72, reserve=64)
    assert out.output_ids == serial.output_ids and _rows(out) == _rows(serial)
    report = out.reports["pipeline"]
    # every pipelined step after the first replayed
    pipelined = _every_step_pipelined(out)
    assert pipelined - 1 <= report["graphed_steps"] <= pipelined
    # key buckets of 64 and 128 keys, the draft's and the target's crossing at steps of their own:
    # a few graphs, not one a step
    assert 2 <= report["step_graphs"] <= 4 and "step_graph_error" not in report
    _same_caches(engine, out, caches)
    _same_kv(_valid_kv(engine.target, out), kv)


def test_forced_acceptance_captured_whole_draws_as_the_serial_loop(target, unrelated_draft):
    """A captured step takes its uniforms as an input, drawn before it as the serial loop draws them:
    forced acceptance accepts the same drafts."""
    engine = taped_engine(target, unrelated_draft)
    outs = [_decoder(engine, "unrelated", mode, verifier=ForcedVerifier(0.7)).generate(
        RAGGED_PROMPTS, max_new_tokens=30, seed=5, reserve=64) for mode in ("off", "on")]
    assert outs[0].output_ids == outs[1].output_ids and _rows(outs[0]) == _rows(outs[1])
    assert outs[1].stats.steps - 1 <= outs[1].reports["pipeline"]["graphed_steps"] <= outs[1].stats.steps
    assert sum(r.accepted for r in outs[1].stats.rows) > 0


def test_a_step_that_cannot_be_captured_runs_uncaptured(target, unrelated_draft, monkeypatch):
    """A capture refused (as a device refuses an operation it cannot capture, after the call ran once
    on the side): a warning, the steps go on pass by pass with the serial loop's tokens, and the
    report says why."""
    import specdec.accel.pipeline as pipeline

    class Refused(pipeline.CapturedCall):
        def __init__(self, fn, args, extra, holder, graph):
            fn(*args)
            raise RuntimeError("operation not permitted when stream is capturing")

    engine = taped_engine(target, unrelated_draft)
    serial = _decoder(engine, "unrelated", "off").generate(RAGGED_PROMPTS, max_new_tokens=30, reserve=64)
    monkeypatch.setattr(pipeline, "CapturedCall", Refused)
    with pytest.warns(RuntimeWarning, match="could not be captured as one CUDA graph"):
        out = _decoder(engine, "unrelated", "on").generate(RAGGED_PROMPTS, max_new_tokens=30, reserve=64)
    assert out.output_ids == serial.output_ids and _rows(out) == _rows(serial)
    report = out.reports["pipeline"]
    assert report["graphed_steps"] == report["step_graphs"] == 0 and "not permitted" in report["step_graph_error"]
