"""The peers study's scripts. experiments/peers/draft_replay.py: replaying a suffix drafter over
plain decoding's greedy text takes the steps that the engine takes with that drafter; collect.py
keeps the recorded rows of runs whose raw outputs are not here."""

import pytest

from specdec.core.decoding import SpeculativeDecoder
from specdec.proposers.suffix import SuffixProposer, SuffixTreeProposer
from tests.conftest import load_script


@pytest.mark.parametrize("kind", [SuffixProposer, SuffixTreeProposer])
def test_the_replay_takes_the_engines_steps(engine_factory, kind):
    replay = load_script("draft_replay", "experiments/peers")
    engine = engine_factory()
    prompt = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 11, 5, 6, 7]  # repeats: suffix matches to draft from
    text = SpeculativeDecoder(engine).generate([prompt], max_new_tokens=40).output_ids[0]
    make = lambda: kind(max_spec_factor=2.0, min_token_prob=0.05, max_cached_requests=0)  # noqa: E731
    out = SpeculativeDecoder(engine, make(), num_speculative_tokens=6).generate([prompt], max_new_tokens=40)
    row = out.stats.rows[0]
    steps, widths = replay.replay(make(), prompt, text, k=6)
    assert out.output_ids[0] == text
    assert row.accepted > 0  # the drafter was right at times: the count is not only one per step
    assert steps == row.steps
    if kind is SuffixProposer:  # a chain's width is its draft plus the root
        assert [w - 1 for w in widths] == row.draft_lengths


def test_collect_keeps_the_recorded_rows_of_runs_whose_outputs_are_not_here(tmp_path, monkeypatch):
    collect = load_script("collect", "experiments/peers")
    monkeypatch.setattr(collect, "HERE", tmp_path)
    monkeypatch.setattr(collect, "COMMANDS", {"cpu_a": "cmd a", "cpu_b": "cmd b"})
    (tmp_path / "results.csv").write_text("run,method,tok/s\ncpu_a,ngram,40.1\ncpu_a,vllm,31.0\ngone,x,1\n")
    assert collect.rows() == [{"run": "cpu_a", "method": "ngram", "tok/s": "40.1"},
                              {"run": "cpu_a", "method": "vllm", "tok/s": "31.0"}]  # cpu_b: no rows, none made
