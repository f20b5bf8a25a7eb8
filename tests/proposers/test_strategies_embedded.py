"""The embedded SmolLM2-135M-Instruct in float32: n-gram lookup and layer skipping (with an adaptive
schedule too) give exactly the target's greedy output on real prompts."""

import pytest

from specdec import Engine, ModelSpec, SpeculativeDecoder, load_model
from specdec.core.schedules import make_schedule
from specdec.proposers.layer_skip import LayerSkipProposer
from specdec.proposers.ngram import NgramProposer
from specdec.study.data import build_turn_input

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup():
    model, tok = load_model(ModelSpec(path="embedded"))
    engine = Engine(model, dtype="float32")
    prompts = [build_turn_input(tok, [], q) for q in (
        "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
        "Name three primary colors.")]
    return engine, prompts, SpeculativeDecoder(engine).generate(prompts, max_new_tokens=32)


@pytest.mark.parametrize("make", [
    lambda e: (NgramProposer(e), None),
    lambda e: (NgramProposer(e), make_schedule("cost_aware", 6)),
    lambda e: (LayerSkipProposer(e, exit_layer=12), make_schedule("heuristic", 4)),
], ids=["ngram", "ngram-cost_aware", "layer_skip-heuristic"])
def test_greedy_output_equals_the_targets(setup, target_time, make):
    engine, prompts, plain = setup
    target_time(engine)  # the cost-aware schedule's choices do not depend on the machine's load
    proposer, schedule = make(engine)
    out = SpeculativeDecoder(engine, proposer, num_speculative_tokens=4, schedule=schedule).generate(
        prompts, max_new_tokens=32)
    assert out.output_ids == plain.output_ids
    assert sum(r.accepted for r in out.stats.rows) > 0
