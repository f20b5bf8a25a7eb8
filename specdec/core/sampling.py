"""Logits -> probabilities, shaped the same way for the target (p) and the draft (q).

Speculative sampling is lossless for the *shaped* target distribution only if p and q go through
the same temperature, top-k and top-p, so there is exactly one function that does it.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch


def check_number(name: str, value: Any, integer: bool = False) -> int | float:
    """`value` as an int (`integer`) or a float, or a TypeError that names the argument: None or "0.5"
    would otherwise fail later as a bare TypeError deep inside torch. numpy scalars are numbers too."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
        what = "an integer" if integer else "a number"
        raise TypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")
    return int(value) if integer else float(value)


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. `temperature == 0` means greedy decoding (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0

    def __post_init__(self):
        for key, integer in (("temperature", False), ("top_k", True), ("top_p", False)):
            object.__setattr__(self, key, check_number(f"generation.{key}", getattr(self, key), integer))
        if not 0 <= self.temperature < float("inf"):  # as the config says: nan and inf are no temperatures
            raise ValueError(f"generation.temperature must be finite and >= 0 (0 is greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"generation.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"generation.top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`logits: [..., V]` -> float32 probabilities `[..., V]` after temperature, top-k, top-p.

    Greedy params give a one-hot at the argmax, so that a greedy run is a special case of the same
    arithmetic (used by tests; the decoding loop short-cuts greedy without calling this).
    """
    logits = logits.float()
    if params.greedy:
        return one_hot(greedy_tokens(logits), logits.shape[-1])
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it < top_p.
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """`logits: [..., V]` -> argmax ids `[...]`, taken in float32 as `transformers` generate() does
    (on CPUs argmax over bfloat16 is also about 6x slower than the cast plus a float32 argmax)."""
    return logits.float().argmax(-1)


def one_hot(ids: torch.Tensor, vocab: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`ids: [...]` -> `[..., vocab]` one-hot distributions (a deterministic draft's q). Unlike
    `F.one_hot`, it does not read the ids' range back to the host: no synchronisation on a GPU."""
    return torch.zeros(*ids.shape, vocab, dtype=dtype, device=ids.device).scatter_(-1, ids[..., None], 1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """`probs: [N, V]` -> token ids `[N]`."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
