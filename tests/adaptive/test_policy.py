"""The cost-aware policy (`method.schedule=cost_aware`): its decisions on synthetic costs (it must
choose 0 drafts when drafting cannot pay), its estimators, and its losslessness: float32 greedy
token identity at batch sizes 1 and ragged 3 with every kind of proposer (trees included), and the sampling
distribution with a cut deterministic draft, with a sampled draft model and with suffix trees."""

import math
from types import SimpleNamespace

import pytest
import torch

from specdec.adaptive.policy import AcceptanceModel, CostModel, Plan, Planner, StepClock, Timings, drafting
from specdec.adaptive.schedules import CostAwareSchedule
from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.core.schedules import make_schedule
from specdec.proposers.base import Proposal
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.ngram import NgramProposer
from specdec.proposers.suffix import SuffixProposer, SuffixTreeProposer
from tests.conftest import RAGGED_PROMPTS
from tests.proposers.test_strategies_lossless import (  # noqa: F401
    BRANCHING,
    PARAMS,
    N,
    V,
    _sample_pairs,
    draft,
    expected,
    target,
)
from tests.proposers.test_tree_eagle import TINY_EAGLE
from tests.stats import chi_square_pvalue, exact_joint_of_tokens_2_and_3

SRC = "proposer"


def _fed(planner: Planner, accept: float | None, rest, drafting=None, b: int = 1, source: str = SRC,
         rounds: int = 3) -> Planner:
    """`planner` told: acceptance `accept` at every position, rest-of-step seconds rest(T) for every
    width, drafting seconds drafting(k) (none: free), all at batch size b, as if measured `rounds` times."""
    k = planner.k_max
    for _ in range(rounds):
        for t in range(2, k + 2):  # a plain step, then one drafting t - 1 and scoring t
            planner.costs.add_step(b, 1, rest(1))
            planner.costs.add_step(b, t, rest(t), [(source, t - 1, drafting(t - 1) if drafting else 0.0, True)])
    if accept is not None:  # else acceptance is left to learn from the run
        m = planner.model(source)
        m.reached, m.accepted = [1e6] * k, [1e6 * accept] * k
        m.asked, m.offered = [1e6] * k, [1e6] * k
    return planner


def test_it_picks_the_k_that_maximises_tokens_per_second():
    rows = [0]
    # The classic optimum: alpha = 0.8, c = 0.1, flat verification -> argmax (1 - a^(k+1)) / ((1-a)(ck + 1)).
    a, c = 0.8, 0.1
    best = max(range(9), key=lambda k: (1 - a ** (k + 1)) / ((1 - a) * (c * k + 1)))
    for trimmable in (False, True):
        p = _fed(Planner(8, cheap=0.0), a, lambda t: 0.04, lambda k: 0.004 * k)
        assert p.ask(SRC, 1, rows, trimmable).k == best == 6
    assert _fed(Planner(8), 0.8, lambda t: 0.04).ask(SRC, 1, rows, False).k == 8  # free drafting: all
    # Verification that grows with width pushes k down.
    assert _fed(Planner(8, cheap=0.0), 0.8, lambda t: 0.03 + 0.01 * t, lambda k: 0.004 * k).ask(
        SRC, 1, rows, False).k < best


def test_it_chooses_zero_when_drafting_cannot_pay():
    rows = list(range(16))
    # A useless draft that costs something.
    assert _fed(Planner(8, explore=0), 0.0, lambda t: 0.04, lambda k: 0.005 * k).ask(SRC, 1, [0], False).k == 0
    assert _fed(Planner(8, min_k=1), 0.0, lambda t: 0.04, lambda k: 0.005 * k).ask(SRC, 1, [0], False).k == 1
    # The target drafting for itself: every draft accepted, but each costs a target step.
    assert _fed(Planner(8, explore=0), 0.99, lambda t: 0.03, lambda k: 0.03 * k).ask(SRC, 1, [0], False).k == 0
    # Free lookups, but at batch 16 every extra scored position costs half a plain step and only
    # 30% of drafts are accepted: the same proposal is cut to nothing at batch 16, kept at batch 1.
    steep = _fed(Planner(8, explore=0), 0.3, lambda t: 0.1 * (1 + 0.5 * (t - 1)), b=16)
    assert steep.keep(SRC, 16, rows, [4] * 16, asked=8).k == 0
    flat = _fed(Planner(8, explore=0), 0.3, lambda t: 0.03, b=1)
    assert flat.keep(SRC, 1, [0], [4], asked=8).k == 4


def test_a_gain_below_the_margin_is_not_taken():
    p = _fed(Planner(8, explore=0, margin=0.05), 0.04, lambda t: 0.04 * (1 + 0.01 * (t - 1)))
    assert p.keep(SRC, 1, [0], [1], asked=8).k == 0  # 1.04 tokens for 1.01x the time: +3% < 5%
    p.margin = 0.0
    assert p.keep(SRC, 1, [0], [1], asked=8).k == 1


def test_a_step_of_a_static_batch_is_worth_what_it_takes_off_its_longest_row():
    p = Planner(8)  # makespan, the default
    assert p.worth([3.0, 1.0], [64, 64]) == 2.0  # rows level: the batch ends no sooner, a plain step's worth
    assert p.worth([3.0, 1.0], [64, 3]) == 6.0  # row 0 is the longest: 3 tokens off it, for each of 2 rows
    assert p.worth([3.0, 1.0], [10, 64]) == 2.0  # row 1 is the longest, and gained one token
    assert p.worth([1.0, 1.0, 1.0], [5, 9, 2]) == 3.0  # a plain step: one per row, whatever is left
    assert p.worth([3.0, 2.0], None) == 4.0  # rows alike: the fewest tokens of any row, per row
    assert Planner(8, objective="throughput").worth([3.0, 1.0], [64, 64]) == 4.0
    with pytest.raises(ValueError, match="objective"):
        Planner(8, objective="latency")
    with pytest.raises(ValueError, match="schedule_args: objective"):
        CostAwareSchedule(8, objective="latency")


def test_drafts_in_rows_that_end_first_do_not_pay_in_a_static_batch():
    def planner(objective: str) -> Planner:  # batch 2; a scored token costs 10% of a plain step
        return _fed(Planner(8, explore=0, objective=objective), 0.8, lambda t: 0.04 * (1 + 0.1 * (t - 1)), b=2)
    # Row 0 offers 4 drafts, row 1 none. Counted as throughput, they pay.
    assert planner("throughput").keep(SRC, 2, {0: 64, 1: 64}, [4, 0], asked=8).k == 4
    # Both rows have 64 tokens to go: row 0's drafts do not bring the batch's end any closer.
    assert planner("makespan").keep(SRC, 2, {0: 64, 1: 64}, [4, 0], asked=8).k == 0
    # Row 1 is nearly done: row 0 is the one the batch waits for, and its drafts shorten the wait.
    assert planner("makespan").keep(SRC, 2, {0: 64, 1: 3}, [4, 0], asked=8).k == 4
    # Asking is valued the same way: a draft model whose drafts pay for both rows alike.
    both = planner("makespan")
    assert both.best_ask(SRC, 2, {0: 64, 1: 64}, trimmable=False).k > 0


def _state(b: int, room: int = 64) -> SimpleNamespace:
    """A batch of b rows decoding, each with `room` tokens left to emit."""
    return SimpleNamespace(batch_size=b, active=[True] * b, open_rows=lambda: dict.fromkeys(range(b), room))


def test_rows_keep_their_own_drafts_up_to_the_chosen_width():
    # every row's tokens count (as makespan, row 0's empty offer would make any width worthless)
    sched = CostAwareSchedule(8, explore=0.0, objective="throughput")
    # widths up to 4 cost the same, wider ones three times as much: keep 3 drafts
    _fed(sched.planner, 0.9, lambda t: 0.03 if t <= 4 else 0.09, b=3, source=sched.source)
    state = _state(3)
    proposal = Proposal(torch.arange(15).view(3, 5), [0, 5, 2])
    sched._asked = 8
    out = sched.trim(state, proposal)
    assert out.lengths == [0, 3, 2] and out.tokens.tolist() == [[0, 1, 2], [5, 6, 7], [10, 11, 12]]
    sampled = Proposal(proposal.tokens, proposal.lengths, torch.full((3, 5, 16), 1 / 16))
    assert sched.trim(state, sampled) is sampled  # a sampled draft is never cut after the fact


def test_the_first_step_at_a_new_batch_size_is_plain_then_it_tries_drafting():
    sched = CostAwareSchedule(8, start=2)
    state = _state(4)
    assert sched.next_k(state) == 0
    sched.planner.costs.add_step(4, 1, 0.05)
    assert sched.next_k(state) == 2  # the proposer's cost at this batch size is unknown: try `start`


def test_it_explores_once_every_ceil_of_loss_plus_margin_over_budget_steps():
    p = Planner(8, margin=0.02, explore=0.01)
    plain, worse = Plan(0, 1.0, 1.0), Plan(1, 1.8, 2.0)  # drafting predicted 10% slower, over 2 plain steps
    period = math.ceil((2.0 * 0.1 + 0.02) / 0.01)  # 0.2 plain steps wasted per try: 1 try in 22
    chosen = []
    for _ in range(3 * period):
        p.next_step()
        name, _ = p.choose([(SRC, worse)], plain)
        chosen.append(name)
        if name is not None:
            p.observe(SRC, {0: (0, 1)})  # a verdict on its drafts
    explored = [i + 1 for i, n in enumerate(chosen) if n is not None]
    assert explored == [period, 2 * period, 3 * period]


def _recovery(optimism: float, early: int, rate: float = 0.45, steps: int = 300) -> tuple[int, int | None]:
    """A drafter that pays (one draft, a third of a plain step to draft it, accepted at `rate`), whose
    first `early` drafts are all rejected: (steps that drafted, the first step of 20 drafting in a
    row, None if never). Verdicts after the early ones follow a fixed stream of that rate."""
    p = _fed(Planner(1, optimism=optimism), None, lambda t: 0.03, lambda k: 0.01 * k)
    judged, drafted = 0, []
    for _ in range(steps):
        p.next_step()
        k = p.ask(SRC, 1, [0], trimmable=False).k
        p.stepped(1, 1 + k)
        drafted.append(k > 0)
        if k > 0:
            judged += 1
            j = judged - early
            p.observe(SRC, {0: (int(j > 0 and int(j * rate) > int((j - 1) * rate)), 1)})
    steady = next((i for i in range(steps - 20) if all(drafted[i:i + 20])), None)
    return sum(drafted), steady


def test_an_estimate_pulled_down_by_early_rejections_recovers():
    """Exploring values a passed-over plan at an optimistic acceptance, so a few early rejections do
    not make their own correction rare. At the estimate itself (optimism=0) the drafter, worth 1.45
    tokens for 1.33 plain steps, stays priced out for most of the run: the lower the estimate,
    the rarer the tries that could correct it (59 drafting steps of 300 against 180)."""
    drafted, steady = _recovery(1.0, early=4)
    assert steady is not None and steady < 160 and drafted > 160
    drafted0, steady0 = _recovery(0.0, early=4)
    assert (steady0 is None or steady0 > 250) and drafted0 < 80
    assert _recovery(1.0, early=5)[1] is not None and _recovery(0.0, early=5)[1] is None
    # a drafter that does not pay (accepted at 0.1) is still explored rarely
    assert _recovery(1.0, early=0, rate=0.1)[0] < 20


def test_a_policy_that_always_drafts_takes_a_plain_probe_step_now_and_then():
    p = _fed(Planner(8, probe=5), 0.9, lambda t: 0.03)  # drafting pays: every step drafts
    p.stepped(1, 1)
    chosen = []
    for _ in range(12):
        p.next_step()
        k = p.ask(SRC, 1, [0], trimmable=True).k
        chosen.append(k)
        p.stepped(1, 1 + k)
    assert chosen == [8, 8, 8, 8, 0, 8, 8, 8, 8, 0, 8, 8]


def test_widths_are_learned_upwards_one_at_a_time():
    # At batch 16 a wide step costs several plain steps (3.4 for T = 7 on the embedded target);
    # with only plain steps measured, a first speculative step keeps one draft per row, however
    # good the drafts look, and each measured width allows the next one.
    p = Planner(8, explore=0)
    p.model(SRC).reached, p.model(SRC).accepted = [1e6] * 8, [0.95e6] * 8
    rows = list(range(16))
    p.costs.add_step(16, 1, 0.1)
    assert p.widest(16) == 1 and p.keep(SRC, 16, rows, [8] * 16, asked=8).k == 1
    p.costs.add_step(16, 2, 0.13)  # T = 2: 1.3 plain steps
    assert p.widest(16) == 2 and p.keep(SRC, 16, rows, [8] * 16, asked=8).k == 2
    # beyond the widest: linear in the cost, not exponential (log space would give 1.3^2 = 1.69 at T = 3)
    assert p.costs.rest(16, 3) == pytest.approx(1.6) and p.costs.rest(16, 9) == pytest.approx(3.4)
    assert p.best_ask(SRC, 16, rows, trimmable=False).k <= 2  # asking is capped the same way
    assert Planner(8, min_k=3).widest(16) == 3  # a forced minimum is always allowed


def test_a_tree_takes_a_width_measured_at_a_smaller_batch_size():
    # A tree is never cut, so its width cannot be learned upwards a token at a time: with only plain
    # steps measured at batch 4, EAGLE + policy drafted no step there (nor at 16), whatever it was
    # worth. A smaller batch size's cost of that width prices it from below.
    p = Planner(4, explore=0)
    p.nodes[SRC] = 4  # every tree scores 4 drafts: T = 5
    _fed(p, 0.9, lambda t: 0.01 * (1 + 0.02 * (t - 1)), lambda k: 0.0005 * k, b=1)  # widths up to 5, nearly free
    rows = list(range(4))
    p.costs.add_step(4, 1, 0.02)
    assert p.costs.widest(4) == 1 and p.reachable(SRC, 4)
    assert p.costs.rest(4, 5) == pytest.approx(p.costs.rest(1, 5)) and p.costs.rest(1, 5) > 1.0
    assert p.ask(SRC, 4, rows, trimmable=False).k > 0
    no_smaller = Planner(4, explore=0)
    no_smaller.nodes[SRC] = 4
    no_smaller.costs.add_step(4, 1, 0.02)
    assert not no_smaller.reachable(SRC, 4) and no_smaller.best_ask(SRC, 4, rows, trimmable=False) is None
    # Measured dearer at batch 4: its own cost there, and the floor for batch 16 (the largest smaller size).
    p.costs.add_step(4, 5, 0.08)
    assert p.costs.rest(4, 5) == pytest.approx(4.0) and p.costs.floor(16, 5) == pytest.approx(4.0)
    assert p.ask(SRC, 4, rows, trimmable=False).k == 0  # priced at 1 + 3 x 2.5 plain steps, for 4.1 tokens a row
    assert p.costs.floor(2, 9) is None  # nothing that wide measured below


def test_asking_is_worth_its_best_width_of_one_draft_or_more():
    # Keeping none of the drafts asked for is a plain step with the drafting wasted, never a plan:
    # valued as one, a chain that loses at batch 16 (T = 2: 1.3 plain steps) looked nearly free to
    # explore (1.03 plain steps for 16 tokens), was explored every 5 steps and scored at width 2.
    p = _fed(Planner(4), 0.3, lambda t: 0.01 * (1 + 0.3 * (t - 1)), lambda k: 0.0003 * k, b=16)
    rows = list(range(16))
    plan = p.best_ask(SRC, 16, rows, trimmable=True)
    assert plan.tokens > len(rows) and plan.cost > p.rest(16, 2)
    assert p.ask(SRC, 16, rows, trimmable=True).k == 0  # it loses: plain


def test_one_stalled_step_does_not_stop_drafting_for_good():
    # Plain steps cost 0.03 s, a 2-wide step 0.031 s, but the first 2-wide step stalled for 0.5 s:
    # 17 plain steps. It rules drafting out only once it has been measured `confirm` times.
    def run(confirm: int, stall: float = 0.5) -> list[int]:
        p = Planner(8, confirm=confirm)
        m = p.model(SRC)
        m.reached, m.accepted = [1e3] * 8, [0.9e3] * 8  # drafts that pay when a step costs what it should
        p.costs.add_step(1, 1, 0.03)
        p.costs.add_step(1, 2, 0.031 + stall)
        chosen = []
        for _ in range(40):
            p.next_step()
            k = p.keep(SRC, 1, [0], [8], asked=8).k
            chosen.append(k)
            p.costs.add_step(1, 1 + k, 0.03 + 0.001 * k)
            p.stepped(1, 1 + k)
            if k:
                p.observe(SRC, {0: (k, k)})
        return chosen

    assert run(confirm=1) == [0] * 40  # the first measurement decided: drafting never came back
    chosen = run(confirm=3)
    assert chosen[:4] == [0, 1, 0, 1]  # measured again twice, each time after a plain step
    assert chosen[-10:] == [8] * 10  # then drafting, wider as widths are learned
    assert run(confirm=3, stall=0.0) == run(confirm=1, stall=0.0)  # without a stall: the same choices
    # a width measured above t plain steps that really costs that is confirmed at most confirm - 1
    # more times; one measured within t plain steps (possible, if costly) is taken at its word
    for seconds, choices in ((0.075, [0, 1, 0, 1] + [0] * 16), (0.057, [0] * 20)):
        p = Planner(8, confirm=3, explore=0)
        p.model(SRC).reached, p.model(SRC).accepted = [1e3] * 8, [0.1e3] * 8
        p.costs.add_step(1, 1, 0.03)
        p.costs.add_step(1, 2, seconds)
        chosen = []
        for _ in range(20):
            k = p.keep(SRC, 1, [0], [8], asked=8).k
            chosen.append(k)
            p.costs.add_step(1, 1 + k, 0.03 if k == 0 else seconds)
        assert chosen == choices, seconds
    with pytest.raises(ValueError, match="confirm"):
        Planner(8, confirm=0)


def test_the_first_step_of_each_shape_is_not_measured(monkeypatch):
    # The embedded target's first plain step at batch 2 took 39 ms, the next ones 26-30 (kernels
    # built for new shapes). Taken as the reference, it priced the first 2-wide step (33 ms) at 0.85
    # plain steps: drafting looked cheaper than not drafting.
    now = [0.0]
    monkeypatch.setattr("specdec.adaptive.policy.time.perf_counter", lambda: now[0])
    costs, clock = CostModel(), StepClock()
    for b, t, seconds in [(2, 1, 0.039), (2, 2, 0.033), (2, 1, 0.027), (2, 2, 0.033), (2, 1, 0.027)]:
        clock.tick(costs)
        clock.done(b, t, 0.0, [])
        now[0] += seconds
        if len(clock.shapes) < 2:
            assert not costs.ready(2)  # nothing measured yet: the policy's steps stay plain
    clock.tick(costs)
    assert costs.measured[2] == {1: 2, 2: 1} and costs.rest(2, 2) == pytest.approx(0.033 / 0.027)
    clock.reset()  # a new generation: the shapes stay known
    clock.tick(costs)
    clock.done(2, 1, 0.0, [])
    now[0] += 0.027
    clock.tick(costs)
    assert costs.measured[2][1] == 3


def test_one_stalled_drafting_step_does_not_stop_drafting_for_good():
    # A draft model whose token costs a tenth of a plain step, but whose first measured draft
    # stalled (0.5 s against a 0.03 s plain step): priced at 17 plain steps a token, it could not pay
    # even if always accepted, so it was neither chosen nor explored, and never measured again.
    def run(confirm: int, switch_s: float = 0.0) -> list[int]:
        p = _fed(Planner(8, confirm=confirm), None, lambda t: 0.03, source="other")  # widths: flat, known
        m = p.model(SRC)
        m.reached, m.accepted = [1e3] * 8, [0.9e3] * 8
        p.costs.add_step(1, 2, 0.03, [(SRC, 1, 0.5, True)])
        chosen, before = [], True
        for _ in range(30):
            p.next_step()
            k = p.ask(SRC, 1, [0], trimmable=False, switching=not before).k
            chosen.append(k)
            p.costs.add_step(1, 1 + k, 0.03, [(SRC, k, 0.003 * k + (0 if before else switch_s), before)])
            p.stepped(1, 1 + k)
            if k:
                p.observe(SRC, {0: (k, k)})
            before = k > 0
        return chosen

    assert run(confirm=1) == [0] * 30
    chosen = run(confirm=3)
    assert chosen[:2] == [1, 1] and min(chosen[2:]) > 1  # measured again twice, then drafting pays
    # after a pause a step also catches up: it tells something only when it costs less than the estimate
    p = _fed(Planner(8, confirm=3), None, lambda t: 0.03, source="other")
    p.costs.add_step(1, 2, 0.03, [(SRC, 1, 0.5, True)])
    p.costs.add_step(1, 2, 0.03, [(SRC, 1, 0.6, False)])  # a switch costlier than the estimate
    assert p.costs.draft_cost(SRC, 1, 1) == pytest.approx(0.5 / 0.03) and p.costs.draft_confirming(SRC, 1, 1)
    p.costs.add_step(1, 2, 0.03, [(SRC, 1, 0.006, False)])  # cheaper, catching up included
    assert p.costs.draft_cost(SRC, 1, 1) == pytest.approx((0.5 + 0.006) / 0.03 / 2)
    for _ in range(3):  # switches that tell nothing end the confirming
        p.costs.add_step(1, 2, 0.03, [(SRC, 1, 0.6, False)])
    assert not p.costs.draft_confirming(SRC, 1, 1)
    # the stall in the first draft after a plain step: a switch cost of 17 plain steps
    asked = {}
    for confirm in (1, 3):
        p = _fed(Planner(8, confirm=confirm), None, lambda t: 0.03, source="other")
        p.model(SRC).reached, p.model(SRC).accepted = [1e3] * 8, [0.9e3] * 8
        for _ in range(3):
            p.costs.add_step(1, 2, 0.03, [(SRC, 1, 0.003, True)])
        p.costs.add_step(1, 2, 0.03, [(SRC, 1, 0.003 + 0.5, False)])
        assert p.costs.switch_cost(SRC, 1) == pytest.approx(0.5 / 0.03)
        asked[confirm] = p.ask(SRC, 1, [0], trimmable=False, switching=True).k
    assert asked[1] == 0 and asked[3] > 0


def test_a_cost_borrowed_from_another_batch_size_is_not_confirmed_here():
    # The target drafting for itself (a draft token costs a plain step), timed once at batch 1: at
    # batch 4, where nothing is measured yet, that cost is borrowed and rules drafting out. Only at
    # batch 1 is it measured again first.
    p = _fed(Planner(8, confirm=3), 0.99, lambda t: 0.03, source="other", b=4)  # batch 4's widths: flat
    p.costs.add_step(1, 1, 0.03)
    p.costs.add_step(1, 2, 0.03, [(SRC, 1, 0.03, True)])
    p.model(SRC).reached, p.model(SRC).accepted = [1e3] * 8, [0.99e3] * 8
    assert p.costs.draft_confirming(SRC, 1, 1) and not p.costs.draft_confirming(SRC, 4, 1)
    assert p.ask(SRC, 4, [0, 1, 2, 3], trimmable=False, switching=True).k == 0
    assert p.ask(SRC, 1, [0], trimmable=False).k == 1  # at batch 1: measured again


def test_a_cost_borrowed_from_another_batch_size_is_never_below_the_prior():
    # The target drafting for itself (prior: 1.0 plain steps a token) measured 0.78 a token at
    # batch 1, where width is nearly free. At batch 16, with only T = 1 measured there, the
    # borrowed 0.78 made a step drafting one token look like 1.95 tokens for 1.78 plain steps.
    def planner(hint):
        p = Planner(8, confirm=3, explore=0)
        if hint is not None:
            p.costs.hints[SRC] = hint
        _fed(p, 0.96, lambda t: 0.04, lambda k: 0.78 * 0.04 * k, b=1)
        p.costs.add_step(16, 1, 0.06)
        p.costs.add_step(16, 1, 0.06)
        return p

    for hint, at_16 in ((None, 0.78), (1.0, 1.0), (0.5, 0.78)):
        p = planner(hint)
        assert p.costs.draft_cost(SRC, 1, 1) == pytest.approx(0.78)  # measured here: taken at its word
        assert p.costs.draft_cost(SRC, 16, 1) == pytest.approx(at_16)
    assert planner(None).ask(SRC, 16, list(range(16)), trimmable=False, switching=True).k == 1
    assert planner(1.0).ask(SRC, 16, list(range(16)), trimmable=False, switching=True).k == 0
    assert planner(1.0).ask(SRC, 1, [0], trimmable=False).k > 0  # at batch 1 it paid, measured


def test_the_policy_prices_a_draft_model_at_its_share_until_measured(engine_factory, unrelated_draft):
    # bound by the decoder to its proposer: the target drafting for itself costs a plain step a
    # token, so no step drafts (nothing could pay, even every draft accepted: not even explored);
    # a lookup gets no prior (its drafting is measured, and nearly free)
    engine = engine_factory("self")
    sched = make_schedule("cost_aware", 4)
    out = SpeculativeDecoder(engine, DraftModelProposer(engine), schedule=sched).generate(
        REPEATING, max_new_tokens=40)
    assert sched.planner.costs.hints == {sched.source: pytest.approx(1.0)}
    assert out.stats.total.proposed == 0 and set(sched.history) == {0}
    small = engine_factory(unrelated_draft)
    sched = make_schedule("cost_aware", 4)
    SpeculativeDecoder(small, DraftModelProposer(small), schedule=sched)
    share = sum(p.numel() for p in small.draft.model.parameters()) / sum(p.numel() for p in small.target.model.parameters())
    assert 0 < share < 1 and sched.planner.costs.hints == {sched.source: pytest.approx(share)}
    SpeculativeDecoder(engine, NgramProposer(engine), schedule=sched)  # the same schedule, another proposer
    assert sched.planner.costs.hints == {}


def test_decisions_price_the_extra_cost_of_width_with_its_error():
    # learned: a 2-wide step costs 1.2 plain steps; priced at 1 + 0.2 * 1.5 = 1.3, so one draft
    # accepted a quarter of the time (1.25 tokens) pays at width_error 0 and not at 0.5
    p = _fed(Planner(1, explore=0, width_error=0.5), 0.25, lambda t: 0.1 * (1 + 0.2 * (t - 1)))
    assert p.costs.rest(1, 2) == pytest.approx(1.2) and p.rest(1, 2) == pytest.approx(1.3)
    assert p.rest(1, 1) == 1.0 and p.keep(SRC, 1, [0], [1], asked=1).k == 0
    p.width_error = 0.0
    assert p.keep(SRC, 1, [0], [1], asked=1).k == 1
    with pytest.raises(ValueError, match="width_error"):
        Planner(8, width_error=-1)


def test_a_lookup_that_cannot_pay_is_not_asked_to_propose():
    rows = list(range(16))
    steep = _fed(Planner(8, explore=0, width_error=0), 0.3, lambda t: 0.1 * (1 + 0.65 * (t - 1)), b=16)
    assert steep.is_cheap(SRC, 16) and steep.ask(SRC, 16, rows, trimmable=True).k == 0  # batch 16 widths
    good = _fed(Planner(8, explore=0, width_error=0), 0.9, lambda t: 0.1 * (1 + 0.65 * (t - 1)), b=16)
    assert good.ask(SRC, 16, rows, trimmable=True).k == 8  # the same widths, drafts that pay: ask for all
    # exploring still runs it now and then (its acceptance is learned from what it proposes)
    explorer = _fed(Planner(8, explore=0.01, width_error=0), 0.3, lambda t: 0.1 * (1 + 0.65 * (t - 1)), b=16)
    asked = []
    for _ in range(400):
        explorer.next_step()
        asked.append(explorer.ask(SRC, 16, rows, trimmable=True).k)
        if asked[-1]:
            explorer.observe(SRC, {0: (0, 1)})  # its drafts were judged
    assert 0 < sum(k > 0 for k in asked) < 0.05 * len(asked)


def test_a_draft_that_cannot_pay_even_if_always_accepted_is_not_explored():
    # a draft token costs a plain step (the target drafting for itself): even perfect acceptance
    # gives (k + 1) tokens for k + rho(k + 1) >= k + 1 plain steps
    p = _fed(Planner(8), 0.99, lambda t: 0.03, lambda k: 0.03 * k)
    assert p.best_ask(SRC, 1, [0], trimmable=False) is None
    asked = []
    for _ in range(500):  # the exploring budget would try a merely unprofitable draft now and then
        p.next_step()
        asked.append(p.ask(SRC, 1, [0], trimmable=False).k)
    assert asked == [0] * 500
    cheaper = _fed(Planner(8), 0.99, lambda t: 0.03, lambda k: 0.015 * k)
    assert cheaper.best_ask(SRC, 1, [0], trimmable=False) is not None


def test_a_position_never_reached_takes_the_estimate_of_the_one_before():
    m = AcceptanceModel(4, prior=0.5, prior_weight=2.0, decay=1.0)
    for _ in range(20):  # first drafts right a fifth of the time; nothing known beyond
        m.observe({0: (0, 1)})
        m.observe({0: (0, 1)})
        m.observe({0: (0, 1)})
        m.observe({0: (0, 1)})
        m.observe({0: (1, 1)})
    a = m.rates()
    assert a[0] == pytest.approx((20 + 1) / (100 + 2)) and a == pytest.approx([a[0]] * 4)  # not 0.5 beyond
    m.observe({0: (2, 2)})  # the second position judged once, accepted: pulled up from a_1, not to 1
    b = m.rates()
    assert b[0] < b[1] < 1.0 and b[1] == pytest.approx((1 + 2 * b[0]) / (1 + 2)) and b[2] == pytest.approx(b[1])


def test_timings_take_medians_interpolate_and_extrapolate():
    t = Timings(window=5)
    for s in (0.010, 0.011, 0.500):  # a spike from a busy machine
        t.add(1, s)
    t.add(5, 0.030)
    assert t.at(1) == 0.011
    assert t.at(3) == pytest.approx(0.0205)  # halfway between 1 and 5
    assert t.at(9) == pytest.approx(0.030 + 4 * (0.030 - 0.011) / 4)  # the slope beyond the last
    d = Timings()
    d.add(4, 0.008)
    assert d.at(2, origin=True) == pytest.approx(0.004)  # drafting nothing costs nothing
    assert Timings().at(3) is None


def test_width_costs_are_ratios_that_survive_a_change_of_machine_speed():
    costs = CostModel()
    # width 5 costs 1.5 plain steps; the machine slows down 6x half way, between pairs
    for load in [1.0] * 5 + [6.0] * 5:
        costs.add_step(4, 1, 0.066 * load)
        costs.add_step(4, 5, 0.099 * load, [("ngram", 4, 0.0066 * load, True)])
    assert costs.rest(4, 5) == pytest.approx(1.5) and costs.rest(4, 1) == 1.0
    assert costs.rest(4, 3) == pytest.approx(1.5 ** 0.5)  # interpolated in log space
    assert costs.draft_cost("ngram", 4, 4) == pytest.approx(0.1)  # a tenth of a plain step
    assert costs.rest(2, 5) == 1.0 and not costs.ready(2)  # a smaller batch size: widths unknown,
    assert costs.rest(16, 5) == pytest.approx(1.5)  # a larger one: no cheaper than at batch size 4
    assert costs.draft_cost("ngram", 16, 4) == pytest.approx(0.1)  # drafting taken from batch size 4
    costs.new_generation()
    costs.add_step(4, 9, 1.0)  # not paired with the last step of the previous generation
    assert 9 not in costs.table()["width_cost"][4]
    # a draft model's first step after plain steps also feeds what it missed: a switch cost, kept apart
    costs.add_step(4, 1, 0.066)
    costs.add_step(4, 5, 0.099, drafting([("ngram", 4, 0.0066), ("draft", 4, 0.4)], {"ngram"}))
    assert costs.draft_cost("ngram", 4, 4) == pytest.approx(0.1) and not costs.draft_known("draft", 4)
    costs.add_step(4, 5, 0.099, drafting([("draft", 4, 0.066)], {"draft"}))  # drafting 4: one plain step
    costs.add_step(4, 1, 0.066)
    costs.add_step(4, 5, 0.099, drafting([("draft", 4, 0.33)], set()))  # after a pause: 4 more
    # two switches: the first (before steady drafting was known) cost 0.4 s, the second 0.33 s
    assert costs.draft_cost("draft", 4, 4) == pytest.approx(1.0)
    assert costs.switch_cost("draft", 4) == pytest.approx(((0.4 / 0.066 - 1) + (0.33 / 0.066 - 1)) / 2)


def test_acceptance_counts_censored_drafts_as_unjudged():
    m = AcceptanceModel(4, prior=0.5, prior_weight=1e-9, decay=1.0)
    m.observe({0: (2, 3)})  # accepted 2, the third rejected
    m.observe({1: (2, 2)})  # matched 2, nothing known about the third
    assert m.reached == [2, 2, 1, 0] and m.accepted == [2, 2, 0, 0]
    assert m.curve()[:3] == pytest.approx([1.0, 2.0, 3.0])


# ---------------------------------------------------------------- losslessness

REPEATING = [[5, 6, 7, 8, 9, 5, 6, 7], [3, 4, 3, 4], [10, 11, 12, 13, 14, 15, 16, 10, 11, 12]]


def _cutting(k: int, b: int, source: str = CostAwareSchedule.source) -> CostAwareSchedule:
    """A policy told that widths above 3 cost five times a plain step: it keeps at most 2 drafts,
    and a useless-looking proposer none."""
    sched = CostAwareSchedule(k)
    _fed(sched.planner, 0.6, lambda t: 0.01 if t <= 3 else 0.05, b=b, source=source)
    return sched


PROPOSERS = {
    "ngram": lambda e: NgramProposer(e),
    "suffix": lambda e: SuffixProposer(max_spec_factor=2.0),
    "draft": lambda e: DraftModelProposer(e),
    # trees: the policy picks a depth and prices the tree at its node count
    "suffix_tree": lambda e: SuffixTreeProposer(max_spec_factor=2.0, budget=4),
    "eagle": lambda e: EagleProposer(e, str(TINY_EAGLE), budget=4, topk=2, width=2, depth=2),
}
TREES = {"suffix_tree": 4, "eagle": 4}


@pytest.mark.parametrize("batch", ["single", "ragged"])
@pytest.mark.parametrize("proposer", list(PROPOSERS))
@pytest.mark.parametrize("costs", ["measured", "cutting"])
def test_policy_greedy_equals_autoregressive(engine_factory, unrelated_draft, batch, proposer, costs):
    engine = engine_factory("self" if proposer != "draft" else unrelated_draft)
    prompts = REPEATING[:1] if batch == "single" else REPEATING
    ref = SpeculativeDecoder(engine).generate(prompts, max_new_tokens=40)
    sched = CostAwareSchedule(6) if costs == "measured" else _cutting(6, len(prompts))
    dec = SpeculativeDecoder(engine, PROPOSERS[proposer](engine), num_speculative_tokens=6, schedule=sched)
    steps = 0
    for _ in range(2):  # the second generation starts from what the first learned
        out = dec.generate(prompts, max_new_tokens=40)
        assert out.output_ids == ref.output_ids and out.lossless
        steps += out.stats.steps
    assert len(sched.history) == steps and max(sched.history) <= 6
    if proposer in TREES:  # trees are priced at the widest seen (up to the budget), never cut
        assert 0 < max(sched.history) <= TREES[proposer] and sched.planner.nodes == {sched.source: max(sched.history)}
        if costs == "cutting":  # a step over 3 wide costs 5 plain ones: once seen, no more such trees
            assert sum(h > 2 for h in sched.history) <= 2
    elif costs == "cutting" and proposer != "draft":
        assert 0 < max(sched.history) <= 2 and out.reports["schedule"]["costs"]["width_cost"]


class Counting:
    """A proposer that counts the calls asking it for drafts."""

    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, inner.name, 0

    def reset(self, state):
        self.inner.reset(state)

    def propose(self, state, k):
        self.calls += k > 0
        return self.inner.propose(state, k)

    def observe(self, state, outcome):
        self.inner.observe(state, outcome)


@pytest.mark.parametrize("accept, runs", [(0.3, False), (0.95, True)])
def test_skipping_a_lookup_that_cannot_pay_gives_plain_decodings_tokens(engine_factory, accept, runs):
    # Told batch-16-like widths: with 30% acceptance no offer could pay, so the lookup is not run
    # and every step is plain; with 95% it runs. The output is plain decoding's either way.
    engine = engine_factory("self")
    ref = SpeculativeDecoder(engine).generate(REPEATING, max_new_tokens=30)
    sched = CostAwareSchedule(6, explore=0.0, width_error=0.0)
    _fed(sched.planner, accept, lambda t: 0.01 * (1 + 0.65 * (t - 1)), b=len(REPEATING), source=sched.source)
    lookup = Counting(NgramProposer(engine))
    out = SpeculativeDecoder(engine, lookup, num_speculative_tokens=6, schedule=sched).generate(
        REPEATING, max_new_tokens=30)
    assert out.output_ids == ref.output_ids
    assert (lookup.calls > 0) == runs and (max(sched.history) > 0) == runs


def test_policy_with_the_target_drafting_for_itself_keeps_its_output(engine_factory):
    engine = engine_factory("self")
    ref = SpeculativeDecoder(engine).generate(RAGGED_PROMPTS, max_new_tokens=30)
    out = SpeculativeDecoder(engine, DraftModelProposer(engine), schedule=make_schedule("cost_aware", 4)).generate(
        RAGGED_PROMPTS, max_new_tokens=30)
    assert out.output_ids == ref.output_ids


def test_a_useless_draft_gets_plain_steps(engine_factory, unrelated_draft):
    # Costs told (a draft token costs half a plain step; tiny models' clocks are noise), acceptance
    # learned from the run: the unrelated draft is almost never right, so steps turn plain.
    engine = engine_factory(unrelated_draft)
    sched = CostAwareSchedule(4, window=512)
    _fed(sched.planner, None, lambda t: 0.01, lambda k: 0.005 * k, b=len(RAGGED_PROMPTS), source=sched.source,
         rounds=300)
    dec = SpeculativeDecoder(engine, DraftModelProposer(engine), schedule=sched)
    dec.generate(RAGGED_PROMPTS, max_new_tokens=20)
    sched.history.clear()
    dec.generate(RAGGED_PROMPTS, max_new_tokens=60)
    assert sched.history.count(0) >= 0.8 * len(sched.history)
    assert sched.planner.model(sched.source).rates()[0] < sched.planner.model(sched.source).prior  # learned: worse


def test_policy_sampling_with_cut_lookups_is_lossless(target, expected):  # noqa: F811
    engine = Engine(target, dtype="float32")
    sched = _cutting(4, N)
    counts, stats = _sample_pairs(engine, NgramProposer(engine, max_ngram=2), sched, k=4)
    assert 0 < max(sched.history) <= 2 and 0.05 < stats.acceptance_rate < 0.95
    assert chi_square_pvalue(counts, expected) > 1e-3


def test_policy_sampling_with_a_draft_model_is_lossless(target, draft, expected):  # noqa: F811
    engine = Engine(target, draft, dtype="float32")
    sched = CostAwareSchedule(2)
    _fed(sched.planner, 0.5, lambda t: 0.01, lambda k: 0.001 * k, b=N, source=sched.source)
    counts, stats = _sample_pairs(engine, DraftModelProposer(engine), sched, k=2)
    assert max(sched.history) == 2 and 0.05 < stats.acceptance_rate < 0.95
    assert chi_square_pvalue(counts, expected) > 1e-3


def test_policy_sampling_with_suffix_trees_is_lossless(target):  # noqa: F811
    # The policy picks each tree's depth (0 included) from the past; trees are never cut.
    engine = Engine(target, dtype="float32")
    sched = CostAwareSchedule(2, explore=0.0)
    _fed(sched.planner, 0.5, lambda t: 0.01, b=N, source=sched.source)  # widths up to 3 told free
    counts, stats = _sample_pairs(engine, SuffixTreeProposer(budget=2), sched, k=2, prompt=BRANCHING)
    assert max(sched.history) == 2 and 0.05 < stats.acceptance_rate < 0.95
    assert chi_square_pvalue(counts, exact_joint_of_tokens_2_and_3(target, BRANCHING, PARAMS, V)) > 1e-3
