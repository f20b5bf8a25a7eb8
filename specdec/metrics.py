"""Step statistics: what each verification step proposed, accepted and emitted, per batch row.

Counts are kept per row (a row is one prompt), so that per-prompt results and per-category
summaries can be derived without re-running anything. Derived quantities use the vocabulary of
DESIGN.md: acceptance rate alpha = accepted / proposed, mean accepted length tau = tokens emitted
per step (bonus and recovered included, 1.0 for plain decoding), and per-position acceptance
P(draft i accepted | drafts before it accepted).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _grow(xs: list[int], n: int) -> None:
    xs.extend([0] * (n - len(xs)))


@dataclass
class RowStats:
    """Counters of one batch row (one prompt) over one generation."""

    steps: int = 0  # verification steps in which this row was still decoding
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    emitted: int = 0  # tokens emitted by steps (accepted + recovered/bonus, after EOS/length cuts)
    bonus: int = 0  # steps whose drafts were all accepted (and at least one was proposed)
    recovered: int = 0  # steps that ended at a rejected draft
    proposed_at: list[int] = field(default_factory=list)  # [i]: steps that proposed at least i+1 drafts
    reached_at: list[int] = field(default_factory=list)  # [i]: steps in which draft i was verified
    accepted_at: list[int] = field(default_factory=list)  # [i]: steps in which draft i was accepted
    new_tokens: int = 0  # generated tokens, the prefill's first token included
    wall_s: float = 0.0  # from the start of generation until this row finished
    draft_lengths: list[int] = field(default_factory=list)  # drafts this row offered, per step it took part in

    def record(self, proposed: int, accepted: int, emitted: int) -> None:
        self.steps += 1
        self.draft_lengths.append(proposed)
        self.proposed += proposed
        self.accepted += accepted
        self.emitted += emitted
        if proposed:
            if accepted == proposed:
                self.bonus += 1
            else:
                self.recovered += 1
        reached = min(accepted + 1, proposed)
        for xs in (self.proposed_at, self.reached_at, self.accepted_at):
            _grow(xs, proposed)
        for i in range(proposed):
            self.proposed_at[i] += 1
        for i in range(reached):
            self.reached_at[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1


def acceptance_rate(rows: list[RowStats]) -> float:
    proposed = sum(r.proposed for r in rows)
    return sum(r.accepted for r in rows) / proposed if proposed else float("nan")


def mean_accepted_length(rows: list[RowStats]) -> float:
    steps = sum(r.steps for r in rows)
    return sum(r.emitted for r in rows) / steps if steps else float("nan")


def per_position_acceptance(rows: list[RowStats]) -> list[float]:
    n = max((len(r.reached_at) for r in rows), default=0)
    reached = [sum(r.reached_at[i] for r in rows if i < len(r.reached_at)) for i in range(n)]
    accepted = [sum(r.accepted_at[i] for r in rows if i < len(r.accepted_at)) for i in range(n)]
    return [a / m if m else float("nan") for a, m in zip(accepted, reached)]


@dataclass
class GenerationStats:
    """Statistics of one `generate` call: per-row counters plus batch-level timings (seconds)."""

    rows: list[RowStats]
    ttft_s: float = 0.0  # prefill until the first token of every row is known
    draft_s: float = 0.0  # time in proposer.propose
    verify_s: float = 0.0  # time in the target's scoring pass and the verifier
    wall_s: float = 0.0
    steps: int = 0
    draft_lengths: list[int] = field(default_factory=list)  # k of each step (adaptive schedules vary it)

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(self.rows)

    @property
    def mean_accepted_length(self) -> float:
        return mean_accepted_length(self.rows)

    @property
    def per_position_acceptance(self) -> list[float]:
        return per_position_acceptance(self.rows)

    @property
    def new_tokens(self) -> int:
        return sum(r.new_tokens for r in self.rows)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else float("nan")
