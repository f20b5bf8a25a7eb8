"""95% intervals for speedup, tau, alpha and tokens/s: a bootstrap over prompts, and over repeats.

A run measures each method and the baseline on the same prompts, `repeats` times. A unit is one
prompt in one repeat; the method's and the baseline's results of a unit are paired. One resample
draws units with replacement:

- one repeat: draw as many prompts as there are, with replacement;
- N > 1 repeats: draw N repeats with replacement, then, within each drawn repeat, as many of its
  prompts as it holds, with replacement (prompts vary, and so does the machine from repeat to repeat).

A resample is a vector of weights, how often each unit was drawn. Each statistic is computed on the
resample as on the run itself, from summed counts (never a mean of per-prompt ratios):
speedup = (sum tokens / sum seconds of the method) / (the same of the baseline), over the same
drawn units; tau = sum emitted / sum steps; alpha = sum accepted / sum proposed. The interval is the
2.5th and 97.5th percentiles of the `RESAMPLES` values (a percentile interval), drawn with a fixed
`SEED`, so a run's summary reads the same every time it is computed. Resamples whose statistic is
undefined (nothing drafted in the drawn units) are left out.

The marks: a speedup whose interval includes 1.0, a number that rests on fewer than `MIN_STEPS`
steps in a repeat (the repeats of one prompt repeat its steps), or one without an interval (a single
unit) is `unclear`, and tables mark it.

Every method of a run is resampled with the same weights, since they are drawn from the units alone.
numpy comes with transformers, so this serves wherever the results records do.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from functools import lru_cache

import numpy as np

RESAMPLES = 2000
SEED = 0
LEVEL = 0.95
MIN_STEPS = 50  # fewer verification steps than this: too few to read tau, alpha or a speedup from
NAN_INTERVAL = (float("nan"), float("nan"))


def resample_weights(groups: Sequence[Hashable], resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """Weights [resamples, U]: how many times each of the U units is drawn in each resample.
    `groups[u]` is the repeat that unit u belongs to; a single repeat resamples units directly, several
    resample repeats first, then units within each drawn repeat. Read-only (results are cached)."""
    return _weights(tuple(groups), resamples, seed)


@lru_cache(maxsize=32)
def _weights(groups: tuple, resamples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    units = len(groups)
    weights = np.zeros((resamples, units))
    if not units:
        weights.flags.writeable = False
        return weights
    members = [np.flatnonzero([g == r for g in groups]) for r in dict.fromkeys(groups)]
    if len(members) == 1:
        drawn = np.zeros((resamples, 1), dtype=np.int64)
    else:
        drawn = rng.integers(0, len(members), size=(resamples, len(members)))
    rows = np.arange(resamples)
    for slot in range(drawn.shape[1]):
        for r, member in enumerate(members):
            who = rows[drawn[:, slot] == r]  # the resamples whose slot drew repeat r
            if not len(who):
                continue
            picks = member[rng.integers(0, len(member), size=(len(who), len(member)))]
            flat = (who[:, None] * units + picks).ravel()
            weights += np.bincount(flat, minlength=resamples * units).reshape(resamples, units)
    weights.flags.writeable = False
    return weights


def percentile_interval(values: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """The central `level` share of the finite `values`: (low, high); NaN where none is finite."""
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    if not len(values):
        return NAN_INTERVAL
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def _sums(weights: np.ndarray, column: Sequence[float]) -> np.ndarray:
    """Each resample's weighted sum of a per-unit column: [resamples]."""
    return weights @ np.asarray(column, dtype=float)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den != 0, num / np.where(den != 0, den, 1), np.nan)


def ratio_interval(weights: np.ndarray, num: Sequence[float], den: Sequence[float],
                   level: float = LEVEL) -> tuple[float, float]:
    """The interval of sum(num) / sum(den) over resampled units (tau, alpha, tokens/s)."""
    if weights.shape[1] < 2:
        return NAN_INTERVAL  # one unit: every resample is the run itself, which says nothing of its spread
    return percentile_interval(_ratio(_sums(weights, num), _sums(weights, den)), level)


def speedup_interval(weights: np.ndarray, tokens: Sequence[float], seconds: Sequence[float],
                     base_tokens: Sequence[float], base_seconds: Sequence[float],
                     level: float = LEVEL) -> tuple[float, float]:
    """The interval of (sum tokens / sum seconds) / (sum base_tokens / sum base_seconds), the method
    and the baseline summed over the same resampled units."""
    if weights.shape[1] < 2:
        return NAN_INTERVAL
    method = _ratio(_sums(weights, tokens), _sums(weights, seconds))
    base = _ratio(_sums(weights, base_tokens), _sums(weights, base_seconds))
    return percentile_interval(_ratio(method, base), level)


def _finite(x: float | None) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def few_steps(steps: int | None, repeats: int = 1) -> bool:
    """Whether a number rests on fewer than `MIN_STEPS` verification steps in a repeat (`steps`: summed
    over `repeats`)."""
    return steps is None or steps < MIN_STEPS * max(repeats, 1)


def unclear(low: float | None, high: float | None, steps: int | None, null: float | None = None,
            repeats: int = 1) -> bool:
    """Whether a table marks a number: no interval, fewer than `MIN_STEPS` steps in a repeat, or (`null`
    given: 1.0 for a speedup) an interval that includes `null`."""
    if not (_finite(low) and _finite(high)) or few_steps(steps, repeats):
        return True
    return null is not None and low <= null <= high
