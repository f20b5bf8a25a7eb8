"""Typed results: one record per prompt (a line of results.jsonl) and one per method and group of
prompts (a block of summary.json).

- `PromptResult`: what one method did on one prompt, every turn of it: the tokens, the step counts
  (`RowStats`'s, summed over turns), the row's share of its batch's times, how it was verified.
  Its derived numbers (tokens/s, alpha, tau, vLLM's mean_acceptance_length and histograms) are
  properties that apply `specdec.core.metrics` to its counts.
- `TurnResult`: one turn of a multi-turn prompt (kept in `PromptResult.turn_outputs`).
- `MethodSummary`: one method over one group of prompts (a category, or all of them) against the
  baseline's results on the same prompts: `MethodSummary.measure` is the only place where groups of
  results become numbers; every formula it applies is defined in `specdec.core.metrics`.
- `MethodResults`: a method's `MethodSummary` overall and per category, and whether it is lossless.

A run may measure every prompt more than once (`repeats`): each result carries its `repeat`, and a
prompt's result is paired with the baseline's of the same prompt in the same repeat. The 95%
intervals of speedup, tau, alpha and tokens/s come from `specdec.study.intervals` (a bootstrap over
prompts, and repeats), beside the counts they rest on (prompts, repeats, steps).

Each has `to_dict()` / `from_dict()`: the files keep the keys they have always had (derived numbers
are written beside the counts, for readers of the files), and files written by older versions read
back, with what they did not record left at its default. The records are frozen: a result is built
once, from what was measured, and not edited afterwards (their lists are not copied on the way in).

Only `specdec.core.metrics`, `specdec.study.intervals` (numpy) and the standard library are imported,
so the records serve where only torch and transformers are installed (benchmark scripts on a GPU box).
"""

from __future__ import annotations

import math
import statistics
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from specdec.core import metrics as m
from specdec.study import intervals

# The MethodSummary fields repeated at the top of summary.json for the run's first method, so that
# sweeps (specdec.study.sweep) and W&B panels across runs of different methods name one key.
HEADLINE = ("speedup", "speedup_ci_low", "speedup_ci_high", "mean_accepted_length", "mean_accepted_length_ci_low",
            "mean_accepted_length_ci_high", "acceptance_rate", "acceptance_rate_ci_low", "acceptance_rate_ci_high",
            "predicted_speedup", "c", "tokens_per_s", "tokens_per_s_ci_low", "tokens_per_s_ci_high", "ttft_s",
            "per_position_acceptance", "steps", "num_repeats")
# The numbers that carry a 95% interval (`<name>_ci_low`, `<name>_ci_high` in a MethodSummary).
WITH_INTERVALS = ("speedup", "mean_accepted_length", "acceptance_rate", "tokens_per_s")


def _from_dict(cls, data: dict, **extra) -> Any:
    """A record from its dict: unknown keys (derived numbers, newer fields) are ignored, missing ones
    take the field's default, and a float written as null (NaN, JSON has no NaN) reads back as NaN."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        if value is None and hints[f.name] is float:
            value = float("nan")
        values[f.name] = value
    return cls(**{**values, **extra})


def _int_keys(histograms: dict | None) -> dict[int, list[int]]:
    """JSON writes the draft lengths of `acceptance_histogram_by_draft_length` as strings."""
    return {int(k): list(v) for k, v in (histograms or {}).items()}


class _FromCounts:
    """A derived metric of a `PromptResult`: the `RowStats` property of the same name on its counts."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, result, owner=None):
        return self if result is None else getattr(result.counts, self.name)


# ---------------------------------------------------------------- one prompt


@dataclass(frozen=True)
class TurnResult:
    """One turn of a conversation as one method answered it."""

    turn: int
    input_tokens: int  # the turn's whole input (the conversation so far, rendered)
    reused_cache_tokens: int  # of them, taken from the previous turn's KV cache instead of prefilled
    new_tokens: int
    output_token_ids: list[int]
    output_text: str

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict) -> TurnResult:
        return _from_dict(cls, data)


@dataclass(frozen=True)
class PromptResult:
    """One prompt (all of its turns) decoded by one method: a line of results.jsonl.

    Counts add over turns. Timings are seconds: `wall_s`, `draft_s`, `verify_s` and `cpu_s` are the
    row's share of its batch's (batch time / batch size, so they add up to the run's time);
    `latency_s` is the time until the row finished and `ttft_s` its batch's time to first token,
    the mean over turns (latencies of a request, not shares). Per-position lists are indexed by draft
    position (0 = the first draft); per-step lists have one entry per step the row took part in.
    """

    prompt_id: str
    category: str
    method: str
    turns: int = 1
    seed: int = 0
    repeat: int = 0  # which of the run's `repeats` measured it (0 for the first, and in older files)
    prompt_token_ids: list[int] = field(default_factory=list)  # the first turn's input
    output_token_ids: list[int] = field(default_factory=list)  # every turn's output, in order
    output_text: str = ""  # the turns' outputs joined by blank lines
    turn_outputs: list[TurnResult] = field(default_factory=list)  # only for multi-turn prompts
    # counts (specdec.core.metrics.RowStats), summed over turns
    new_tokens: int = 0
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    bonus: int = 0
    recovered: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # RowStats.accepted_at
    reached_per_position: list[int] = field(default_factory=list)  # RowStats.reached_at
    proposed_per_position: list[int] = field(default_factory=list)  # RowStats.proposed_at
    draft_lengths: list[int] = field(default_factory=list)  # drafts this row offered, per step
    accepted_lengths: list[int] = field(default_factory=list)  # drafts accepted, per step (vLLM: per_step_accepted)
    step_draft_lengths: list[int] = field(default_factory=list)  # the batch's longest draft per step
    reused_cache_tokens: int = 0
    # seconds
    wall_s: float = 0.0
    latency_s: float = 0.0
    ttft_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    cpu_s: float = 0.0
    # how it was decided
    lossless: bool = True
    verifier: str | None = None
    acceptance_measured: bool = True  # False when drafts happen out of sight (the transformers anchors)
    # every greedy scoring pass ran at the fixed width (docs/engine.md#numerics-and-exact-greedy)
    exact_greedy: bool = False
    reports: list[dict] = field(default_factory=list)  # per turn: what the proposer / schedule chose

    # ---------------------------------------------------------------- building

    @property
    def unit(self) -> tuple[int, str]:
        """(repeat, prompt_id): what pairs a method's result with the baseline's, and what is resampled."""
        return self.repeat, self.prompt_id

    @classmethod
    def from_generations(cls, prompt_id: str, category: str, method: str, seed: int,
                         generations: Sequence[Any], row: int) -> PromptResult:
        """Row `row` of each turn's `Generation` (one per turn, in order) as one result."""
        stats = [g.stats for g in generations]
        n = len(stats[0].rows)
        turns = [TurnResult(t, len(g.prompt_ids[row]), _reused(g)[row], s.rows[row].new_tokens, g.output_ids[row],
                            g.texts[row] if g.texts is not None else "")
                 for t, (g, s) in enumerate(zip(generations, stats))]
        counts = m.RowStats.merged(s.rows[row] for s in stats)
        last = generations[-1]
        reports = [{"turn": t, **g.reports} for t, g in enumerate(generations) if g.reports]
        return cls(
            prompt_id=prompt_id, category=category, method=method, turns=len(turns), seed=seed,
            prompt_token_ids=list(generations[0].prompt_ids[row]),
            output_token_ids=[x for t in turns for x in t.output_token_ids],
            output_text="\n\n".join(t.output_text for t in turns),
            turn_outputs=turns if len(turns) > 1 else [],
            new_tokens=counts.new_tokens, steps=counts.steps, proposed=counts.proposed, accepted=counts.accepted,
            emitted=counts.emitted, bonus=counts.bonus, recovered=counts.recovered,
            accepted_per_position=counts.accepted_at, reached_per_position=counts.reached_at,
            proposed_per_position=counts.proposed_at, draft_lengths=counts.draft_lengths,
            accepted_lengths=counts.accepted_lengths,
            step_draft_lengths=[k for s in stats for k in s.draft_lengths],
            reused_cache_tokens=sum(t.reused_cache_tokens for t in turns),
            wall_s=sum(s.wall_s for s in stats) / n, latency_s=counts.wall_s,
            ttft_s=statistics.fmean(s.ttft_s for s in stats), draft_s=sum(s.draft_s for s in stats) / n,
            verify_s=sum(s.verify_s for s in stats) / n, cpu_s=sum(s.cpu_s for s in stats) / n,
            lossless=last.lossless, verifier=last.verifier, acceptance_measured=last.acceptance_measured,
            exact_greedy=all(getattr(g, "exact_greedy", False) for g in generations), reports=reports,
        )

    @property
    def drafting_timed_apart(self) -> bool:
        """Whether `draft_s` holds all of this prompt's drafting: not where pipelined steps ran captured
        whole as one CUDA graph each (`reports[..]["pipeline"]["graphed_steps"]`), whose drafting is
        timed with their verifying (`verify_s`; their sum, and so the predicted speedup, still holds)."""
        return not any(turn.get("pipeline", {}).get("graphed_steps") for turn in self.reports)

    @cached_property
    def counts(self) -> m.RowStats:
        """The step counts as `RowStats` (wall_s: the latency), for the definitions in specdec.core.metrics."""
        return m.RowStats(steps=self.steps, proposed=self.proposed, accepted=self.accepted, emitted=self.emitted,
                          bonus=self.bonus, recovered=self.recovered, proposed_at=list(self.proposed_per_position),
                          reached_at=list(self.reached_per_position), accepted_at=list(self.accepted_per_position),
                          new_tokens=self.new_tokens, wall_s=self.latency_s, draft_lengths=list(self.draft_lengths),
                          accepted_lengths=list(self.accepted_lengths))

    # ---------------------------------------------------------------- derived (specdec.core.metrics)

    @property
    def tokens_per_s(self) -> float:
        return m.tokens_per_s(self.new_tokens, self.wall_s)

    # alpha, tau, vLLM's mean_acceptance_length and histograms: RowStats's, on these counts
    acceptance_rate = _FromCounts()
    mean_accepted_length = _FromCounts()
    mean_acceptance_length = _FromCounts()
    acceptance_histogram = _FromCounts()
    acceptance_histogram_by_draft_length = _FromCounts()

    DERIVED = ("tokens_per_s", "acceptance_rate", "mean_accepted_length", "mean_acceptance_length",
               "acceptance_histogram", "acceptance_histogram_by_draft_length")

    # ---------------------------------------------------------------- files

    def to_dict(self) -> dict:
        """The line of results.jsonl: every field (per-turn detail only for multi-turn prompts), then
        the derived numbers."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.turn_outputs:
            out["turn_outputs"] = [t.to_dict() for t in self.turn_outputs]
        else:
            del out["turn_outputs"]
        out.update({name: getattr(self, name) for name in self.DERIVED})
        return out

    @classmethod
    def from_dict(cls, data: dict) -> PromptResult:
        """A line of results.jsonl, of this version or an older one."""
        return _from_dict(cls, data, turn_outputs=[TurnResult.from_dict(t) for t in data.get("turn_outputs", [])])


def _reused(generation) -> list[int]:
    """Prompt tokens each row took from the previous turn's cache (0 for a fresh start)."""
    state = generation.state
    reuse = state.reuse if state is not None else None
    return reuse or [0] * len(generation.output_ids)


# ---------------------------------------------------------------- a group of prompts


@dataclass(frozen=True)
class Totals:
    """One method's results over a group of prompts, added up: the counts (`RowStats.merged`, so the
    ragged per-position lists add element-wise), the seconds, and the prefills."""

    counts: m.RowStats
    num_prompts: int  # distinct prompts (a prompt measured in several repeats counts once)
    wall_s: float
    draft_s: float
    verify_s: float
    ttft_s: float  # the mean over prompts of each prompt's time to first token
    prefill_s: float  # every generation's time to first token, added up
    generations: int  # turns: each one's prefill gives one token
    reused_cache_tokens: int

    @classmethod
    def of(cls, results: Sequence[PromptResult]) -> Totals:
        return cls(counts=m.RowStats.merged(r.counts for r in results), num_prompts=len({r.prompt_id for r in results}),
                   wall_s=sum(r.wall_s for r in results), draft_s=sum(r.draft_s for r in results),
                   verify_s=sum(r.verify_s for r in results),
                   ttft_s=statistics.fmean(r.ttft_s for r in results) if results else float("nan"),
                   prefill_s=sum(r.ttft_s * r.turns for r in results), generations=sum(r.turns for r in results),
                   reused_cache_tokens=sum(r.reused_cache_tokens for r in results))

    @property
    def tokens_per_s(self) -> float:
        return m.tokens_per_s(self.counts.new_tokens, self.wall_s)

    def seconds_per_step(self, seconds: float) -> float:
        return m.ratio(seconds, self.counts.steps)


@dataclass(frozen=True)
class MethodSummary:
    """One method over one group of prompts, against the baseline on the same prompts: a block of
    summary.json (`methods.<name>.overall`, `methods.<name>.categories.<category>`). docs/metrics.md
    defines every number; `measure` computes them with specdec.core.metrics."""

    num_prompts: int = 0  # distinct prompts
    num_repeats: int = 0  # repeats measured; 0 in files written before intervals (then none are shown)
    new_tokens: int = 0
    wall_s: float = float("nan")
    tokens_per_s: float = float("nan")
    tokens_per_s_ci_low: float = float("nan")  # each <name>_ci_low, _ci_high: the 95% interval (intervals.py)
    tokens_per_s_ci_high: float = float("nan")
    speedup: float = float("nan")  # tokens/s over the baseline's
    speedup_ci_low: float = float("nan")
    speedup_ci_high: float = float("nan")
    acceptance_rate: float = float("nan")  # alpha
    acceptance_rate_ci_low: float = float("nan")
    acceptance_rate_ci_high: float = float("nan")
    mean_accepted_length: float = float("nan")  # tau
    mean_accepted_length_ci_low: float = float("nan")
    mean_accepted_length_ci_high: float = float("nan")
    per_position_acceptance: list[float] = field(default_factory=list)  # a_i, conditional
    mean_acceptance_length: float = float("nan")  # vLLM's, bonus counted
    per_position_acceptance_rate: list[float] = field(default_factory=list)  # vLLM's, unconditional
    acceptance_histogram: list[int] = field(default_factory=list)
    acceptance_histogram_by_draft_length: dict[int, list[int]] = field(default_factory=dict)
    num_spec_steps: int | None = 0  # None: read from results without per-step lists
    ttft_s: float = float("nan")
    reused_cache_tokens: int = 0
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    t_draft_step_s: float = float("nan")
    t_verify_step_s: float = float("nan")
    t_baseline_step_s: float = float("nan")
    c: float = float("nan")  # a draft token's cost relative to a baseline step
    verify_cost: float = float("nan")  # scoring a step relative to a baseline step
    expected_tokens_per_step: float = float("nan")
    predicted_speedup: float = float("nan")  # decode only
    predicted_speedup_with_prefill: float = float("nan")  # end to end
    speedup_median: float = float("nan")  # over prompts (each against the baseline on that prompt)
    speedup_min: float = float("nan")
    speedup_max: float = float("nan")
    matches_baseline: float | None = None  # greedy runs: the fraction of prompts with the baseline's tokens

    @classmethod
    def measure(cls, results: Sequence[PromptResult], baseline: Sequence[PromptResult], greedy: bool) -> MethodSummary:
        """The numbers of `results` against `baseline` (the baseline's results on the same prompts)."""
        t, b = Totals.of(results), Totals.of(baseline)
        n = t.counts
        spec_steps = n.num_spec_steps
        t_base = b.seconds_per_step(b.verify_s)
        t_draft, t_verify = t.seconds_per_step(t.draft_s), t.seconds_per_step(t.verify_s)
        drafted = [m.ratio(x, n.steps) for x in n.proposed_at] or None
        expected = m.expected_tokens_per_step(n.per_position_acceptance, drafted)
        if n.proposed:
            predicted = m.predicted_speedup(expected, t_base, t_draft + t_verify)
            with_prefill = m.predicted_speedup_with_prefill(expected, t_draft + t_verify, t.prefill_s, n.new_tokens,
                                                            t.generations, b.tokens_per_s)
            c = m.draft_token_cost(t.draft_s, n.proposed, t_base)
        else:  # plain decoding predicts itself (1.0), once it has run at all
            predicted = with_prefill = 1.0 if results else float("nan")
            c = float("nan")
        if not all(r.drafting_timed_apart for r in results):  # steps captured whole: drafting timed with verifying
            c = float("nan")
        mean_acceptance_length = n.mean_acceptance_length
        if not all(r.acceptance_measured for r in results):  # drafts out of sight: no acceptance, no prediction
            c = expected = predicted = with_prefill = mean_acceptance_length = float("nan")
        spread = per_prompt_speedups(results, baseline)
        matches = None
        if greedy:
            base_out = {r.unit: r.output_token_ids for r in baseline}
            matches = m.ratio(sum(r.output_token_ids == base_out.get(r.unit) for r in results), len(results))
        ci = bootstrap_intervals(results, baseline)
        if not all(r.acceptance_measured for r in results):  # no acceptance to put an interval on
            ci.update(mean_accepted_length=intervals.NAN_INTERVAL, acceptance_rate=intervals.NAN_INTERVAL)
        return cls(
            num_prompts=t.num_prompts, num_repeats=len({r.repeat for r in results}), new_tokens=n.new_tokens,
            wall_s=t.wall_s, tokens_per_s=t.tokens_per_s, speedup=m.speedup(t.tokens_per_s, b.tokens_per_s),
            acceptance_rate=n.acceptance_rate, mean_accepted_length=n.mean_accepted_length,
            **{f"{name}_ci_{end}": bound for name, pair in ci.items() for end, bound in zip(("low", "high"), pair)},
            per_position_acceptance=n.per_position_acceptance,
            mean_acceptance_length=mean_acceptance_length, per_position_acceptance_rate=n.per_position_acceptance_rate,
            acceptance_histogram=n.acceptance_histogram,
            acceptance_histogram_by_draft_length=n.acceptance_histogram_by_draft_length, num_spec_steps=spec_steps,
            ttft_s=t.ttft_s, reused_cache_tokens=t.reused_cache_tokens, steps=n.steps, proposed=n.proposed,
            accepted=n.accepted, t_draft_step_s=t_draft, t_verify_step_s=t_verify, t_baseline_step_s=t_base, c=c,
            verify_cost=m.ratio(t_verify, t_base), expected_tokens_per_step=expected, predicted_speedup=predicted,
            predicted_speedup_with_prefill=with_prefill,
            speedup_median=statistics.median(spread) if spread else float("nan"),
            speedup_min=spread[0] if spread else float("nan"), speedup_max=spread[-1] if spread else float("nan"),
            matches_baseline=matches,
        )

    def interval(self, name: str) -> tuple[float, float]:
        """(low, high): the 95% interval of `name`, one of `WITH_INTERVALS` (NaN where unknown)."""
        return getattr(self, f"{name}_ci_low"), getattr(self, f"{name}_ci_high")

    @property
    def measured_over_predicted(self) -> float:
        """speedup / predicted_speedup, for methods that drafted (NaN for plain decoding)."""
        return m.ratio(self.speedup, self.predicted_speedup) if self.proposed else float("nan")

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.matches_baseline is None:  # sampling: no token-for-token comparison
            del out["matches_baseline"]
        out["measured_over_predicted"] = self.measured_over_predicted
        return out

    @classmethod
    def from_dict(cls, data: dict) -> MethodSummary:
        return _from_dict(cls, data, acceptance_histogram_by_draft_length=_int_keys(
            data.get("acceptance_histogram_by_draft_length")))


def per_prompt_speedups(results: Iterable[PromptResult], baseline: Iterable[PromptResult]) -> list[float]:
    """Each prompt's speedup (its tokens/s over the baseline's on that prompt in the same repeat), sorted;
    unknown ones left out."""
    base = {r.unit: r.tokens_per_s for r in baseline}
    values = (m.speedup(r.tokens_per_s, base.get(r.unit, float("nan"))) for r in results)
    return sorted(x for x in values if math.isfinite(x))


def bootstrap_intervals(results: Sequence[PromptResult], baseline: Sequence[PromptResult],
                        resamples: int = intervals.RESAMPLES, seed: int = intervals.SEED) -> dict[str, tuple]:
    """The 95% interval (low, high) of each of `WITH_INTERVALS` for `results` against `baseline`: a
    bootstrap over the units (repeat, prompt) both measured, repeats first where there are several
    (`specdec.study.intervals`). A unit the baseline lacks (a run cut short) is left out."""
    base = {r.unit: r for r in baseline}
    paired = sorted((r for r in results if r.unit in base), key=lambda r: r.unit)
    w = intervals.resample_weights([r.repeat for r in paired], resamples, seed)
    pairs = [base[r.unit] for r in paired]

    def column(rows: Sequence[PromptResult], name: str) -> list[float]:
        return [getattr(r, name) for r in rows]

    tokens, seconds = column(paired, "new_tokens"), column(paired, "wall_s")
    return {
        "tokens_per_s": intervals.ratio_interval(w, tokens, seconds),
        "speedup": intervals.speedup_interval(w, tokens, seconds, column(pairs, "new_tokens"), column(pairs, "wall_s")),
        "acceptance_rate": intervals.ratio_interval(w, column(paired, "accepted"), column(paired, "proposed")),
        "mean_accepted_length": intervals.ratio_interval(w, column(paired, "emitted"), column(paired, "steps")),
    }


@dataclass(frozen=True)
class MethodResults:
    """Everything summary.json says of one method (`methods.<name>`): its numbers overall and per
    category, whether it is lossless, its verifier, and whether exact greedy applied to it."""

    overall: MethodSummary
    categories: dict[str, MethodSummary] = field(default_factory=dict)
    lossless: bool = True
    verifier: str | None = None
    # "on", "off", or "not applied: <why>" (docs/engine.md#numerics-and-exact-greedy); None in files
    # written before it existed
    exact_greedy: str | None = None

    @classmethod
    def measure(cls, results: Sequence[PromptResult], baseline: Sequence[PromptResult], categories: Sequence[str],
                greedy: bool, exact_greedy: str | None = None) -> MethodResults:
        return cls(
            overall=MethodSummary.measure(results, baseline, greedy),
            categories={c: MethodSummary.measure([r for r in results if r.category == c],
                                                 [r for r in baseline if r.category == c], greedy)
                        for c in categories},
            lossless=all(r.lossless for r in results),
            verifier=results[0].verifier if results else None,
            exact_greedy=exact_greedy,
        )

    def to_dict(self) -> dict:
        out = {"overall": self.overall.to_dict(), "categories": {c: s.to_dict() for c, s in self.categories.items()},
               "lossless": self.lossless, "verifier": self.verifier}
        if self.exact_greedy is not None:
            out["exact_greedy"] = self.exact_greedy
        return out

    @classmethod
    def from_dict(cls, data: dict) -> MethodResults:
        return cls(overall=MethodSummary.from_dict(data.get("overall", {})),
                   categories={c: MethodSummary.from_dict(s) for c, s in data.get("categories", {}).items()},
                   lossless=data.get("lossless", True), verifier=data.get("verifier"),
                   exact_greedy=data.get("exact_greedy"))
