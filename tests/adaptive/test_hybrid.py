"""The hybrid proposer: a choice per step among lookups, a draft model and a trained tree drafter,
that chooses the part that pays, passes over one that does not, reports its choices and regret, and
stays lossless (float32 greedy token identity at batch 1 and ragged 3, with a tree part too; the
sampling distribution)."""

import functools

import pytest

from specdec.adaptive.hybrid import LEAD_EVIDENCE, SWITCH, HybridProposer
from specdec.adaptive.policy import Planner
from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.models import tiny_random_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.ngram import NgramProposer
from specdec.proposers.suffix import SuffixProposer
from tests.adaptive.test_policy import REPEATING, _fed
from tests.conftest import RAGGED_PROMPTS
from tests.proposers.test_strategies_lossless import N, _sample_pairs, draft, expected, target  # noqa: F401
from tests.proposers.test_tree_eagle import TINY_EAGLE
from tests.stats import chi_square_pvalue

K = 4


def _parts(draft_kind: str = "model"):
    """name -> factory(engine=...): the way Hydra passes `_partial_: true` parts."""
    parts = {"suffix": lambda engine: SuffixProposer(max_spec_factor=2.0), "ngram": NgramProposer}
    if draft_kind == "model":
        parts["draft"] = DraftModelProposer
    return parts


def _hybrid(engine, b: int, parts=None, draft_s=None, accept: float = 0.5) -> HybridProposer:
    """A hybrid whose planner was told costs at batch size b, so often that this run's own clocks
    cannot outvote them: flat scoring, free lookups accepted half the time, and the draft part's
    drafting `draft_s(k)` and acceptance `accept`. Every row's tokens count (`throughput`), so that
    a lookup offering in some rows of a batch is chosen too (as `makespan`, the row without an
    offer makes it worth no more than a plain step)."""
    h = HybridProposer(engine, parts or _parts(), window=512, objective="throughput")
    planner = h._planner(K)
    for name in h.parts:
        drafting, a = (draft_s, accept) if name == "draft" else (lambda k: 0.0, 0.5)
        _fed(planner, a, lambda t: 0.01, drafting, b=b, source=name, rounds=300)
    return h


@pytest.mark.parametrize("batch", ["single", "ragged"])
@pytest.mark.parametrize("draft_kind", ["self", "unrelated"])
@pytest.mark.parametrize("costs", ["measured", "told"])
def test_hybrid_greedy_equals_autoregressive(engine_factory, unrelated_draft, target_time, batch, draft_kind, costs):
    engine = engine_factory("self" if draft_kind == "self" else unrelated_draft)
    if costs == "measured":
        target_time(engine)  # measured on a clock that a loaded machine cannot make drafting look slow on
    base = REPEATING if batch == "ragged" else REPEATING[:1]
    plain = SpeculativeDecoder(engine)
    hybrid = HybridProposer(engine, _parts()) if costs == "measured" else \
        _hybrid(engine, len(base), draft_s=lambda k: 0.001 * k, accept=0.45)  # beats lookups offering < 3
    dec = SpeculativeDecoder(engine, hybrid, num_speculative_tokens=K)
    chosen = set()
    for turn in range(3):  # requests in sequence: the suffix part learns from earlier outputs
        prompts = [p + [30 + turn] for p in base]
        ref, out = plain.generate(prompts, max_new_tokens=40), dec.generate(prompts, max_new_tokens=40)
        assert out.output_ids == ref.output_ids and out.lossless
        report = out.reports["proposer"]
        assert len(report["choices"]) == out.stats.steps and sum(report["counts"].values()) == out.stats.steps
        chosen |= set(report["choices"])
    assert chosen - {"plain"}  # some part drafted
    if costs == "told":
        assert "draft" in chosen and chosen & {"suffix", "ngram"}  # it switched between kinds of parts


def test_it_passes_over_a_draft_that_costs_a_target_step_per_token(engine_factory):
    engine = engine_factory("self")
    hybrid = _hybrid(engine, 1, draft_s=lambda k: 0.01 * k, accept=0.95)  # each draft costs a whole step
    dec = SpeculativeDecoder(engine, hybrid, num_speculative_tokens=K)
    out = dec.generate(RAGGED_PROMPTS[:1], max_new_tokens=60)
    counts = out.reports["proposer"]["counts"]
    assert counts["draft"] <= 0.2 * out.stats.steps  # exploring only
    assert out.reports["proposer"]["regret"] is not None


def test_it_picks_a_cheap_good_draft_when_lookups_find_nothing(engine_factory):
    engine = engine_factory("self")
    hybrid = _hybrid(engine, 1, draft_s=lambda k: 0.0005 * k, accept=0.95)
    dec = SpeculativeDecoder(engine, hybrid, num_speculative_tokens=K)
    out = dec.generate([[200, 201, 202, 203]], max_new_tokens=40)
    report = out.reports["proposer"]
    assert report["counts"]["draft"] >= 0.6 * out.stats.steps
    assert report["best_in_hindsight"] == "draft" and report["regret"] < 0.2


def test_a_draft_model_as_costly_as_the_target_is_never_run(engine_factory):
    # The target drafting for itself: priced at its share of the target's parameters (1.0) before
    # any measurement, a draft token costs a plain step and can never pay, so it is not even tried.
    engine = engine_factory("self")
    hybrid = HybridProposer(engine, _parts(), window=512)
    assert hybrid.hints == {"draft": pytest.approx(1.0)}
    for name in ("suffix", "ngram"):  # widths told flat (tiny models' clocks are noise); the draft left untimed
        _fed(hybrid._planner(K), 0.5, lambda t: 0.01, b=len(REPEATING), source=name, rounds=300)
    dec = SpeculativeDecoder(engine, hybrid, num_speculative_tokens=K)
    for turn in range(2):
        prompts = [p + [30 + turn] for p in REPEATING]
        out = dec.generate(prompts, max_new_tokens=30)
        assert out.output_ids == SpeculativeDecoder(engine).generate(prompts, max_new_tokens=30).output_ids
        assert out.reports["proposer"]["counts"]["draft"] == 0


def test_a_small_draft_model_is_priced_at_its_share_of_the_target(engine_factory, unrelated_draft):
    engine = engine_factory(unrelated_draft)  # 1 layer against the target's 2
    ratio = sum(p.numel() for p in unrelated_draft.parameters()) / sum(
        p.numel() for p in engine.target.model.parameters())
    hybrid = HybridProposer(engine, _parts())
    assert 0 < ratio < 1 and hybrid.hints == {"draft": pytest.approx(ratio)}
    assert hybrid._planner(K).costs.draft_cost("draft", 1, 3) == pytest.approx(3 * ratio)  # until measured


def test_it_follows_a_part_that_does_better_alone_and_comes_back_when_switching_pays(engine_factory):
    hybrid = HybridProposer(engine_factory(), _parts(draft_kind="none"))
    hybrid._planner(K)
    hybrid._step = {"follow": SWITCH}
    for _ in range(10):  # switching 1.2 tokens per plain step, suffix alone 1.5, n-gram alone 1.1
        hybrid._stand(1, {SWITCH: (1.2, 1.0), "suffix": (1.5, 1.0), "ngram": (1.1, 1.0)})
    assert hybrid.follow.get(1, SWITCH) == SWITCH  # under LEAD_EVIDENCE plain steps: not yet
    for _ in range(int(LEAD_EVIDENCE)):
        hybrid._stand(1, {SWITCH: (1.2, 1.0), "suffix": (1.5, 1.0), "ngram": (1.1, 1.0)})
    assert hybrid.follow[1] == "suffix" and 4 not in hybrid.follow  # per batch size
    for _ in range(300):  # switching now does better than suffix alone
        hybrid._stand(1, {SWITCH: (1.8, 1.0), "suffix": (1.5, 1.0), "ngram": (1.1, 1.0)})
    assert hybrid.follow[1] == SWITCH


@pytest.mark.parametrize("standing", ["request", "batch_size"])
def test_the_leader_is_chosen_per_request_or_kept_across_requests(engine_factory, standing):
    engine = engine_factory()
    hybrid = HybridProposer(engine, _parts(draft_kind="none"), standing=standing)
    dec = SpeculativeDecoder(engine, hybrid, num_speculative_tokens=K)
    dec.generate(REPEATING[:1], max_new_tokens=4)  # sets the planner up
    hybrid._step = {"follow": SWITCH}
    for _ in range(int(LEAD_EVIDENCE) + 10):  # suffix alone leads
        hybrid._stand(1, {SWITCH: (1.2, 1.0), "suffix": (1.5, 1.0), "ngram": (1.1, 1.0)})
    assert hybrid.follow[1] == "suffix"
    dec.generate(REPEATING[:1], max_new_tokens=4)  # a new request: 3 steps, too few to lead again
    assert hybrid.follow.get(1, SWITCH) == (SWITCH if standing == "request" else "suffix")
    with pytest.raises(ValueError, match="standing"):
        HybridProposer(engine, _parts(draft_kind="none"), standing="forever")


def test_following_one_part_chooses_only_that_part_or_plain_and_keeps_the_output(engine_factory):
    engine = engine_factory()
    hybrid = _hybrid(engine, len(REPEATING), _parts(draft_kind="none"))
    hybrid.standing_scope = "batch_size"  # what it follows is kept across the requests below
    hybrid.follow[len(REPEATING)] = "ngram"
    hybrid.standing[len(REPEATING)] = {"ngram": [1e9, 1e8], SWITCH: [1e8, 1e8]}  # n-gram leads by far
    ref = SpeculativeDecoder(engine).generate(REPEATING, max_new_tokens=30)
    out = SpeculativeDecoder(engine, hybrid, num_speculative_tokens=K).generate(REPEATING, max_new_tokens=30)
    assert out.output_ids == ref.output_ids
    report = out.reports["proposer"]
    assert set(report["choices"]) == {"ngram", "plain"} and report["followed"].get("ngram", 0) > 0
    assert set(report["followed"]) <= {"ngram", SWITCH}


def test_parts_must_be_given_and_plain_is_reserved(engine_factory):
    with pytest.raises(ValueError, match="at least one proposer"):
        HybridProposer(engine_factory(), {})
    with pytest.raises(ValueError, match="'plain'"):
        HybridProposer(engine_factory(), {"plain": NgramProposer})
    with pytest.raises(ValueError, match="method.proposer: objective"):  # before any step runs
        HybridProposer(engine_factory(), {"ngram": NgramProposer}, objective="latency")


@pytest.mark.parametrize("accept, expect", [(0.9, "draft"), (0.02, "ngram")])
def test_hybrid_sampling_is_lossless(target, draft, expected, accept, expect):  # noqa: F811
    engine = Engine(target, draft, dtype="float32")
    parts = {"ngram": lambda engine: NgramProposer(engine, max_ngram=2), "draft": DraftModelProposer}
    hybrid = _hybrid(engine, N, parts, draft_s=lambda k: 0.0001 * k, accept=accept)
    counts, stats = _sample_pairs(engine, hybrid, k=2)
    assert expect in hybrid.choices and 0.05 < stats.acceptance_rate < 0.95
    assert chi_square_pvalue(counts, expected) > 1e-3


def test_a_tree_part_is_priced_at_its_node_width_whatever_its_depth():
    planner = Planner(4)
    planner.nodes["tree"] = 5
    _fed(planner, 0.6, lambda t: 0.01 * (1 + 0.2 * (t - 1)), b=1, source="tree")  # widths up to 5 measured
    plans = planner._plans("tree", 1, [0], 3, 0.0, asked=True)
    assert plans[0].cost == pytest.approx(1.0)
    assert [p.cost for p in plans[1:]] == pytest.approx([planner.rest(1, 6)] * 3)  # 1 + 5 nodes at any depth
    assert planner._plans("chain", 1, [0], 2, 0.0, asked=True)[1].cost == pytest.approx(planner.rest(1, 2))
    assert planner.best_ask("tree", 1, [0], trimmable=False) is not None
    planner.nodes["tree"] = 9  # wider than anything measured: not asked (widths are learned upwards)
    assert planner.best_ask("tree", 1, [0], trimmable=False) is None


def test_a_tree_is_valued_at_its_whole_width_even_when_drafts_could_be_cut():
    # The hybrid asks with trimmable=True when decoding greedily (a chain may be cut after
    # proposing); a tree never is. Valued at its best cut, a tree losing at batch 16 was priced at
    # plain scoring plus its drafting (1.15 plain steps against 2.8), so exploring it, budgeted at 1%
    # of the time, cost about 4% (EAGLE explored every 30 steps, each step 2.1 plain steps).
    planner = Planner(4)
    planner.nodes["tree"] = 4
    _fed(planner, 0.3, lambda t: 0.01 * (1 + 0.4 * (t - 1)), lambda k: 0.001, b=16, source="tree")
    rows = list(range(16))
    for trimmable in (False, True):
        plan = planner.best_ask("tree", 16, rows, trimmable=trimmable)
        assert plan.cost == pytest.approx(planner.costs.draft_cost("tree", 16, plan.k) + planner.rest(16, 5))
        assert plan.tokens > len(rows)  # valued with its drafts, not as a plain step


def test_a_deterministic_draft_is_scored_at_the_width_it_was_valued_at(engine_factory):
    # Drafting costs the same for any k (so asking more is free) but a step scoring more than 2
    # tokens a row costs t plain steps: asked k_max, the draft is worth its first token only. The
    # hybrid cut it to the k it asked for, and scored every draft.
    engine = engine_factory("self")
    hybrid = HybridProposer(engine, {"draft": DraftModelProposer}, window=512)
    planner = hybrid._planner(K)
    _fed(planner, 0.9, lambda t: 0.01 if t <= 2 else 0.01 * t, lambda k: 0.0002, source="draft", rounds=300)
    assert not planner.is_cheap("draft", 1) and planner.best_ask("draft", 1, [0], trimmable=True).k == K
    out = SpeculativeDecoder(engine, hybrid, num_speculative_tokens=K).generate(RAGGED_PROMPTS[:1], max_new_tokens=30)
    assert out.output_ids == SpeculativeDecoder(engine).generate(RAGGED_PROMPTS[:1], max_new_tokens=30).output_ids
    assert out.reports["proposer"]["counts"]["draft"] > 0 and max(out.stats.draft_lengths) == 1


def _tree_parts() -> dict:
    return {"suffix": lambda engine: SuffixProposer(max_spec_factor=2.0),
            "eagle": functools.partial(EagleProposer, heads_path=str(TINY_EAGLE), budget=4, topk=2, width=2, depth=2)}


def _with_tree_part(engine, b: int, told: bool) -> HybridProposer:
    hybrid = HybridProposer(engine, _tree_parts(), window=512)
    planner = hybrid._planner(K)
    if told:  # the tree part drafts cheaply and is accepted often: it should be chosen
        for name, accept in (("suffix", 0.3), ("eagle", 0.9)):
            _fed(planner, accept, lambda t: 0.01, lambda k: 0.0005 * k, b=b, source=name, rounds=300)
    else:  # flat widths, learned by the chain part; the tree part never timed: tried, since its width pays
        _fed(planner, None, lambda t: 0.01, b=b, source="suffix")
    return hybrid


@pytest.mark.parametrize("batch", ["single", "ragged"])
@pytest.mark.parametrize("told", [False, True])
def test_hybrid_with_a_tree_part_equals_autoregressive(batch, told):
    engine = Engine(tiny_random_model(seed=0, eos_token_id=None), dtype="float32")
    base = REPEATING if batch == "ragged" else REPEATING[:1]
    hybrid = _with_tree_part(engine, len(base), told)
    assert hybrid.trees == {"eagle": 4} and hybrid._planner(K).nodes == {"eagle": 4}
    dec = SpeculativeDecoder(engine, hybrid, num_speculative_tokens=K)
    chosen = []
    for turn in range(2):
        prompts = [p + [30 + turn] for p in base]
        out = dec.generate(prompts, max_new_tokens=30)
        assert out.output_ids == SpeculativeDecoder(engine).generate(prompts, max_new_tokens=30).output_ids
        chosen += out.reports["proposer"]["choices"]
    assert "eagle" in chosen  # the tree part drafted (tried untimed where its width pays; chosen when told it pays)
    if told:  # chosen while the estimates favour it (this random drafter's real acceptance is low:
        assert chosen[:4] == ["eagle"] * 4  # the hybrid then follows what did better, tested above)


def test_an_untimed_tree_part_waits_for_a_width_that_could_pay():
    """A tree's first try scores its whole width: where widths are dear and only 2 tokens a row
    were ever scored, the tree part is not tried blind (a chain would be, one token)."""
    engine = Engine(tiny_random_model(seed=0, eos_token_id=None), dtype="float32")
    hybrid = HybridProposer(engine, _tree_parts(), window=512)
    planner = hybrid._planner(K)
    for _ in range(300):  # a second token a row costs two plain steps more
        planner.costs.add_step(1, 1, 0.01)
        planner.costs.add_step(1, 2, 0.03, [("suffix", 1, 0.0, True)])
    prompts = REPEATING[:1]
    out = SpeculativeDecoder(engine, hybrid, num_speculative_tokens=K).generate(prompts, max_new_tokens=30)
    assert out.output_ids == SpeculativeDecoder(engine).generate(prompts, max_new_tokens=30).output_ids
    assert "eagle" not in out.reports["proposer"]["choices"] and planner.costs.blind("eagle", 1)


def test_a_part_without_heads_is_left_out(engine_factory):
    engine = engine_factory("self")
    parts = {"suffix": lambda engine: SuffixProposer(), "eagle": functools.partial(EagleProposer, heads_path=None)}
    assert list(HybridProposer(engine, parts).parts) == ["suffix"]
    with pytest.raises(ValueError, match="every part was left out"):
        HybridProposer(engine, {"eagle": functools.partial(EagleProposer, heads_path=None)})
