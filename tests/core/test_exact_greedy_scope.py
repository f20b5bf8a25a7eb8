"""Where exact greedy applies, and where it says it does not: chain decoding on the eager engine scores
every greedy pass at the fixed width (each `Generation` and `PromptResult` records it); a proposer that
drafts token trees and a compiled engine cannot (the tree's own attention layout, compile=on's
bucketed shapes), so their generations record `exact_greedy=False`, the experiment names the reason
per method in summary.json and the printed table says it under its last line."""

import pytest
from hydra import compose, initialize_config_dir

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.proposers.draft_model import DraftModelProposer
from specdec.study import experiment
from specdec.study.report import format_table, summarize
from specdec.study.results import PromptResult
from tests.conftest import RAGGED_PROMPTS, make_engine
from tests.core.test_tree_engine import MEDUSA_LIKE, TopRankTree
from tests.study.test_experiment import CONF, FAST


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*FAST, *overrides])


def test_chain_decoding_on_the_eager_engine_is_exact_at_temperature_zero_only(target):
    engine = Engine(target, target, dtype="float32")
    dec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=3)
    assert dec.exact_greedy_blocked is None
    assert dec.generate(RAGGED_PROMPTS, max_new_tokens=6).exact_greedy is True
    assert dec.generate(RAGGED_PROMPTS, max_new_tokens=6, temperature=0.8).exact_greedy is False
    dec.exact_greedy = False
    assert dec.generate(RAGGED_PROMPTS, max_new_tokens=6).exact_greedy is False
    assert experiment.exact_greedy_state(dec, _cfg()) == "off"


@pytest.mark.parametrize("k", [0, 3])
def test_exact_greedy_scores_every_step_at_one_width_over_the_whole_buffer(target, monkeypatch, k):
    """What makes a token's logits independent of the pass that scored it (bit for bit in bfloat16,
    `test_exact_greedy.py`, slow): every target pass after the prefill is `score_width` wide and
    every pass attends over the whole buffer. In float32 nothing else would show a change of either."""
    engine = Engine(target, target, dtype="float32")
    dec = SpeculativeDecoder(engine, DraftModelProposer(engine) if k else None, num_speculative_tokens=k)
    passes = []  # (width, key length) of each target pass
    forward = engine.target.forward

    def recorded(tokens, *args, **kwargs):
        out = forward(tokens, *args, **kwargs)
        passes.append((tokens.shape[1], engine.target.cache.kv_len))
        return out

    monkeypatch.setattr(engine.target, "forward", recorded)
    for temperature, exact in ((0.0, True), (0.8, False)):
        passes.clear()
        out = dec.generate(RAGGED_PROMPTS, max_new_tokens=10, temperature=temperature)
        assert out.exact_greedy is exact and len(passes) > 2
        buffer = engine.target.cache.max_len + 1
        widths, keys = {w for w, _ in passes[1:]}, {n for _, n in passes}
        if exact:
            assert widths == {dec.score_width} and keys == {buffer}, passes
        else:  # without exact greedy a pass is as wide as its drafts and reads what has been written
            # (the last steps draft fewer, to each row's room)
            assert max(widths) == k + 1 and widths <= set(range(1, k + 2)) and max(keys) < buffer, passes


def test_a_tree_proposer_says_exact_greedy_does_not_apply(target):
    engine = Engine(target, dtype="float32")
    dec = SpeculativeDecoder(engine, TopRankTree(target, MEDUSA_LIKE), num_speculative_tokens=3)
    assert "token tree" in dec.exact_greedy_blocked
    out = dec.generate(RAGGED_PROMPTS, max_new_tokens=6)
    assert out.exact_greedy is False
    assert experiment.exact_greedy_state(dec, _cfg()) == f"not applied: {dec.exact_greedy_blocked}"
    assert experiment.exact_greedy_state(dec, _cfg("engine.exact_greedy=false")) == "off"
    # the baseline beside a tree method keeps exact greedy, at the width of the chains (none here: 1)
    base = SpeculativeDecoder(engine)
    experiment.set_exact_greedy([dec, base], True)
    assert base.score_width == 1 and base.exact_greedy is False


def test_a_compiled_engine_says_exact_greedy_does_not_apply(target):
    engine = make_engine(target, "self", compile="on")  # dynamo's quick backend: the same shapes, no code
    dec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=2)
    assert "compile=on" in dec.exact_greedy_blocked
    assert dec.generate(RAGGED_PROMPTS[:1], max_new_tokens=4).exact_greedy is False
    assert experiment.exact_greedy_state(dec, _cfg()).startswith("not applied: compile=on")


def test_summary_and_table_name_the_methods_without_exact_greedy():
    rows = [PromptResult("p", "qa", name, new_tokens=4, steps=3, emitted=3, wall_s=1.0, verify_s=0.5,
                         output_token_ids=[1, 2], exact_greedy=name != "medusa")
            for name in ("autoregressive", "ngram", "medusa")]
    reason = "not applied: a token tree is scored with its own positions"
    exact = {"autoregressive": "on", "ngram": "on", "medusa": reason}
    s = summarize(rows, ["ngram", "medusa"], {"num_speculative_tokens": 4}, greedy=True, exact_greedy=exact)
    assert {name: block["exact_greedy"] for name, block in s["methods"].items()} == exact
    table = format_table(s)
    assert table.splitlines()[-1] == f"exact greedy {reason} for medusa"
    assert "exact greedy" not in format_table(summarize(rows[:2], "ngram", {}, greedy=True, exact_greedy=exact))
    assert PromptResult.from_dict(rows[2].to_dict()).exact_greedy is False


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_an_experiment_records_exact_greedy_per_method_and_prompt(tmp_path, method):
    result = experiment.run(_cfg(f"method={method}"), tmp_path)
    states = {name: block["exact_greedy"] for name, block in result.summary["methods"].items()}
    # the method and exact greedy's plain decoding at its width: on; the baseline speedups are over is
    # plain decoding one token wide, which needs no fixed width
    reference = result.summary["exact_greedy_reference"]
    assert states[method] == states[reference] == "on" and states["autoregressive"] == "off"
    assert all(r.exact_greedy for r in result.rows if r.method != "autoregressive")
