"""Step statistics, and every number derived from them, each formula defined once.

`RowStats` counts what each verification step proposed, accepted and emitted for one batch row (one
prompt); `GenerationStats` holds the rows of one `generate` call. The module-level functions are the
definitions of the derived metrics, on plain counts, so that the decoder's statistics, the
experiment's per-prompt results and the report's per-category summaries all compute them the same
way. Where vLLM publishes a metric, it has vLLM's name (docs/metrics.md):

- `acceptance_rate` alpha = accepted / proposed drafts (vLLM: `draft_acceptance_rate`);
- `mean_accepted_length` tau = emitted tokens / target passes, bonus and recovered included, steps
  that drafted nothing included (1.0 for plain decoding): what the speed depends on;
- `mean_acceptance_length` = 1 + accepted / steps that drafted (vLLM's, bonus counted);
- `per_position_acceptance` a_i = P(draft i accepted | drafts before it accepted), conditional;
- `per_position_acceptance_rate` = accepted at position i / steps that drafted (vLLM's, unconditional);
- `acceptance_histogram[j]` = steps that drafted and accepted exactly j drafts (vLLM's);
- `acceptance_histogram_by_draft_length[k][j]` = the same, for steps that drafted exactly k (vLLM's);
- `expected_tokens_per_step`, `tokens_per_s`, `speedup`, `draft_token_cost` (c) and the predicted
  speedups: the cost model, applied per method and group of prompts by `specdec.study.results`.

Drafts cut off by EOS or by `max_new_tokens` are never emitted, so they count neither as accepted nor
as reached (`RowStats.record`); they do count as proposed, since they were drafted and scored.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields

# ---------------------------------------------------------------- helpers


def ratio(num: float, den: float) -> float:
    """num / den, NaN when den is 0 (a metric over nothing is unknown, not zero)."""
    return num / den if den else float("nan")


def sum_lists(lists: Iterable[Sequence[int]]) -> list[int]:
    """Element-wise sum of lists of different lengths (missing entries count 0)."""
    out: list[int] = []
    for xs in lists:
        out.extend([0] * (len(xs) - len(out)))
        for i, x in enumerate(xs):
            out[i] += x
    return out


# ---------------------------------------------------------------- the definitions


def acceptance_rate(accepted: int, proposed: int) -> float:
    """alpha = accepted / proposed drafts (vLLM: `draft_acceptance_rate`)."""
    return ratio(accepted, proposed)


def mean_accepted_length(emitted: int, steps: int) -> float:
    """tau = tokens emitted by steps / steps (target passes): bonus and recovered tokens included,
    steps that drafted nothing included, the prefill's first token excluded."""
    return ratio(emitted, steps)


def num_spec_steps(draft_lengths: Sequence[int]) -> int:
    """Steps that proposed at least one draft (vLLM: `num_spec_steps`, `spec_decode_num_drafts`)."""
    return sum(1 for k in draft_lengths if k > 0)


def mean_acceptance_length(accepted: int, spec_steps: int) -> float:
    """vLLM's `mean_acceptance_length` = 1 + accepted drafts / steps that drafted (the bonus counted,
    steps without drafts left out); 1.0 when nothing was drafted, as vLLM reports it."""
    return 1.0 + accepted / spec_steps if spec_steps else 1.0


def per_position_acceptance(accepted_at: Sequence[int], reached_at: Sequence[int]) -> list[float]:
    """a_i = accepted_at[i] / reached_at[i]: P(draft i accepted | drafts 1..i-1 accepted)."""
    return [ratio(a, n) for a, n in zip(accepted_at, reached_at)]


def per_position_acceptance_rate(accepted_at: Sequence[int], spec_steps: int) -> list[float]:
    """vLLM's per-position acceptance rate = accepted_at[i] / steps that drafted: P(draft i accepted),
    unconditional, so it is the product a_1 ... a_i for a fixed k."""
    return [ratio(a, spec_steps) for a in accepted_at]


def acceptance_histogram(draft_lengths: Sequence[int], accepted_lengths: Sequence[int],
                         k: int | None = None) -> list[int]:
    """vLLM's `acceptance_histogram`: entry j counts the steps that drafted and accepted exactly j
    drafts (bonus excluded); length k + 1, k the longest draft (or as given). Steps without drafts
    are left out."""
    k = max(draft_lengths, default=0) if k is None else k
    hist = [0] * (k + 1)
    for d, a in zip(draft_lengths, accepted_lengths):
        if d > 0:
            hist[a] += 1
    return hist


def acceptance_histogram_by_draft_length(draft_lengths: Sequence[int],
                                         accepted_lengths: Sequence[int]) -> dict[int, list[int]]:
    """vLLM's `acceptance_histogram_by_draft_length`: for each draft length k seen, k + 1 counts of
    steps that drafted k and accepted j of them."""
    out: dict[int, list[int]] = {}
    for d, a in zip(draft_lengths, accepted_lengths):
        if d > 0:
            out.setdefault(d, [0] * (d + 1))[a] += 1
    return dict(sorted(out.items()))


def expected_tokens_per_step(per_position: Sequence[float], drafted: Sequence[float] | None = None) -> float:
    """E = 1 + sum_i d_i prod_{j<=i} a_j: the bonus/recovered token plus each draft reached and
    accepted. d_i is the fraction of steps that proposed a draft at position i (1 for a fixed k; less
    for proposers that draft only when they have something, such as n-gram lookup, and for adaptive
    schedules). Leviathan et al.'s (1 - alpha^(k+1)) / (1 - alpha) when every a_i = alpha, d_i = 1."""
    return expected_tokens_curve(per_position, drafted)[-1]


def expected_tokens_curve(per_position: Sequence[float], drafted: Sequence[float] | None = None) -> list[float]:
    """[E(0), E(1), ...]: `expected_tokens_per_step` with only the first l positions drafted, for
    each l up to the first unknown a_i (what a policy compares when it chooses how many to draft)."""
    out, expected, reach = [1.0], 1.0, 1.0
    for i, a in enumerate(per_position):
        if a is None or not math.isfinite(a):
            break
        reach *= a
        expected += reach * (drafted[i] if drafted is not None else 1.0)
        out.append(expected)
    return out


def tokens_per_s(tokens: int, seconds: float) -> float:
    """Generated tokens per second (the prefill's first token included)."""
    return ratio(tokens, seconds)


def speedup(method_tokens_per_s: float, baseline_tokens_per_s: float) -> float:
    """Method tokens/s over the baseline's on the same prompts: for greedy runs (same tokens) this is
    baseline wall time / method wall time; with sampling the rate is the fair ratio."""
    return ratio(method_tokens_per_s, baseline_tokens_per_s)


def draft_token_cost(draft_s: float, proposed: int, t_base: float) -> float:
    """c = (drafting seconds / drafted tokens) / t_base: one draft token's cost relative to one
    1-token target step (t_base, the baseline's seconds per step)."""
    return ratio(ratio(draft_s, proposed), t_base)


def predicted_speedup(expected: float, t_base: float, t_step: float) -> float:
    """Leviathan et al.'s E / (c k + 1), generalised to measured costs: E * t_base / t_step, with
    t_base the baseline's seconds per step (one 1-token pass) and t_step the method's drafting plus
    scoring seconds per step. Decode only: prefill and the loop's own bookkeeping are left out."""
    return ratio(expected * t_base, t_step)


def predicted_speedup_with_prefill(expected: float, t_step: float, prefill_s: float, new_tokens: int,
                                   generations: int, base_tokens_per_s: float) -> float:
    """End to end: the method's measured prefill, which gives each generation its first token, plus
    one step of t_step seconds per E of the other tokens, against the baseline's measured tokens/s:
    (new_tokens / (prefill_s + (new_tokens - generations) / E * t_step)) / base_tokens_per_s."""
    seconds = prefill_s + ratio(new_tokens - generations, expected) * t_step
    return ratio(ratio(new_tokens, seconds), base_tokens_per_s)


# ---------------------------------------------------------------- the counters


def _grow(xs: list[int], n: int) -> None:
    xs.extend([0] * (n - len(xs)))


@dataclass
class RowStats:
    """Counters of one batch row (one prompt) over one generation."""

    steps: int = 0  # verification steps in which this row was still decoding
    proposed: int = 0  # draft tokens proposed (vLLM: num_draft_tokens)
    accepted: int = 0  # draft tokens accepted and emitted (vLLM: num_accepted_draft_tokens)
    emitted: int = 0  # tokens emitted by steps (accepted + recovered/bonus, after EOS/length cuts)
    bonus: int = 0  # steps whose drafts were all accepted (and at least one was proposed)
    recovered: int = 0  # steps that ended at a rejected draft
    proposed_at: list[int] = field(default_factory=list)  # [i]: steps that proposed at least i+1 drafts
    reached_at: list[int] = field(default_factory=list)  # [i]: steps in which draft i was verified
    accepted_at: list[int] = field(default_factory=list)  # [i]: steps in which draft i was accepted
    new_tokens: int = 0  # generated tokens, the prefill's first token included
    wall_s: float = 0.0  # from the start of generation until this row finished
    draft_lengths: list[int] = field(default_factory=list)  # drafts this row offered, per step it took part in
    accepted_lengths: list[int] = field(default_factory=list)  # drafts accepted (and emitted), per step

    def record(self, proposed: int, accepted: int, emitted: int) -> None:
        """One step: `proposed` drafts, `accepted` of them passed the verifier, `emitted` tokens were
        appended after the EOS and max_new_tokens cuts. A draft past the cut was never emitted: it is
        neither accepted nor reached, whatever the verifier said."""
        accepted = min(accepted, emitted)
        cut = emitted <= accepted  # the step ended inside its accepted drafts
        reached = accepted if cut else min(accepted + 1, proposed)
        self.steps += 1
        self.draft_lengths.append(proposed)
        self.accepted_lengths.append(accepted)
        self.proposed += proposed
        self.accepted += accepted
        self.emitted += emitted
        if proposed and not cut:  # a cut step emits neither a bonus nor a recovered token
            if accepted == proposed:
                self.bonus += 1
            else:
                self.recovered += 1
        for xs in (self.proposed_at, self.reached_at, self.accepted_at):
            _grow(xs, proposed)
        for i in range(proposed):
            self.proposed_at[i] += 1
        for i in range(reached):
            self.reached_at[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1

    @classmethod
    def merged(cls, rows: Iterable[RowStats]) -> RowStats:
        """The counters of several rows (or turns) as one: counts and seconds add, per-position
        counts add element-wise, per-step lists are concatenated."""
        rows = list(rows)
        out = cls()
        for f in fields(cls):
            values = [getattr(r, f.name) for r in rows]
            if f.name in ("proposed_at", "reached_at", "accepted_at"):
                setattr(out, f.name, sum_lists(values))
            elif f.name in ("draft_lengths", "accepted_lengths"):
                setattr(out, f.name, [x for v in values for x in v])
            else:
                setattr(out, f.name, sum(values))
        return out

    # Derived metrics: the definitions above, applied to this row's counts.

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(self.accepted, self.proposed)

    @property
    def mean_accepted_length(self) -> float:
        return mean_accepted_length(self.emitted, self.steps)

    @property
    def steps_listed(self) -> bool:
        """Whether vLLM's per-step metrics (below) are known: the per-step lists cover every step, or
        nothing was drafted. Results written before the lists existed have only the counts, and a
        row that drafted is then unknown (NaN, empty), not 'nothing drafted'."""
        return len(self.draft_lengths) == self.steps or self.proposed == 0

    @property
    def num_spec_steps(self) -> int | None:
        return num_spec_steps(self.draft_lengths) if self.steps_listed else None

    @property
    def mean_acceptance_length(self) -> float:
        if not self.steps_listed:
            return float("nan")
        return mean_acceptance_length(self.accepted, self.num_spec_steps)

    @property
    def per_position_acceptance(self) -> list[float]:
        return per_position_acceptance(self.accepted_at, self.reached_at)

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        if not self.steps_listed:
            return [float("nan")] * len(self.accepted_at)
        return per_position_acceptance_rate(self.accepted_at, self.num_spec_steps)

    @property
    def acceptance_histogram(self) -> list[int]:
        return acceptance_histogram(self.draft_lengths, self.accepted_lengths) if self.steps_listed else []

    @property
    def acceptance_histogram_by_draft_length(self) -> dict[int, list[int]]:
        if not self.steps_listed:
            return {}
        return acceptance_histogram_by_draft_length(self.draft_lengths, self.accepted_lengths)


@dataclass
class GenerationStats:
    """Statistics of one `generate` call: per-row counters plus batch-level timings (seconds)."""

    rows: list[RowStats]
    ttft_s: float = 0.0  # prefill until the first token of every row is known
    draft_s: float = 0.0  # time in proposer.propose
    verify_s: float = 0.0  # time in the target's scoring pass and the verifier
    wall_s: float = 0.0
    # CPU seconds of this process over the same span: on a CPU shared with other work it moves far
    # less than wall_s with their load (a CPU-bound, single-threaded run; not a GPU measure)
    cpu_s: float = 0.0
    steps: int = 0
    draft_lengths: list[int] = field(default_factory=list)  # k of each step (adaptive schedules vary it)

    @property
    def total(self) -> RowStats:
        """All rows' counters as one."""
        return RowStats.merged(self.rows)

    @property
    def acceptance_rate(self) -> float:
        return self.total.acceptance_rate

    @property
    def mean_accepted_length(self) -> float:
        return self.total.mean_accepted_length

    @property
    def mean_acceptance_length(self) -> float:
        return self.total.mean_acceptance_length

    @property
    def per_position_acceptance(self) -> list[float]:
        return self.total.per_position_acceptance

    @property
    def new_tokens(self) -> int:
        return sum(r.new_tokens for r in self.rows)

    @property
    def tokens_per_s(self) -> float:
        return tokens_per_s(self.new_tokens, self.wall_s)
