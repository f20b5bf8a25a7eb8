"""Overlapped plain decoding (`overlap=`): the host queues step n+1 before it reads step n's token.
It must give the serial loop's tokens, streaming, statistics and caches exactly (greedy and sampled,
ragged batches, rows that stop on EOS at different steps, conversations continued), and it must
really queue ahead: the order of passes and reads is checked, not assumed."""

import pytest
import torch

from specdec.core.decoding import SpeculativeDecoder
from specdec.proposers.draft_model import DraftModelProposer
from tests.conftest import RAGGED_PROMPTS, make_engine


def _plain(engine, overlap, **kw):
    return SpeculativeDecoder(engine, None, overlap=overlap, **kw)


def _stream(dec, prompts, **kw):
    seen = []
    out = dec.generate(prompts, on_tokens=lambda row, ids: seen.append((row, list(ids))), **kw)
    return out, seen


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("exact", [True, False])
def test_overlapped_equals_serial_with_rows_ending_on_eos(engine_factory, temperature, exact):
    engine = engine_factory(compile="off")
    ref = _plain(engine, "off").generate(RAGGED_PROMPTS, max_new_tokens=20, temperature=temperature, seed=3)
    # EOS ids that end rows at different steps (and one row, perhaps, never)
    eos = [ref.output_ids[0][4], ref.output_ids[2][9]]
    kw = dict(max_new_tokens=20, temperature=temperature, seed=3)
    serial, serial_seen = _stream(_plain(engine, "off", eos_token_id=eos, exact_greedy=exact), RAGGED_PROMPTS, **kw)
    over, over_seen = _stream(_plain(engine, "on", eos_token_id=eos, exact_greedy=exact), RAGGED_PROMPTS, **kw)
    assert over.output_ids == serial.output_ids
    assert any(len(o) < 20 for o in serial.output_ids)  # EOS really cut some row short
    assert over_seen == serial_seen  # the same tokens streamed, row by row, in the same order
    for a, b in zip(over.stats.rows, serial.stats.rows):
        assert (a.new_tokens, a.steps, a.emitted, a.draft_lengths) == (b.new_tokens, b.steps, b.emitted, b.draft_lengths)
    # every row stopping on EOS costs the pass queued after its end, at most once a generation
    assert serial.stats.steps <= over.stats.steps <= serial.stats.steps + 1
    assert over.state.seq_lens == serial.state.seq_lens
    assert engine.target.lengths == [n - 1 for n in over.state.seq_lens]  # the cache holds exactly the tokens


def test_max_new_tokens_ends_without_an_extra_pass(engine_factory):
    """Room is known on the host: a generation that stops on max_new_tokens queues nothing after it."""
    engine = engine_factory(compile="off")
    serial = _plain(engine, "off").generate(RAGGED_PROMPTS, max_new_tokens=9)
    over = _plain(engine, "on").generate(RAGGED_PROMPTS, max_new_tokens=9)
    assert over.output_ids == serial.output_ids and all(len(o) == 9 for o in over.output_ids)
    assert over.stats.steps == serial.stats.steps == 8  # the prefill gives the first token


def test_the_next_pass_is_queued_before_the_token_is_read(engine_factory, monkeypatch):
    """The property itself: after the first step, every read of a step's tokens comes after the next
    step's target pass was queued (serially, each read comes right after its own pass)."""
    import specdec.accel.syncs as syncs

    def order(overlap):
        engine = engine_factory(compile="off")
        events = []
        forward = engine.target.forward

        def logged_forward(*args, **kwargs):
            events.append("pass")
            return forward(*args, **kwargs)

        read = syncs.HostCopy.read

        def logged_read(self):
            events.append("read")
            return read(self)

        monkeypatch.setattr(engine.target, "forward", logged_forward)
        monkeypatch.setattr(syncs.HostCopy, "read", logged_read)
        _plain(engine, overlap).generate(RAGGED_PROMPTS[:1], max_new_tokens=6)
        monkeypatch.undo()
        return events

    # the prefill's pass and step 1's, then each step's pass before the previous step's read (5 steps)
    assert order("on") == ["pass"] * 2 + ["pass", "read"] * 4 + ["read"]
    assert "read" not in order("off")  # the serial loop reads with `_read_step` right after each pass


def test_continuation_after_an_overlapped_turn(engine_factory):
    """A conversation continued from an overlapped generation reuses its cache and matches a serial
    one: the queued-ahead entries were rolled back."""
    engine = engine_factory(compile="off")
    outs = {}
    for mode in ("off", "on"):
        dec = _plain(engine, mode, max_len=128, eos_token_id=[])
        first = dec.generate(RAGGED_PROMPTS, max_new_tokens=7)
        follow = [p + o + [21, 22] for p, o in zip(RAGGED_PROMPTS, first.output_ids)]
        second = dec.generate(follow, max_new_tokens=7, past=first)
        assert second.state.reuse is not None  # the cache was reused, not prefilled again
        outs[mode] = (first.output_ids, second.output_ids)
    assert outs["on"] == outs["off"]


def test_compiled_overlapped_equals_eager_serial(target):
    """compile=on (dynamo's quick backend: the same graphs and buckets) with the steps queued ahead."""
    eager = make_engine(target)
    compiled = make_engine(target, compile="on")
    ref = _plain(eager, "off").generate(RAGGED_PROMPTS, max_new_tokens=12)
    out = _plain(compiled, "on").generate(RAGGED_PROMPTS, max_new_tokens=12)
    assert out.output_ids == ref.output_ids
    assert compiled.compile_report()["target"]["compiled_calls"] == out.stats.steps


def test_overlap_default_and_scope(engine_factory):
    engine = engine_factory("self", compile="off")
    assert _plain(engine, "auto").overlaps() is (engine.device.type == "cuda")
    assert _plain(engine, True).overlaps() and not _plain(engine, False).overlaps()
    speculative = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=2, overlap="on")
    assert not speculative.overlaps()  # a step's drafts start from the accepted count the host reads
    with pytest.raises(ValueError, match="overlap='sometimes' is not one of"):
        _plain(engine, "sometimes")
    eager = engine_factory("self")  # the core's engine has no step runner: its steps run serially
    assert not _plain(eager, True).overlaps()


def test_overlapped_reads_once_a_step(engine_factory):
    from specdec.accel.syncs import count_host_syncs

    engine = engine_factory(compile="off")
    dec = _plain(engine, "on")
    dec.generate(RAGGED_PROMPTS, max_new_tokens=4)  # warm
    with count_host_syncs() as syncs:
        out = dec.generate(RAGGED_PROMPTS, max_new_tokens=16)
    assert syncs.total <= out.stats.steps + 1  # a read a step and the prefill's
    assert torch.equal(out.state.tokens[0, : out.state.seq_lens[0]].cpu(),
                       torch.tensor(out.state.committed[0]))  # the device buffer matches the host's copy


def test_an_experiment_sets_overlap_and_records_it(tmp_path):
    """`engine.overlap=` reaches every specdec decoder of a run; summary.json says what plain decoding ran
    with, and the baseline's tokens do not depend on it."""
    from hydra import compose, initialize_config_dir

    from specdec.study import experiment
    from tests.study.test_experiment import CONF, FAST

    outputs = {}
    for mode in ("on", "off"):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=[*FAST, "method=ngram", f"engine.overlap={mode}"])
        result = experiment.run(cfg, tmp_path / mode)
        assert result.summary["overlap"] == mode
        assert result.summary["compile"] == "off" and "cuda_graphs" not in result.summary  # CUDA, compile=on only
        outputs[mode] = [r.output_token_ids for r in result.rows if r.method == "autoregressive"]
    assert outputs["on"] == outputs["off"] and outputs["on"]

