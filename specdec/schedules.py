"""Draft-length schedules: how many tokens to propose at each step.

A schedule picks k before each step (`next_k`), may stop drafting early inside a step
(`keep_drafting`, asked by proposers that draft token by token), and learns from each outcome
(`observe`). `num_speculative_tokens` is k for `constant` and the upper bound `k_max` for the
adaptive ones (the decoder sizes its caches for k_max + 1 positions per step).

- `constant`:   k every step, the classic setting.
- `heuristic`:  transformers' assisted-generation rule: k += 2 after a step whose drafts were all
                accepted, k -= 1 after a rejection, kept within [1, k_max].
- `confidence`: draft up to k_max tokens but stop once the draft's top probability for the token
                just drafted falls below `threshold` (transformers' `assistant_confidence_threshold`).
- `cost_aware`: before each step choose the k in [min_k, k_max] that maximises expected tokens per
                second, E[tokens | k] / (draft(k) + verify(k + 1) + overhead), from running estimates
                of per-position acceptance and of the costs measured on this device (see `CostAwareSchedule`).

Every schedule chooses k from the past only (and `confidence` from the draft's own q), never from the
target's answer for this step, so any of them keeps a lossless verifier lossless.
"""

from __future__ import annotations

import time

import torch


class ConstantSchedule:
    """Always k drafts."""

    name = "constant"
    uses_confidence = False  # True: proposers report each draft's top probability to keep_drafting

    def __init__(self, num_speculative_tokens: int = 4):
        if num_speculative_tokens < 1:
            raise ValueError(f"method.num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.k_max = num_speculative_tokens

    def reset(self) -> None:
        """A new generation starts."""

    def next_k(self, state) -> int:
        return self.k_max

    def keep_drafting(self, top_probs: torch.Tensor) -> torch.Tensor:
        """top_probs: [B] the draft's highest probability for the token just drafted -> [B] bool."""
        return torch.ones_like(top_probs, dtype=torch.bool)

    def observe(self, outcome, draft_s: float, verify_s: float) -> None:
        """The step's outcome and how long its drafting and verification took (seconds)."""


def _drafting_rows(outcome) -> list[int]:
    """Rows that took part in the step and were proposed at least one draft."""
    lengths = outcome.proposal.lengths
    return [b for b, on in enumerate(outcome.active) if on and lengths[b] > 0]


class HeuristicSchedule(ConstantSchedule):
    """Grow k by `grow` after a step in which every drafting row accepted all its drafts, shrink it
    by `shrink` otherwise; start at `start` (default k_max) at every generation. The constants are
    transformers' (`num_assistant_tokens_schedule="heuristic"`: +2 / -1)."""

    name = "heuristic"

    def __init__(self, num_speculative_tokens: int = 8, start: int | None = None, grow: int = 2, shrink: int = 1):
        super().__init__(num_speculative_tokens)
        self.start = self.k_max if start is None else start
        if not 1 <= self.start <= self.k_max:
            raise ValueError(f"schedule_args.start must be in [1, {self.k_max}], got {self.start}")
        if grow < 0 or shrink < 0:
            raise ValueError(f"schedule_args.grow and shrink must be >= 0, got {grow}, {shrink}")
        self.grow, self.shrink = grow, shrink
        self.k = self.start

    def reset(self) -> None:
        self.k = self.start

    def next_k(self, state) -> int:
        return self.k

    def observe(self, outcome, draft_s: float, verify_s: float) -> None:
        rows = _drafting_rows(outcome)
        if not rows:
            return  # nothing was proposed (an n-gram miss): no evidence either way
        full = all(outcome.accepted[b] >= outcome.proposal.lengths[b] for b in rows)
        self.k = min(self.k + self.grow, self.k_max) if full else max(self.k - self.shrink, 1)


class ConfidenceSchedule(ConstantSchedule):
    """Draft up to k_max tokens per row; a row stops after a draft whose top probability < threshold.
    The low-confidence draft itself is still proposed (as transformers does). Proposers without
    probabilities (n-gram) ignore it and draft k_max."""

    name = "confidence"
    uses_confidence = True

    def __init__(self, num_speculative_tokens: int = 8, threshold: float = 0.4):
        super().__init__(num_speculative_tokens)
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"schedule_args.threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    def keep_drafting(self, top_probs: torch.Tensor) -> torch.Tensor:
        return top_probs >= self.threshold


class CostAwareSchedule(ConstantSchedule):
    """Choose k before each step to maximise expected tokens per second on this device.

    Model. With a_i = P(draft i accepted | drafts 1..i-1 accepted) (a row that was offered fewer than
    i drafts counts as a failure at i, so n-gram misses lower the estimate), a step of k drafts emits
    E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens per row and costs
    D(k) + V(k + 1) + O seconds: drafting k tokens, verifying k + 1 tokens, and the per-step
    overhead outside both (commit, observe; measured as the time between steps not spent in them).
    The batch size multiplies E(k) for every k alike, so it does not change the choice.

    Estimates.
    - a_i: decayed counts, (accepted_i + prior * w) / (reached_i + w), every count multiplied by
      `decay` each step, so the estimate follows the text (about 1 / (1 - decay) steps of memory)
      and positions not reached for a while drift back to the prior and get tried again.
    - V(T): per-T exponential moving average of measured verification time; a T never measured is
      read off a weighted line fitted to the measured ones (slope clamped at >= 0), flat from a
      single point. D(k) likewise per k, proportional to k from a single point (a draft model's
      cost). Unmeasured widths therefore look cheap: the schedule is optimistic and measures them
      by trying, instead of paying for a calibration pass on every reset.
    - Costs are properties of the device, model and batch shape, so they are kept across
      generations; only the first generation pays for exploring. Acceptance counts are kept too,
      decayed, as the prior for the next prompt.

    `min_k = 0` lets it choose a plain step when no draft length pays for itself (a draft that is
    always rejected); decayed acceptance drifts back to the prior and makes it try drafting again.
    """

    name = "cost_aware"

    def __init__(self, num_speculative_tokens: int = 8, min_k: int = 0, start: int | None = None,
                 prior: float = 0.6, prior_weight: float = 2.0, decay: float = 0.95, cost_ema: float = 0.2):
        super().__init__(num_speculative_tokens)
        if not 0 <= min_k <= self.k_max:
            raise ValueError(f"schedule_args.min_k must be in [0, {self.k_max}], got {min_k}")
        if not 0.0 < prior < 1.0 or prior_weight <= 0 or not 0.0 < decay <= 1.0 or not 0.0 < cost_ema <= 1.0:
            raise ValueError("schedule_args: need 0 < prior < 1, prior_weight > 0, 0 < decay <= 1, 0 < cost_ema <= 1")
        self.min_k, self.prior, self.prior_weight, self.decay, self.cost_ema = min_k, prior, prior_weight, decay, cost_ema
        n = self.k_max
        self.accepted_at = [0.0] * n  # decayed count of drafts accepted at position i
        self.reached_at = [0.0] * n  # decayed count of rows that reached position i
        self.verify_s: dict[int, tuple[float, int]] = {}  # T -> (EMA seconds, observations)
        self.draft_s: dict[int, tuple[float, int]] = {}  # k -> (EMA seconds, observations)
        self.overhead_s: float = 0.0
        self._k = self.k_max if start is None else start  # the first step of all: nothing measured yet
        if not max(min_k, 1) <= self._k <= self.k_max:
            raise ValueError(f"schedule_args.start must be in [{max(min_k, 1)}, {self.k_max}], got {start}")
        self._step_start: float | None = None  # clock at the last next_k, to measure the overhead
        self._last_busy: float | None = None  # draft + verify seconds of the last step
        self.history: list[int] = []  # k chosen per step (all generations), for studies

    def reset(self) -> None:
        self._step_start = None

    # ---------------------------------------------------------------- estimates

    def acceptance(self) -> list[float]:
        """a_i for i = 1..k_max."""
        w, p = self.prior_weight, self.prior
        return [(a + p * w) / (r + w) for a, r in zip(self.accepted_at, self.reached_at)]

    def expected_tokens(self) -> list[float]:
        """E(k) for k = 0..k_max: tokens emitted per row by a step of k drafts."""
        out, run, total = [1.0], 1.0, 1.0
        for a in self.acceptance():
            run *= a
            total += run
            out.append(total)
        return out

    @staticmethod
    def _ema(table: dict[int, tuple[float, int]], key: int, seconds: float, rate: float) -> None:
        old, n = table.get(key, (seconds, 0))
        r = max(rate, 1.0 / (n + 1))  # a plain mean for the first observations, then an EMA
        table[key] = (old + r * (seconds - old), n + 1)

    @staticmethod
    def _fit(table: dict[int, tuple[float, int]], x: int, through_zero: bool) -> float:
        """Measured value at x, else a weighted least-squares line over the measured points."""
        if x in table:
            return table[x][0]
        pts = [(k, s, min(n, 10)) for k, (s, n) in table.items() if not (through_zero and k == 0)]
        if not pts:
            return 0.0  # nothing measured yet: optimistic
        if len(pts) == 1:
            k, s, _ = pts[0]
            return s * x / k if through_zero else s
        w = sum(p[2] for p in pts)
        mx = sum(p[0] * p[2] for p in pts) / w
        my = sum(p[1] * p[2] for p in pts) / w
        var = sum(p[2] * (p[0] - mx) ** 2 for p in pts)
        slope = max(sum(p[2] * (p[0] - mx) * (p[1] - my) for p in pts) / var, 0.0)
        return max(my + slope * (x - mx), 0.0)

    def step_seconds(self, k: int) -> float:
        """Predicted wall time of a step with k drafts."""
        draft = 0.0 if k == 0 else self._fit(self.draft_s, k, through_zero=True)
        return draft + self._fit(self.verify_s, k + 1, through_zero=False) + self.overhead_s

    def tokens_per_second(self) -> list[float]:
        """Predicted tokens per second per row for k = 0..k_max (0 where k is not allowed)."""
        e = self.expected_tokens()
        return [e[k] / max(self.step_seconds(k), 1e-9) if k >= self.min_k else 0.0
                for k in range(self.k_max + 1)]

    # ---------------------------------------------------------------- the protocol

    def next_k(self, state) -> int:
        now = time.perf_counter()
        if self._step_start is not None and self._last_busy is not None:
            idle = max(now - self._step_start - self._last_busy, 0.0)
            self.overhead_s += max(self.cost_ema, 1.0 / (len(self.history) + 1)) * (idle - self.overhead_s)
        self._step_start, self._last_busy = now, None
        if self.verify_s:  # before anything was measured, keep the starting k
            tps = self.tokens_per_second()
            self._k = max(range(self.min_k, self.k_max + 1), key=tps.__getitem__)
        self.history.append(self._k)
        return self._k

    def observe(self, outcome, draft_s: float, verify_s: float) -> None:
        k = self._k
        self._last_busy = draft_s + verify_s
        self._ema(self.verify_s, 1 + outcome.proposal.max_length, verify_s, self.cost_ema)
        if k > 0:
            self._ema(self.draft_s, k, draft_s, self.cost_ema)
        self.accepted_at = [a * self.decay for a in self.accepted_at]
        self.reached_at = [r * self.decay for r in self.reached_at]
        for b, on in enumerate(outcome.active):
            if not on or k == 0:
                continue
            a = outcome.accepted[b]
            for i in range(min(a + 1, k)):
                self.reached_at[i] += 1.0
            for i in range(a):
                self.accepted_at[i] += 1.0


SCHEDULES = {
    "constant": ConstantSchedule,
    "heuristic": HeuristicSchedule,
    "confidence": ConfidenceSchedule,
    "cost_aware": CostAwareSchedule,
}


def make_schedule(name: str, num_speculative_tokens: int, **args):
    """`method.schedule` + `method.schedule_args` -> a schedule object (objects pass through)."""
    if not isinstance(name, str):
        return name
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULES)}")
    return SCHEDULES[name](num_speculative_tokens, **args)
