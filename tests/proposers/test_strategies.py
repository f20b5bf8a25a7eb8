"""Greedy parity of every lossless drafting strategy: n-gram lookup, layer skipping, and the draft
model under each draft-length schedule give output token-identical to the target's own greedy
decoding, at batch size 1 and in a ragged batch."""

import pytest
import torch

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.core.schedules import make_schedule
from specdec.models import tiny_random_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.layer_skip import LayerSkipProposer, early_exit_view
from specdec.proposers.ngram import NgramProposer
from tests.conftest import RAGGED_PROMPTS

# Prompts that repeat themselves, so that prompt lookup has something to find.
REPEATING = [[5, 6, 7, 8, 9, 5, 6, 7], [3, 4, 3, 4], [10, 11, 12, 13, 14, 15, 16, 10, 11, 12]]


def _greedy(engine, proposer=None, k=4, schedule=None, prompts=RAGGED_PROMPTS, n=32):
    dec = SpeculativeDecoder(engine, proposer, num_speculative_tokens=k, schedule=schedule)
    return dec.generate(prompts, max_new_tokens=n)


@pytest.fixture(scope="module")
def deep_target():
    return tiny_random_model(seed=3, num_layers=4, eos_token_id=None)


@pytest.mark.parametrize("batch", ["single", "ragged"])
@pytest.mark.parametrize("prompts", [RAGGED_PROMPTS, REPEATING], ids=["plain", "repeating"])
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("ngram", [(4, 1), (3, 2)])
def test_ngram_greedy_equals_autoregressive(engine_factory, batch, prompts, k, ngram):
    engine = engine_factory()
    prompts = prompts[:1] if batch == "single" else prompts
    ref = _greedy(engine, prompts=prompts)
    out = _greedy(engine, NgramProposer(engine, max_ngram=ngram[0], min_ngram=ngram[1]), k, prompts=prompts)
    assert out.output_ids == ref.output_ids
    assert out.lossless and sum(r.proposed for r in out.stats.rows) > 0
    # k wide with the lengths left on the device (a GPU's default): the same tokens and, once the
    # step's read has brought the lengths back, the same per-row statistics
    static = NgramProposer(engine, max_ngram=ngram[0], min_ngram=ngram[1])
    static.static_width = True
    wide = _greedy(engine, static, k, prompts=prompts)
    assert wide.output_ids == ref.output_ids
    assert [(r.proposed, r.accepted, r.steps) for r in wide.stats.rows] == \
        [(r.proposed, r.accepted, r.steps) for r in out.stats.rows]


@pytest.mark.parametrize("batch", ["single", "ragged"])
@pytest.mark.parametrize("exit_layer", [1, 3])
@pytest.mark.parametrize("k", [1, 4])
def test_layer_skip_greedy_equals_autoregressive(deep_target, batch, exit_layer, k):
    engine = Engine(deep_target, dtype="float32")
    prompts = RAGGED_PROMPTS[:1] if batch == "single" else RAGGED_PROMPTS
    ref = _greedy(engine, prompts=prompts)
    out = _greedy(engine, LayerSkipProposer(engine, exit_layer=exit_layer), k, prompts=prompts)
    assert out.output_ids == ref.output_ids
    assert out.stats.steps < ref.stats.steps or exit_layer == 1  # the deeper exit drafts usefully


SCHEDULES = [("constant", {}), ("heuristic", {"start": 2}), ("confidence", {"threshold": 0.5}),
             ("cost_aware", {}), ("cost_aware", {"min_k": 1, "start": 1})]


@pytest.mark.parametrize("batch", ["single", "ragged"])
@pytest.mark.parametrize("draft", ["self", "unrelated"])
@pytest.mark.parametrize("schedule, args", SCHEDULES, ids=[f"{s}{a}" for s, a in SCHEDULES])
def test_schedules_greedy_equal_autoregressive(engine_factory, unrelated_draft, batch, draft, schedule, args):
    engine = engine_factory("self" if draft == "self" else unrelated_draft)
    prompts = RAGGED_PROMPTS[:1] if batch == "single" else RAGGED_PROMPTS
    ref = _greedy(engine, prompts=prompts, n=40)
    sched = make_schedule(schedule, 6, **args)
    out = _greedy(engine, DraftModelProposer(engine), schedule=sched, prompts=prompts, n=40)
    assert out.output_ids == ref.output_ids
    assert max(out.stats.draft_lengths) <= 6
    if schedule == "heuristic" and draft == "self":
        assert out.stats.draft_lengths[:3] == [2, 4, 6]  # all accepted: +2 per step up to k_max


def test_schedules_work_with_the_other_proposers(deep_target):
    engine = Engine(deep_target, dtype="float32")
    ref = _greedy(engine, prompts=REPEATING)
    for name in ("heuristic", "confidence", "cost_aware"):
        for proposer in (NgramProposer(engine), LayerSkipProposer(engine, exit_layer=2)):
            out = _greedy(engine, proposer, schedule=make_schedule(name, 5), prompts=REPEATING)
            assert out.output_ids == ref.output_ids, (name, proposer.name)


def test_cost_aware_with_a_useless_draft_falls_back_to_plain_steps(engine_factory, unrelated_draft):
    engine = engine_factory(unrelated_draft)
    sched = make_schedule("cost_aware", 4, start=4)
    ref = _greedy(engine, prompts=RAGGED_PROMPTS, n=60)
    out = _greedy(engine, DraftModelProposer(engine), schedule=sched, prompts=RAGGED_PROMPTS, n=60)
    assert out.output_ids == ref.output_ids
    assert 0 in sched.history  # a draft accepted < 10% of the time never pays: some steps are plain


def test_confidence_stops_rows_independently(engine_factory, unrelated_draft):
    engine = engine_factory(unrelated_draft)
    out = _greedy(engine, DraftModelProposer(engine), schedule=make_schedule("confidence", 8, threshold=0.3))
    lengths = [n for n in out.stats.draft_lengths]
    assert min(lengths) < 8  # somewhere every row stopped early
    assert sum(r.proposed for r in out.stats.rows) < 8 * sum(r.steps for r in out.stats.rows)


@pytest.mark.parametrize("batch", ["single", "ragged"])
def test_confidence_without_early_exit_drafts_the_same(engine_factory, unrelated_draft, batch):
    """Off a CPU the draft runs its k passes and each row's stopping point stays on the device until
    the step's read: the same tokens and, once read, the same per-row statistics as stopping early."""
    engine = engine_factory(unrelated_draft)
    prompts = RAGGED_PROMPTS[:1] if batch == "single" else RAGGED_PROMPTS
    ref = _greedy(engine, prompts=prompts)
    runs = []
    for early_exit in (True, False):
        proposer = DraftModelProposer(engine)
        proposer.early_exit = early_exit
        runs.append(_greedy(engine, proposer, schedule=make_schedule("confidence", 8, threshold=0.3), prompts=prompts))
    assert runs[0].output_ids == runs[1].output_ids == ref.output_ids
    stats = [[(r.proposed, r.accepted, r.steps, r.draft_lengths) for r in out.stats.rows] for out in runs]
    assert stats[0] == stats[1] and sum(r.proposed for r in runs[1].stats.rows) > 0
    assert runs[0].stats.draft_lengths == runs[1].stats.draft_lengths


def test_ngram_finds_the_longest_most_recent_match():
    prop = NgramProposer(max_ngram=3, min_ngram=1)
    seqs = torch.tensor([
        [1, 2, 3, 9, 1, 2, 3, 7, 2, 3, 0, 0],  # suffix "2 3": "1 2 3" not a suffix; last "2 3" at 5 -> 7
        [4, 5, 6, 4, 5, 8, 4, 5, 6, 4, 5, 0],  # suffix "6 4 5" matches at 2 -> continue at 5 (8)
        [1, 2, 3, 4, 5, 0, 0, 0, 0, 0, 0, 0],  # no repeat -> nothing
        [7, 7, 7, 7, 0, 0, 0, 0, 0, 0, 0, 0],  # "7 7 7" at 0 -> continue at 3
    ])
    lens = torch.tensor([10, 11, 5, 4])
    start, found = prop.find(seqs, lens)
    assert found.tolist() == [True, True, False, True]
    assert start[found].tolist() == [7, 5, 3]


def test_ngram_proposes_per_row_lengths_and_nothing_without_a_match():
    from specdec.core.decoding import DecodeState
    from specdec.core.sampling import SamplingParams

    tokens = torch.tensor([[1, 2, 3, 1, 2, 0, 0], [1, 2, 3, 4, 5, 6, 0]])
    state = DecodeState(tokens, [5, 6], [3, 3], [True, True], 4, 7, SamplingParams(), torch.Generator())
    p = NgramProposer(max_ngram=2).propose(state, 4)
    assert p.lengths == [3, 0] and p.tokens[0].tolist() == [3, 1, 2]  # stops at the row's end
    state.tokens[0, 4] = 9
    assert NgramProposer().propose(state, 4).max_length == 0  # no row matched: a plain step


def test_early_exit_view_shares_the_targets_weights(deep_target):
    view = early_exit_view(deep_target, 2)
    assert len(view.model.layers) == 2 and len(deep_target.model.layers) == 4
    assert deep_target.config.num_hidden_layers == 4 and view.config.num_hidden_layers == 2
    assert {id(p) for p in view.parameters()} < {id(p) for p in deep_target.parameters()}
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        hidden = deep_target(x, output_hidden_states=True).hidden_states[2]
        want = deep_target.lm_head(deep_target.model.norm(hidden))
        torch.testing.assert_close(view(x).logits, want)


def test_layer_skip_refuses_bad_exit_layers_and_other_layouts(deep_target):
    with pytest.raises(ValueError, match="exit_layer"):
        early_exit_view(deep_target, 4)
    with pytest.raises(ValueError, match="keeps a list of layers and a final norm"):
        early_exit_view(torch.nn.Linear(2, 2), 1)
