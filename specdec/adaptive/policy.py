"""When and how much to speculate: measured step costs, expected tokens, and the choice between them.

Used by the cost-aware schedule (`method.schedule=cost_aware`, any proposer) and by the hybrid
proposer (`method=hybrid`, several proposers). Both ask the same question before every step: which
option gives the most tokens per second, plain decoding included?

A step of a batch of B rows that drafts k tokens per row and scores T = 1 + (longest proposal)
tokens per row costs, in units of a plain step (T = 1, no drafting) at this batch size,

    c(source, B, k) + rho(B, T)

c: drafting (the proposer, and the policy's own bookkeeping); rho: the rest of the step (the target
pass over B x T tokens, verification, commit, the loop). Both are learned from the run's own clocks,
per batch size (`CostModel`), as ratios taken seconds apart, so that a machine whose speed changes
under other load still compares like with like. Scoring width is almost free at batch 1 and
expensive at batch 16 (experiments/policy/LOG.md, "Where the loss came from"). Row b emits
E_b(l) = 1 + sum_{i<=l} prod_{j<=i} a_{b,j} tokens when it offers l drafts, with a_{b,j} the
acceptance of draft j given the ones before it were accepted (`AcceptanceModel`). The plan with the
most tokens per unit of cost wins, its tokens valued as the decoder's static batches pay for them
(`objective="makespan"`, `Planner.worth`): a batch ends with its last row, so a step counts what it
takes off the most tokens any row still has to emit (with rows alike, min_b E_b per row);
`throughput` counts sum_b E_b, for a server that refills finished rows. Plain decoding
(k = 0, T = 1, cost 1) is always a candidate, and a speculative plan must beat it by `margin`, so
when drafting cannot pay the step is a plain one. Decisions price the extra cost of width, rho - 1,
at 1 + `width_error` (1.5) times what was learned (`Planner.rest`): the clocks learn less extra cost
than drafting steps really pay, so without it steps predicted to gain a few percent were taken and
lost, and a larger flat margin instead also dropped batch 1's cheap drafts
(experiments/policy/LOG.md, "Where the loss came from", item 5).

Learning without losing:
- Costs: the steps at a new batch size are plain (no loss) until one is measured, and so is one in
  every `probe` steps (32), since costs are ratios to the plain steps around them; the first step
  of each shape (B, T) is not measured (`StepClock`: it pays one-time costs); widths never measured
  are read off the measured ones (interpolated, extrapolated with a non-negative slope, flat where
  nothing else is known), and a step scores at most one token per row more than the widest width
  measured at its batch size (`Planner.widest`): widths are learned upwards one at a time, so
  finding out costs at most one step one token wider than known (a step far wider than any known
  width can cost several plain steps: experiments/policy/LOG.md, "Where the loss came from",
  item 2). A token tree, never cut, may also take a width measured at a smaller batch size, priced
  no lower than it cost there: width costs more the larger the batch (`CostModel.floor`). Every
  estimate is a median over the last `window` observations.
- Confirming: a cost measured fewer than `confirm` (3) times does not rule drafting out on its own
  word. A plan that loses to plain decoding only through such a cost (it would win were that cost
  zero) is taken anyway until the cost has its `confirm` measurements; the median then rejects a
  single outlier. A width is measured again in a step that pairs with the one before (a step of
  another width), if it measured above what scoring each token in a plain step of its own would
  cost (within that, it is taken at its word: confirming a width that was merely expensive spends
  steps that lose; experiments/policy/LOG.md, "Three defects the rerun found"); drafting k, in any
  step drafting k (after a pause that step also catches up, so it counts only when cheaper: an
  upper bound); the switch cost, in the next step that drafts after a step without. A cost
  borrowed from another batch size is confirmed at that batch size, not by drafting at this one.
  Otherwise one stalled step on a shared machine stopped drafting for good, since what is never
  taken is never measured again (experiments/policy/LOG.md, "One stalled step (`confirm`)").
  Finding out costs at most `confirm` - 1 steps per width, k or switch cost that really loses.
- Acceptance: decayed counts per draft position, each shrunk to the position before it (the
  first to a prior); a per-row factor for the rows of the current batch (a summarization row and
  a QA row differ). When the policy stops drafting
  it also stops learning acceptance, so it explores: one step with the best speculative plan
  every `ceil((cost * loss + margin) / explore)` steps without a verdict, where cost * loss is the
  time that plan would waste were its first-position acceptance `optimism` (1) standard deviations
  above the estimate (for plans asked of a proposer before it runs, a draft model's or EAGLE's; a
  lookup's offers are valued at the estimate). Once the verdicts are many, that is about the time
  it is predicted to waste, and exploring takes about `explore` (1%) of the time; while they are
  few, it comes sooner, so an estimate pulled down by a few early rejections is corrected within a
  generation.

Decisions that look at proposed tokens are taken only for deterministic proposals (no q): their
tokens are functions of the past, so shortening them keeps every verifier lossless. A proposal
sampled from a draft model is never cut after the fact (whether a sampled draft is scored must not
depend on the sampled tokens); its length was chosen beforehand, from the past alone.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec.core import metrics

OBJECTIVES = ("makespan", "throughput")  # what a plan's tokens are worth (`Planner.worth`)
# The rows a decision plans over: row -> the tokens it may still emit (`DecodeState.open_rows`), or
# a list of rows alike.
Rows = Mapping[int, int] | Sequence[int]


def interpolate(pts: dict[int, float], x: int) -> float | None:
    """pts at x if known; else linear between the nearest known keys, beyond the largest along the
    least-squares slope of all known keys (never negative), flat below the smallest."""
    if x in pts:
        return pts[x]
    if not pts:
        return None
    xs = sorted(pts)
    if x < xs[0]:
        return pts[xs[0]]
    below = max(p for p in xs if p < x)
    above = [p for p in xs if p > x]
    if above:
        hi = min(above)
        return pts[below] + (pts[hi] - pts[below]) * (x - below) / (hi - below)
    if len(xs) == 1:
        return pts[below]
    mx = sum(xs) / len(xs)
    my = sum(pts[p] for p in xs) / len(xs)
    slope = sum((p - mx) * (pts[p] - my) for p in xs) / sum((p - mx) ** 2 for p in xs)
    return pts[below] + max(slope, 0.0) * (x - below)


class Timings:
    """Recent observations per integer key, summarised by their median (robust to spikes);
    `at(x)` interpolates keys never observed (`interpolate`); `origin=True` adds (0, 0)."""

    def __init__(self, window: int = 16):
        self.window = window
        self.obs: dict[int, deque] = {}
        self._medians: dict[int, float] | None = None  # cached until the next `add`
        self._at: dict[tuple[int, bool], float | None] = {}  # `at`, likewise

    def add(self, x: int, value: float) -> None:
        self.obs.setdefault(x, deque(maxlen=self.window)).append(value)
        self._medians = None
        self._at = {}

    def __bool__(self) -> bool:
        return bool(self.obs)

    def medians(self) -> dict[int, float]:
        if self._medians is None:
            self._medians = {x: statistics.median(v) for x, v in sorted(self.obs.items())}
        return self._medians

    def at(self, x: int, origin: bool = False) -> float | None:
        if (x, origin) not in self._at:
            pts = self.medians()
            self._at[(x, origin)] = interpolate({0: 0.0, **pts} if origin and 0 not in pts else pts, x)
        return self._at[(x, origin)]


def model_cost_hint(proposer, engine) -> float | None:
    """A prior for the drafting cost per token of a proposer that runs a draft model
    (`proposer.draft`, a `CachedModel`: a draft model, the target's early layers), in plain steps:
    the draft's share of the target's parameters. Small models rarely run faster than their share,
    so the prior errs low: such a proposer is still tried when it could pay, and priced out untried
    when it could not (the target drafting for itself: 1.0). None for other proposers."""
    model = getattr(getattr(proposer, "draft", None), "model", None)
    target = getattr(getattr(engine, "target", None), "model", None)
    if not isinstance(model, torch.nn.Module) or not isinstance(target, torch.nn.Module):
        return None
    return sum(p.numel() for p in model.parameters()) / sum(p.numel() for p in target.parameters())


class CostModel:
    """Step costs in units of a plain step at the same batch size, at the same moment.

    The machine's speed changes under other load (a shared CPU), so absolute timings taken minutes
    apart cannot be compared.
    Ratios taken seconds apart can:
    - rho(B, T) = R(B, T) / R(B, 1), the rest of a step that scores T tokens per row: from pairs of
      consecutive steps of different widths (log ratio, median per pair of widths), solved by
      least squares over all pairs with rho(B, 1) = 1;
    - c(source, B, k) = D(source, B, k) / R(B, 1), drafting: the draft's seconds over the same
      step's plain-step equivalent R_t / rho(B, T_t), from steps that followed a step in which the
      source drafted too; the first step after a pause also pays a switch cost (a draft model
      feeding the tokens it missed), kept apart (`switch_cost`)."""

    def __init__(self, window: int = 16, confirm: int = 1):
        self.window, self.confirm = window, confirm
        self.pairs: dict[int, dict[tuple[int, int], deque]] = {}  # B -> (T, T') -> log(R_T / R_T')
        self.last: dict[int, tuple[int, float]] = {}  # B -> (T, seconds) of the last measured step
        self.measured: dict[int, dict[int, int]] = {}  # B -> T -> steps measured
        self.futile: dict[tuple[str, int, int], int] = {}  # (source, B, k) -> re-measurements that told nothing
        self.plain_s: dict[int, float] = {}  # B -> seconds of a plain step, lately (for reports)
        self.draft: dict[tuple[str, int], Timings] = {}
        self.switch: dict[tuple[str, int], deque] = {}  # (source, B) -> (k, cost) of drafting after not drafting
        self._rho: dict[int, dict[int, float]] = {}  # B -> T -> log rho, solved; cleared on new pairs
        self._rests: dict[tuple[int, int], float] = {}  # (B, T) -> rho (~100 asks a step), cleared with _rho
        self.hints: dict[str, float] = {}  # source -> drafting cost per token, in plain steps, until measured

    def add_step(self, b: int, t: int, rest_s: float, drafts: list[tuple[str, int, float, bool]] = ()) -> None:
        """A step at batch size b scored t tokens per row; the rest of it took rest_s seconds; each
        draft entry is (source, k, seconds, steady): steady when the source also drafted in the step
        before, else its time includes catching up (see `drafting`)."""
        rest_s = max(rest_s, 1e-9)
        prev = self.last.get(b)
        if prev is not None and prev[0] != t:
            (hi, s_hi), (lo, s_lo) = sorted([(t, rest_s), prev], reverse=True)
            self.pairs.setdefault(b, {}).setdefault((hi, lo), deque(maxlen=self.window)).append(
                math.log(s_hi / s_lo))
            self._rho.pop(b, None)
            self._rests.clear()  # a larger batch size's floor reads this one's
        self.last[b] = (t, rest_s)
        counts = self.measured.setdefault(b, {})
        counts[t] = counts.get(t, 0) + 1
        plain = rest_s / self.rest(b, t)
        self.plain_s[b] = plain
        for source, k, seconds, steady in drafts:
            if k == 0:
                continue
            timings = self.draft.get((source, b))
            if steady:
                self.draft.setdefault((source, b), Timings(self.window)).add(k, seconds / plain)
                continue
            # less what steady drafting costs, once that is known (see switch_cost)
            self.switch.setdefault((source, b), deque(maxlen=self.window)).append((k, seconds / plain))
            if timings is not None and 0 < len(timings.obs.get(k, ())) < self.confirm:
                if seconds / plain < timings.medians()[k]:  # catching up included, it cost less: a bound
                    timings.add(k, seconds / plain)
                else:
                    self.futile[(source, b, k)] = self.futile.get((source, b, k), 0) + 1

    def ready(self, b: int) -> bool:
        """A step at batch size b was measured."""
        return b in self.plain_s

    def new_generation(self) -> None:
        """Steps of different generations are not paired: other work may run in between."""
        self.last = {}

    def _solve(self, b: int) -> dict[int, float]:
        """log rho per width connected to T = 1 by pairs (least squares over the pairs' medians)."""
        if b in self._rho:
            return self._rho[b]
        pairs = {key: statistics.median(v) for key, v in self.pairs.get(b, {}).items()}
        linked, frontier = {1}, [1]
        while frontier:
            w = frontier.pop()
            for hi, lo in pairs:
                for u, v in ((hi, lo), (lo, hi)):
                    if u == w and v not in linked:
                        linked.add(v)
                        frontier.append(v)
        unknown = sorted(linked - {1})
        out = {1: 0.0}
        if unknown:
            col = {w: i for i, w in enumerate(unknown)}
            rows, rhs = [], []
            for (hi, lo), d in pairs.items():
                if hi in linked and lo in linked:
                    weight = math.sqrt(len(self.pairs[b][(hi, lo)]))
                    row = np.zeros(len(unknown))
                    if hi in col:
                        row[col[hi]] += weight
                    if lo in col:
                        row[col[lo]] -= weight
                    rows.append(row)
                    rhs.append(weight * d)
            x = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)[0]
            out.update({w: float(x[col[w]]) for w in unknown})
        self._rho[b] = out
        return out

    def confirming(self, b: int, t: int) -> bool:
        """Width t > 1 was measured at batch size b, fewer than `confirm` times, at more than t plain
        steps, and a step of that width now would measure it again: the last step at b (this
        generation) had another width, and the two form a pair. Consecutive steps of one width form
        no pair. A pass scoring t tokens per row costs at most t passes scoring one, so only a
        width measured above that is suspect (a stall). One measured within it is taken at its
        word: confirming a width that is merely expensive spends steps predicted to lose
        (experiments/policy/LOG.md, "Three defects the rerun found")."""
        n = self.measured.get(b, {}).get(t, 0)
        return t > 1 and 0 < n < self.confirm and b in self.last and self.last[b][0] != t and self.rest(b, t) > t

    def draft_confirming(self, source: str, b: int, k: int) -> bool:
        """Drafting k at batch size b was measured fewer than `confirm` times: a step drafting k now
        measures it again (steadily, or, after a pause, as an upper bound: see `add_step`). At most
        `confirm` such steps may tell nothing (a bound above the estimate), so confirming ends.
        A cost borrowed from another batch size (`nearest`) is confirmed there, not here: otherwise
        an unconfirmed cost was tried again at each new batch size, the first try a prefill of the
        whole batch for the draft (experiments/policy/LOG.md, "Three defects the rerun found")."""
        timings = self.draft.get((source, b))
        n = len(timings.obs.get(k, ())) if timings is not None else 0
        return 0 < n < self.confirm and self.futile.get((source, b, k), 0) < self.confirm

    def switch_confirming(self, source: str, b: int) -> bool:
        """The switch cost at batch size b was measured fewer than `confirm` times at b: drafting
        now, after a step without, measures it again."""
        return 0 < len(self.switch.get((source, b), ())) < self.confirm

    def widest(self, b: int) -> int:
        """The widest T whose cost at batch size b is measured (linked to T = 1 by pairs); 1 if none."""
        return max(self._solve(b))

    def rest(self, b: int, t: int) -> float:
        """rho(B, T): the rest of a step scoring t tokens per row, in plain steps (1.0 for t = 1).
        Between measured widths: interpolated in log space. Beyond the widest: extrapolated linearly
        in rho along the measured widths' least-squares slope (never negative): a step's cost grows
        about linearly with the tokens it scores once the pass is compute-bound (a large batch on a
        CPU), and an exponential would price wide steps out at batch 1; never below what a smaller
        batch size measured at that width (`floor`). With nothing known, 1.0."""
        if (b, t) in self._rests:
            return self._rests[(b, t)]
        solved = self._solve(b)
        if t <= max(solved):
            rho = math.exp(interpolate(solved, t))
        else:
            ahead, floor = interpolate({w: math.exp(v) for w, v in solved.items()}, t), self.floor(b, t)
            rho = ahead if floor is None else max(ahead, floor)
        self._rests[(b, t)] = rho
        return rho

    def floor(self, b: int, t: int) -> float | None:
        """rho(b', t) at the largest batch size b' < b whose measured widths reach t: a lower bound
        on rho(b, t), since the extra cost of width grows with the batch size (the pass moves from
        reading weights towards computing). None when no smaller batch size measured that wide."""
        smaller = [s for s in self.pairs if s < b and self.widest(s) >= t]
        return self.rest(max(smaller), t) if smaller else None

    @staticmethod
    def nearest(table: dict, source: str, b: int):
        """table[(source, b)], else the entry of the nearest batch size measured for `source`:
        drafting relative to a plain step changes far less with the batch size than scoring width
        does (both passes grow with it), so a new batch size starts from what another one measured
        instead of paying again to find out (a draft model's first step feeds the whole prompt)."""
        if (source, b) in table:
            return table[(source, b)]
        sizes = [size for src, size in table if src == source]
        return table[(source, min(sizes, key=lambda size: abs(math.log(size / b))))] if sizes else None

    def draft_known(self, source: str, b: int) -> bool:
        return bool(self.nearest(self.draft, source, b))

    def blind(self, source: str, b: int) -> bool:
        """Nothing prices the source's drafting at batch size b: never measured at any batch size,
        and no prior (`hints`). Only such a source is tried without its cost (a first try)."""
        return not self.draft_known(source, b) and source not in self.hints

    def draft_cost(self, source: str, b: int, k: int) -> float:
        """c(source, B, k) in plain steps; 0 for k = 0. While unmeasured: k times the source's
        `hints` entry (a prior per drafted token, e.g. a draft model's share of the target's
        parameters, which small models rarely beat), else 0 (optimistic). A cost borrowed from
        another batch size is never below that prior: a draft model's catch-up pass scores the
        tokens it missed, and that width, nearly free at batch 1, is not at 16 (experiments/policy/LOG.md,
        "A draft model's prior")."""
        if k == 0:
            return 0.0
        timings = self.nearest(self.draft, source, b)
        prior = k * self.hints.get(source, 0.0)
        if not timings:
            return prior
        cost = timings.at(k, origin=True)
        return cost if (source, b) in self.draft else max(cost, prior)

    def switch_cost(self, source: str, b: int) -> float:
        """What drafting costs on top of c(k) when the source did not draft in the step before (a
        draft model feeds the tokens it missed: at a generation's start, the whole prompt)."""
        samples = self.nearest(self.switch, source, b)
        if not samples or not self.draft_known(source, b):
            return 0.0
        return statistics.median(max(c - self.draft_cost(source, b, k), 0.0) for k, c in samples)

    def table(self) -> dict:
        """What was learned, for results and studies."""
        return {
            "plain_step_ms": {b: round(s * 1e3, 3) for b, s in self.plain_s.items()},
            "width_cost": {b: {t: round(self.rest(b, t), 4) for t in sorted(self._solve(b))} for b in self.plain_s},
            "draft_cost": {f"{src}@{b}": {k: round(c, 4) for k, c in v.medians().items()}
                           for (src, b), v in self.draft.items()},
            "switch_cost": {f"{src}@{b}": round(self.switch_cost(src, b), 4) for src, b in self.switch},
        }


class AcceptanceModel:
    """How many tokens a row emits for a given number of drafts, from one proposer's history.

    a_i = P(draft i accepted | drafts 1..i-1 accepted, draft i offered): decayed counts shrunk
    with weight `prior_weight` to `prior` (i = 1) or to a_{i-1} (i > 1); the decay (per step with drafts) lets the estimate follow
    the text. o_i = P(a row offers >= i drafts | asked for >= i): lookups often find shorter or no
    continuations, and that is known only after proposing. Row b of the current batch multiplies
    a_i by its own acceptance relative to the pool (shrunk with `row_weight` pseudo-observations).
    `optimism`: the optimistic estimate (`rates(optimistic=True)`) raises a_1 by that many standard
    deviations of its estimate, for deciding when to explore (`Planner.choose`)."""

    def __init__(self, k_max: int, prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.98,
                 row_weight: float = 4.0, optimism: float = 1.0):
        self.k_max, self.prior, self.prior_weight, self.decay, self.row_weight, self.optimism = \
            k_max, prior, prior_weight, decay, row_weight, optimism
        self.accepted = [0.0] * k_max
        self.reached = [0.0] * k_max
        self.offered = [0.0] * k_max
        self.asked = [0.0] * k_max
        self.rows: dict[int, list[float]] = {}  # row -> [accepted, reached] in this generation

    def reset_rows(self) -> None:
        self.rows = {}

    def rates(self, row: int | None = None, optimistic: bool = False) -> list[float]:
        """a_i for i = 1..k_max (for `row` of the current batch when given). Position 1 is shrunk
        to `prior`, position i > 1 to the estimate of position i - 1: deep positions are reached
        rarely, and with a flat prior they stayed at it, so long drafts looked worth scoring
        (experiments/policy/LOG.md, "Where the loss came from", item 4). `optimistic`: a_1 plus
        `optimism` standard deviations of its estimate (sqrt(a (1 - a) / n), n its decayed verdicts
        and the prior's weight), the deeper positions shrunk to that: high while few verdicts are in."""
        w, p = self.prior_weight, self.prior
        pooled, shrink_to = [], p
        for i, (a, r) in enumerate(zip(self.accepted, self.reached)):
            shrink_to = (a + shrink_to * w) / (r + w)
            if optimistic and i == 0:
                shrink_to = min(shrink_to + self.optimism * math.sqrt(shrink_to * (1 - shrink_to) / (r + w)), 0.99)
            pooled.append(shrink_to)
        if row is None or row not in self.rows:
            return pooled
        mean = (sum(self.accepted) + p * w) / (sum(self.reached) + w)
        acc, reach = self.rows[row]
        factor = (acc + mean * self.row_weight) / (reach + self.row_weight) / mean
        return [min(a * factor, 0.99) for a in pooled]

    def offer_rates(self) -> list[float]:
        return [(o + 1.0) / (n + 1.0) for o, n in zip(self.offered, self.asked)]

    def curve(self, row: int | None = None, asked: bool = False, optimistic: bool = False) -> list[float]:
        """E(l) for l = 0..k_max: expected tokens from l drafts offered (asked=True: l asked for),
        under the optimistic acceptance when `optimistic` (see `rates`)."""
        offers = self.offer_rates() if asked else None
        return metrics.expected_tokens_curve(self.rates(row, optimistic), offers)

    def observe_offers(self, asked: int, offered: list[int]) -> None:
        """Rows that were asked for `asked` drafts offered `offered[r]` (before any cut)."""
        for n in offered:
            for i in range(min(asked, self.k_max)):
                self.asked[i] += 1.0
                self.offered[i] += float(i < n)

    def observe(self, rows: dict[int, tuple[int, int]]) -> None:
        """One step: row -> (drafts accepted, drafts whose verdict is known). Normally reached =
        min(accepted + 1, offered); a draft judged against tokens emitted for another proposal may
        stop at the last emitted token with no verdict on the next (censored, not a rejection)."""
        if not rows:
            return
        self.accepted = [x * self.decay for x in self.accepted]
        self.reached = [x * self.decay for x in self.reached]
        for b, (a, reached) in rows.items():
            a, reached = min(a, self.k_max), min(reached, self.k_max)
            for i in range(reached):
                self.reached[i] += 1.0
            for i in range(a):
                self.accepted[i] += 1.0
            row = self.rows.setdefault(b, [0.0, 0.0])
            row[0] += a
            row[1] += reached


def verified(offered: list[int], accepted: list[int], active: list[bool]) -> dict[int, tuple[int, int]]:
    """Per row that took part and was scored drafts: (accepted, reached = min(accepted + 1, offered))."""
    return {b: (a, min(a + 1, n)) for b, (n, a, on) in enumerate(zip(offered, accepted, active)) if on and n > 0}


@dataclass
class Plan:
    """A candidate for one step: `k` drafts per row (asked of the proposer, or kept of its proposal),
    `tokens` expected from the batch, `cost` the step's predicted time in plain steps, of which
    `unconfirmed` rests on costs being confirmed (`CostModel.confirming`, `draft_confirming`,
    `switch_confirming`): the extra cost of an unconfirmed width, an unconfirmed drafting or switch
    cost. `tentative`: it would beat plain decoding without that part, so it is taken even if it
    loses (`Planner.confirmed_or_best`). `hope`: the tokens expected under the optimistic
    acceptance (`AcceptanceModel.rates`), which values the plan for exploring; None: `tokens`."""

    k: int
    tokens: float
    cost: float
    unconfirmed: float = 0.0
    tentative: bool = False
    hope: float | None = None

    @property
    def rate(self) -> float:
        return self.tokens / max(self.cost, 1e-12)

    @property
    def hope_rate(self) -> float:
        return (self.tokens if self.hope is None else self.hope) / max(self.cost, 1e-12)


class Planner:
    """The decisions: which k to ask a proposer for, how much of a deterministic proposal to keep,
    which proposer to use (the hybrid), and when to explore. One `AcceptanceModel` per source
    (proposer name), one `CostModel`."""

    def __init__(self, k_max: int, min_k: int = 0, start: int = 1, margin: float = 0.02, explore: float = 0.01,
                 prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.98, window: int = 16,
                 cheap: float = 0.01, probe: int = 32, width_error: float = 0.5, confirm: int = 3,
                 optimism: float = 1.0, objective: str = "makespan"):
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
        if not 0 <= min_k <= k_max:
            raise ValueError(f"min_k must be in [0, {k_max}], got {min_k}")
        if not 1 <= start <= k_max:
            raise ValueError(f"start must be in [1, {k_max}], got {start}")
        if margin < 0 or not 0 <= explore < 1 or not 0 < prior < 1 or prior_weight <= 0 or not 0 < decay <= 1 \
                or window < 1 or cheap < 0 or probe < 0 or width_error < 0 or confirm < 1 or not optimism >= 0:
            raise ValueError("need margin >= 0, 0 <= explore < 1, 0 < prior < 1, prior_weight > 0, 0 < decay <= 1, "
                             "window >= 1, cheap >= 0, probe >= 0, width_error >= 0, confirm >= 1, optimism >= 0")
        self.k_max, self.min_k, self.start, self.objective = k_max, min_k, start, objective
        self.margin, self.explore, self.cheap, self.probe, self.width_error = margin, explore, cheap, probe, width_error
        self.model_args = {"prior": prior, "prior_weight": prior_weight, "decay": decay, "optimism": optimism}
        self.costs = CostModel(window, confirm)
        self.models: dict[str, AcceptanceModel] = {}
        self.steps = 0
        self.last_scored: dict[str, int] = {}  # source -> step at which its drafts were last judged
        self.last_plain: dict[int, int] = {}  # batch size -> step of its last plain (width 1) step
        # Sources that draft token trees -> the nodes one of their trees scores, whatever its depth:
        # their k is a depth, and a plan of any depth is priced at that width (see `width`).
        self.nodes: dict[str, int] = {}

    def model(self, source: str) -> AcceptanceModel:
        if source not in self.models:
            self.models[source] = AcceptanceModel(self.k_max, **self.model_args)
        return self.models[source]

    def new_generation(self) -> None:
        """Per-row estimates start afresh; costs and pooled acceptance carry over."""
        self.costs.new_generation()
        for m in self.models.values():
            m.reset_rows()

    def ready(self, b: int) -> bool:
        """A step at batch size b was measured (before that, every step is plain)."""
        return self.costs.ready(b)

    def stepped(self, b: int, t: int) -> None:
        """This step scored t tokens per row at batch size b."""
        if t == 1:
            self.last_plain[b] = self.steps

    def probing(self, b: int) -> bool:
        """Time for a plain step: costs are ratios to a plain step, measured against the plain
        steps around them, so a policy that always drafts takes one every `probe` steps (it costs
        at most a step's speculative gain in `probe`, and nothing against plain decoding)."""
        return self.min_k == 0 and self.probe > 0 and self.steps - self.last_plain.get(b, self.steps) >= self.probe

    def is_cheap(self, source: str, b: int) -> bool:
        """Drafting k_max tokens costs under `cheap` of a plain step: asking for more is free."""
        return self.ready(b) and self.costs.draft_known(source, b) and \
            self.costs.draft_cost(source, b, self.k_max) <= self.cheap

    def only_tried(self, source: str, b: int) -> bool:
        """Drafting was timed for one token only, and that cost under `cheap` of a plain step: a
        lookup, most likely, whose cost for k_max is worth measuring once."""
        timings = self.costs.nearest(self.costs.draft, source, b)
        return timings is not None and set(timings.obs) == {1} and self.costs.draft_cost(source, b, 1) <= self.cheap

    def plain(self, b: int, rows: Rows, sunk: float = 0.0) -> Plan:
        return Plan(0, float(len(rows)), sunk + 1.0)

    def worth(self, tokens: list[float], rooms: list[int] | None = None) -> float:
        """What a step is worth whose rows emit `tokens` (expected or realized; row i may still emit
        `rooms[i]`, None: alike), in tokens of plain decoding: a plain step is worth one per row.
        `throughput`: their sum, right when a finished row's slot goes to a waiting request.
        `makespan`: a static batch (the decoder's) ends with its last row, so a step is worth what
        it takes off the most any row still has to emit, D = max(rooms) - max(room - tokens), per
        row (plain: D = 1; rows alike: the fewest tokens of any row). Counted as throughput, a
        static batch drafted for rows that ended first, whose tokens buy nothing (experiments/policy/LOG.md,
        "What a step of a static batch is worth (`objective`)")."""
        if self.objective == "throughput" or len(tokens) <= 1:
            return float(sum(tokens))
        if rooms is None:
            return len(tokens) * float(min(tokens))
        left = max(r - min(t, r) for t, r in zip(tokens, rooms))
        return len(tokens) * float(max(rooms) - left)

    @staticmethod
    def rooms(rows: Rows) -> list[int] | None:
        """Per row of `rows`, the tokens it may still emit; None for a plain list of rows (alike)."""
        return [max(rows[r], 1) for r in rows] if isinstance(rows, Mapping) else None

    def rest(self, b: int, t: int) -> float:
        """rho(B, T) as decisions price it: what scoring T > 1 tokens per row costs beyond a plain
        step, times 1 + `width_error`: drafting steps pay more extra than the clocks learn
        (experiments/policy/LOG.md, "Where the loss came from", item 5). The base step is known
        well (it is the unit); only the extra is uncertain, so batch 1's nearly free widths stay
        nearly free."""
        rho = self.costs.rest(b, t)
        return 1.0 + (rho - 1.0) * (1.0 + self.width_error) if rho > 1.0 else rho

    def widest(self, b: int) -> int:
        """The most drafts a step at batch size b may score: one more than the widest measured step
        scored (T = widest + 1), so that a width is tried only next to a measured one; k_max once
        the costs were told or learned that far. min_k, when set, is always allowed."""
        return min(max(self.costs.widest(b), self.min_k), self.k_max)

    def width(self, source: str, j: int) -> int:
        """Drafts a step scores per row when `source` drafts j (tokens, or levels of a tree)."""
        return 0 if j == 0 else self.nodes.get(source, j)

    def reachable(self, source: str, b: int) -> bool:
        """A tree's width is within one token of the widest measured at batch size b (widths are
        learned upwards, see `widest`), or was measured at a smaller batch size, which prices it
        from below (`CostModel.floor`); a chain's always is (its k is capped instead). A tree is
        never cut, so its width cannot be learned a token at a time: without the smaller batch
        size, a tree method drafted at no batch size but its first (experiments/policy/LOG.md, "Trees at a new
        batch size")."""
        if source not in self.nodes:
            return True
        t = 1 + self.nodes[source]
        return t <= 1 + max(self.costs.widest(b), self.min_k) or self.costs.floor(b, t) is not None

    def _plans(self, source: str, b: int, rows: Rows, cap: int, draft: float, asked: bool,
               lengths: list[int] | None = None, curves: list[list[float]] | None = None,
               hopes: list[list[float]] | None = None) -> list[Plan]:
        """Plans keeping j = 0..cap drafts per row (row r keeps min(lengths[r], j) when lengths are
        given); `curves`: the rows' expected-token curves, when the caller already has them;
        `hopes`: their optimistic curves, for plans asked of a proposer (`best_ask`), else none."""
        if curves is None:
            model = self.model(source)
            curves = [model.curve(r, asked) for r in rows]
        caps = [lengths[r] for r in rows] if lengths is not None else [cap] * len(rows)
        longest = max(caps, default=0)
        widths = [1 + self.width(source, min(j, longest)) for j in range(cap + 1)]
        rests = [self.rest(b, t) for t in widths]
        rooms = self.rooms(rows)
        return [Plan(j, self.worth([c[min(j, n)] for c, n in zip(curves, caps)], rooms), draft + rest,
                     rest - 1.0 if self.costs.confirming(b, t) else 0.0,
                     hope=self.worth([c[min(j, n)] for c, n in zip(hopes, caps)], rooms) if hopes is not None else None)
                for j, (t, rest) in enumerate(zip(widths, rests))]

    def confirmed_or_best(self, plans: list[Plan], plain: Plan) -> Plan:
        """The best plan; when it would lose to plain decoding, the best of those that would beat
        plain decoding but for the costs being confirmed (marked `tentative`): a loss that rests on
        one or two measurements is measured again first."""
        best = max(plans, key=lambda p: (p.rate, p.k))
        if best.rate >= plain.rate * (1 + self.margin):
            return best
        bar = plain.rate * (1 + self.margin)
        tentative = [p for p in plans if p.unconfirmed > 0 and p.tokens / max(p.cost - p.unconfirmed, 1e-12) >= bar]
        return dataclasses.replace(max(tentative, key=lambda p: (p.rate, p.k)), tentative=True) if tentative else best

    def best_ask(self, source: str, b: int, rows: Rows, trimmable: bool, sunk: float = 0.0,
                 cap: int | None = None, switching: bool = False) -> Plan | None:
        """The best k in [max(min_k, 1), cap or k_max] (and `widest`) to ask `source` for, by
        expected rate; a deterministic chain may still be cut to a shorter width afterwards, so
        asking k is worth its best width <= k (a tree, never cut, its whole width). `switching`: the source did not draft in the step before.
        None when no k could beat plain decoding even if every draft were accepted (a draft model as
        costly as the target): such a source is neither chosen nor explored."""
        plans = []
        # A tree is never cut: it is worth its whole width only. Valued at its best cut, a losing
        # tree was priced at no width at all (plain scoring plus its drafting), so the hybrid kept
        # exploring costly trees (experiments/policy/LOG.md, "What a plan is worth").
        trimmable = trimmable and source not in self.nodes
        top = self.k_max if cap is None else min(cap, self.k_max)
        if source not in self.nodes:
            top = min(top, self.widest(b))
        elif not self.reachable(source, b):
            return None  # its trees are wider than anything measured here yet
        extra = sunk + (self.costs.switch_cost(source, b) if switching else 0.0)
        # Its plans carry their optimistic value for exploring (`choose`); a lookup's offers, valued
        # after proposing (`best_keep`), do not: there its wider exploring steps lost time at the
        # larger batch sizes (experiments/policy/LOG.md, "Exploring at an optimistic acceptance").
        model = self.model(source)
        curves = [model.curve(r, asked=True) for r in rows]
        hopes = [model.curve(r, asked=True, optimistic=True) for r in rows] \
            if self.explore > 0 and model.optimism > 0 else None  # else the same as `curves`, or unused
        plain = self.plain(b, rows, sunk)
        # The plans keeping j = 0..top drafts, once: asked k, keeping j <= k differs only in drafting.
        kept = self._plans(source, b, rows, top, 0.0, asked=True, curves=curves, hopes=hopes)
        for k in range(min(max(self.min_k, 1), top), top + 1):
            d = extra + self.costs.draft_cost(source, b, k)
            widths = [Plan(p.k, p.tokens, p.cost + d, p.unconfirmed, hope=p.hope) for p in kept[:k + 1]]
            # Asking k is worth its best width j >= 1: keeping none is a plain step with its drafting
            # wasted, never a plan (valued as one, a chain that loses looked nearly free to explore).
            best = self.confirmed_or_best(widths[1:] or widths, plain) if trimmable else widths[k]
            unconfirmed = best.unconfirmed + \
                (self.costs.draft_cost(source, b, k) if self.costs.draft_confirming(source, b, k) else 0.0) + \
                (self.costs.switch_cost(source, b) if switching and self.costs.switch_confirming(source, b) else 0.0)
            plans.append(Plan(k, best.tokens, best.cost, unconfirmed, hope=best.hope))
        best = self.confirmed_or_best(plans, plain)
        if self.min_k == 0 and not best.tentative and \
                self.ceiling(source, b, rows, sunk, cap) < plain.rate * (1 + self.margin):
            return None  # it cannot pay even if every draft were accepted: not worth exploring either
        return best

    def ceiling(self, source: str, b: int, rows: Rows, sunk: float = 0.0, cap: int | None = None) -> float:
        """The best rate any k <= cap (k_max) could reach if every draft were accepted, in steady
        drafting (no switch cost; widths beyond the measured ones extrapolated)."""
        top = self.k_max if cap is None else min(cap, self.k_max)
        return max(((k + 1) * len(rows) / max(sunk + self.costs.draft_cost(source, b, k)
                                               + self.rest(b, 1 + self.width(source, k)), 1e-12)
                    for k in range(1, top + 1)), default=0.0)

    def best_keep(self, source: str, b: int, rows: Rows, lengths: list[int], draft: float) -> Plan | None:
        """The best number of drafts j >= 1 to keep of a deterministic proposal (row r keeps
        min(lengths[r], j), j <= `widest`); drafting cost `draft` plain steps. None when nothing
        was offered."""
        cap = min(max((lengths[r] for r in rows), default=0), self.widest(b))
        if cap == 0:
            return None
        plans = self._plans(source, b, rows, cap, draft, asked=False, lengths=lengths)[1:]
        floor = min(max(self.min_k, 1), cap)
        return self.confirmed_or_best([p for p in plans if p.k >= floor], self.plain(b, rows, draft))

    def worth_proposing(self, source: str, b: int, rows: Rows, sunk: float = 0.0,
                        others: list[tuple[str, Plan | None]] = ()) -> bool:
        """Whether a deterministic proposal from `source` could be kept this step: its best plan if
        every row offered k_max drafts (the most it can offer; an offer shorter in some row gives
        fewer tokens for the same width) beats plain decoding and `others`, or it is due to explore.
        When not, the step is decided before proposing: a lookup that cannot pay is not run."""
        draft = sunk + self.costs.draft_cost(source, b, self.k_max)
        bound = self.best_keep(source, b, rows, {r: self.k_max for r in rows}, draft)
        return self.choose([*others, (source, bound)], self.plain(b, rows, sunk))[0] == source

    def choose(self, options: list[tuple[str, Plan]], plain: Plan) -> tuple[str | None, Plan]:
        """The best option; plain (None) unless a speculative one beats it by `margin` (or min_k > 0).
        A source passed over explores once every ceil((cost * loss + margin) / explore) steps without
        a verdict on its drafts: loss is its shortfall in rate against the choice, valued at the
        optimistic acceptance (`Plan.hope`), so cost * loss is the time (in plain steps) one
        exploring step may waste if the source is as good as its verdicts so far allow. Valued at
        the estimate itself, an early run of rejections made its own correction rare: the lower the
        estimate, the rarer the exploring (EAGLE at batch 1: a depth-1 estimate of 0.12-0.19 for
        most of a run, one try in about 30 steps, against 0.41 drafting every step). When plain
        decoding would win, a plan being confirmed (`Plan.tentative`) is taken instead."""
        options = [(s, p) for s, p in options if p is not None]
        if not options:
            return None, plain
        name, best = max(options, key=lambda o: (o[1].rate, o[1].k))
        if self.min_k == 0 and best.rate < plain.rate * (1 + self.margin):
            name, best = None, plain
        if name is None:  # a loss that rests on a cost being confirmed is measured again first
            tentative = [o for o in options if o[1].tentative]
            if tentative:
                return max(tentative, key=lambda o: (o[1].rate, o[1].k))
        if self.explore > 0:
            for source, plan in options:
                if source == name:
                    continue
                loss = max(1.0 - plan.hope_rate / max(best.rate, 1e-12), 0.0)
                period = math.ceil((plan.cost * loss + self.margin) / self.explore)
                if self.steps - self.last_scored.get(source, 0) >= period:
                    return source, plan
        return name, best

    def ask(self, source: str, b: int, rows: Rows, trimmable: bool, switching: bool = False) -> Plan:
        """How many drafts to ask `source` for, 0 for a plain step. A cheap proposer is asked for
        k_max (the cut after proposing decides); a costly one for its best k if that beats plain."""
        if not rows or not self.ready(b) or self.probing(b):  # plain: nothing measured at this batch size yet, or a probe
            return Plan(self.min_k, 0.0, 0.0)
        if self.costs.blind(source, b):  # try it
            return Plan(max(self.start, self.min_k), 0.0, 0.0)
        if trimmable and self.is_cheap(source, b):  # ask for all; `keep` cuts. Unless no offer could pay.
            return Plan(self.k_max if self.worth_proposing(source, b, rows) else 0, 0.0, 0.0)
        best = self.best_ask(source, b, rows, trimmable, switching=switching)
        return self.choose([(source, best)], self.plain(b, rows))[1]

    def keep(self, source: str, b: int, rows: Rows, lengths: list[int], asked: int) -> Plan:
        """How many drafts of a deterministic proposal to keep per row, 0 for a plain step."""
        if not self.ready(b):
            return Plan(max((lengths[r] for r in rows), default=0), 0.0, 0.0)
        draft = self.costs.draft_cost(source, b, asked)
        best = self.best_keep(source, b, rows, lengths, draft)
        return self.choose([(source, best)], self.plain(b, rows, draft))[1]

    def observe(self, source: str, rows: dict[int, tuple[int, int]]) -> None:
        """Verdicts on `source`'s drafts this step (see `AcceptanceModel.observe`)."""
        self.model(source).observe(rows)
        if rows:
            self.last_scored[source] = self.steps

    def next_step(self) -> None:
        self.steps += 1

    def report(self) -> dict:
        return {"costs": self.costs.table(),
                "acceptance": {s: [round(a, 4) for a in m.rates()] for s, m in self.models.items()}}


class StepClock:
    """Times the rest of each step (from its start to the next step's start, less drafting) and
    hands it to the cost model. The last step of a generation is not measured (what follows it is
    not a step), nor is the first step of each shape (B, T): it pays one-time costs, the CPU's
    kernels built for new matrix shapes among them. As the first step at a batch size it was the
    reference of every cost after it, so drafting looked cheap (experiments/policy/LOG.md, "Three defects the
    rerun found"). The cost model pairs the next step with the one before the unmeasured one."""

    def __init__(self):
        self.start: float | None = None
        self.pending: tuple[int, int, float, list[tuple[str, int, float, bool]]] | None = None
        self.shapes: set[tuple[int, int]] = set()  # (B, T) of the steps timed so far, every generation

    def reset(self) -> None:
        self.start, self.pending = None, None

    def tick(self, costs: CostModel) -> None:
        """A step starts: close the previous one."""
        now = time.perf_counter()
        if self.start is not None and self.pending is not None:
            b, t, draft_s, drafts = self.pending
            if (b, t) in self.shapes:
                costs.add_step(b, t, now - self.start - draft_s, drafts)
            self.shapes.add((b, t))
        self.start, self.pending = now, None

    def done(self, b: int, t: int, draft_s: float, drafts: list[tuple[str, int, float, bool]]) -> None:
        """The step that started at the last tick scored t tokens per row for b rows after
        `draft_s` seconds of drafting, made of `drafts` (see `drafting`)."""
        self.pending = (b, t, draft_s, list(drafts))


def drafting(drafts: list[tuple[str, int, float]], drafted_before: set[str]) -> list[tuple[str, int, float, bool]]:
    """(source, k, seconds) -> (source, k, seconds, steady): steady when the source drafted in the
    step before too. Otherwise its time includes catching up on what it missed (a draft model feeds
    those tokens, a lookup indexes a new prompt): a switch cost that steady drafting does not pay."""
    return [(src, k, s, src in drafted_before) for src, k, s in drafts]
