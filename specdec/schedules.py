"""Draft-length schedules: how many tokens to propose at each step.

A schedule picks k before each step (`next_k`), may stop drafting early inside a step
(`keep_drafting`, asked by proposers that draft token by token), and learns from each outcome
(`observe`). The constant schedule is the classic fixed k.
"""

from __future__ import annotations

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
