"""The proposer protocol: how a way of drafting plugs into the decoding loop.

A proposer sees the decoding state (tokens so far, per row) and returns a `Proposal` of up to k
tokens per row, with the draft probabilities q when it has them. After verification it gets an
`observe` call with the outcome, so that it can roll back its own state (a draft model's KV cache)
or learn (acceptance statistics). Nothing else is required: a new strategy is one module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from specdec.decoding import DecodeState, StepOutcome


@dataclass
class Proposal:
    """Draft tokens for one step.

    tokens:  [B, k] proposed token ids; row b's first `lengths[b]` are real, the rest padding.
    lengths: per row, how many tokens were proposed (0 <= lengths[b] <= k); on the host.
    probs:   [B, k, V] draft probabilities q, or None for a deterministic proposer (q is then a
             one-hot at the proposed token, which keeps speculative sampling lossless).
    """

    tokens: torch.Tensor
    lengths: list[int]
    probs: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return self.tokens.shape[1]

    @property
    def max_length(self) -> int:
        return max(self.lengths, default=0)

    @staticmethod
    def empty(batch_size: int, device: torch.device | str) -> Proposal:
        """No drafts: the step is a plain decoding step."""
        return Proposal(torch.zeros(batch_size, 0, dtype=torch.long, device=device), [0] * batch_size)


class Proposer(Protocol):
    """What the decoding loop needs from a way of drafting."""

    name: str

    def reset(self, state: DecodeState) -> None:
        """A new generation starts (or continues a conversation): drop or trim per-request state."""

    def propose(self, state: DecodeState, k: int) -> Proposal:
        """Up to `k` draft tokens per row, continuing `state.tokens[b, :state.seq_lens[b]]`."""

    def observe(self, state: DecodeState, outcome: StepOutcome) -> None:
        """The verifier's outcome for the last proposal; `state` is already committed."""
