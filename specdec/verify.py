"""Verifiers: given the target's logits over the drafted positions, decide what to keep.

Every verifier returns a `Verification`: row b emits `tokens[b, :accepted[b] + 1]`, i.e. its
accepted drafts followed by one target token, which is *recovered* (at the first rejection) or a
*bonus* (after the last draft). `lossless` says whether the output distribution is exactly the
target's; it is carried into every result so that a lossy method can never pass as lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.proposers.base import Proposal
from specdec.sampling import SamplingParams, greedy_tokens, probabilities, sample


@dataclass
class Verification:
    """tokens: [B, k+1] emitted tokens (first accepted[b]+1 valid); accepted: [B] long."""

    tokens: torch.Tensor
    accepted: torch.Tensor


def _draft_mask(proposal: Proposal) -> torch.Tensor:
    """[B, k] True where a real (not padding) draft token sits."""
    lengths = torch.tensor(proposal.lengths, device=proposal.tokens.device)
    return torch.arange(proposal.k, device=lengths.device)[None, :] < lengths[:, None]


def _accepted_prefix(ok: torch.Tensor) -> torch.Tensor:
    """`ok: [B, k]` bool -> length of the all-True prefix per row `[B]`."""
    return ok.long().cumprod(dim=1).sum(dim=1)


class GreedyVerifier:
    """Accept the longest prefix of drafts equal to the target's argmax; emit the argmax after it.

    The emitted tokens are the argmax at every position: accepted drafts equal it by definition.
    """

    name = "greedy"
    lossless = True

    def __call__(self, logits: torch.Tensor, proposal: Proposal, params: SamplingParams,
                 generator: torch.Generator | None = None) -> Verification:
        """logits: [B, k+1, V] target logits at the last committed token and each draft."""
        target = greedy_tokens(logits)
        ok = (proposal.tokens == target[:, : proposal.k]) & _draft_mask(proposal)
        return Verification(tokens=target, accepted=_accepted_prefix(ok))


class SpeculativeSamplingVerifier:
    """Leviathan et al. 2023 / Chen et al. 2023: accept x with probability min(1, p(x)/q(x)); at the
    first rejection sample from norm(max(p - q, 0)); if all drafts pass, sample a bonus from p.
    The emitted tokens are distributed exactly as sampling from p one token at a time.
    """

    name = "speculative_sampling"
    lossless = True

    def __call__(self, logits: torch.Tensor, proposal: Proposal, params: SamplingParams,
                 generator: torch.Generator | None = None) -> Verification:
        """logits: [B, k+1, V] target logits; proposal.probs: [B, k, V] or None (one-hot q)."""
        p = probabilities(logits, params)
        return self.verify_probs(p, proposal, generator)

    @staticmethod
    def acceptance_ratio(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
        """p(x) / q(x) per draft `[B, k]`; a draft is accepted when a uniform u falls below it."""
        return p_x / q_x

    def verify_probs(self, p: torch.Tensor, proposal: Proposal,
                     generator: torch.Generator | None = None) -> Verification:
        """p: [B, k+1, V] shaped target probabilities."""
        b, k1, v = p.shape
        k = k1 - 1
        x = proposal.tokens  # [B, k]
        q = proposal.probs
        if q is None:
            q = torch.nn.functional.one_hot(x, v).to(p.dtype)
        p_x = p[:, :k].gather(-1, x[..., None]).squeeze(-1)  # [B, k]
        q_x = q.gather(-1, x[..., None]).squeeze(-1).to(p.dtype)
        u = torch.rand(b, k, generator=generator, device=p.device)
        ok = (u < self.acceptance_ratio(p_x, q_x)) & _draft_mask(proposal)
        accepted = _accepted_prefix(ok)
        rows = torch.arange(b, device=p.device)
        p_a = p[rows, accepted]  # [B, V] target distribution at the first non-accepted slot
        lengths = torch.tensor(proposal.lengths, device=p.device)
        rejected = accepted < lengths
        if rejected.any():
            q_a = q[rows, accepted.clamp(max=max(k - 1, 0))].to(p.dtype)
            residual = (p_a - q_a).clamp(min=0)
            mass = residual.sum(-1, keepdim=True)
            # mass == 0 only when p == q at this slot, where a rejection has probability 0 anyway.
            residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_a)
            p_a = torch.where(rejected[:, None], residual, p_a)
        last = sample(p_a, generator)
        tokens = torch.cat([x, torch.zeros(b, 1, dtype=x.dtype, device=x.device)], dim=1)
        tokens[rows, accepted] = last
        return Verification(tokens=tokens, accepted=accepted)


class TypicalVerifier:
    """Medusa's typical acceptance (Cai et al. 2024): accept draft x_i while the target finds it
    plausible enough, p(x_i) > min(epsilon, delta * exp(-H(p))), with H the entropy of the shaped
    target distribution at that position; after the accepted prefix emit the target's argmax.

    LOSSY: the output is neither the target's greedy sequence nor its sampling distribution, so
    `lossless` is False and every result carries that. At temperature 0 the shaped p is a one-hot,
    the threshold min(epsilon, delta) < 1 admits only the argmax, and the rule coincides with greedy.
    """

    name = "typical"
    lossless = False

    def __init__(self, epsilon: float = 0.09, delta: float = 0.3):
        if not 0.0 < epsilon <= 1.0:
            raise ValueError(f"verifier_args.epsilon must be in (0, 1], got {epsilon}")
        if not delta > 0.0:
            raise ValueError(f"verifier_args.delta must be > 0, got {delta}")
        self.epsilon, self.delta = epsilon, delta

    def __call__(self, logits: torch.Tensor, proposal: Proposal, params: SamplingParams,
                 generator: torch.Generator | None = None) -> Verification:
        """logits: [B, k+1, V] target logits at the last committed token and each draft."""
        return self.verify_probs(probabilities(logits, params), proposal)

    def threshold(self, p: torch.Tensor) -> torch.Tensor:
        """p: [..., V] -> [...] the probability a draft token must exceed."""
        entropy = -(p * p.clamp(min=1e-30).log()).sum(-1)
        return torch.clamp(self.delta * torch.exp(-entropy), max=self.epsilon)

    def verify_probs(self, p: torch.Tensor, proposal: Proposal) -> Verification:
        """p: [B, k+1, V] shaped target probabilities."""
        k = proposal.k
        x = proposal.tokens  # [B, k]
        p_x = p[:, :k].gather(-1, x[..., None]).squeeze(-1)  # [B, k]
        ok = (p_x > self.threshold(p[:, :k])) & _draft_mask(proposal)
        accepted = _accepted_prefix(ok)
        tokens = torch.cat([x, x.new_zeros(x.shape[0], 1)], dim=1)
        rows = torch.arange(x.shape[0], device=x.device)
        tokens[rows, accepted] = p[rows, accepted].argmax(-1)
        return Verification(tokens=tokens, accepted=accepted)


VERIFIERS = ("auto", "greedy", "speculative_sampling", "typical")


def make_verifier(name, params: SamplingParams, **args):
    """`auto` picks greedy at temperature 0 and speculative sampling otherwise; `typical` takes
    `epsilon` and `delta`. A verifier object (anything with `name`, `lossless` and the call
    signature) is returned as it is."""
    if not isinstance(name, str):
        return name
    if name != "typical" and args:
        raise ValueError(f"verifier={name} takes no verifier_args, got {sorted(args)}")
    if name == "auto":
        name = "greedy" if params.greedy else "speculative_sampling"
    if name == "greedy":
        if not params.greedy:
            raise ValueError("verifier=greedy needs generation.temperature=0; use verifier=auto")
        return GreedyVerifier()
    if name == "speculative_sampling":
        if params.greedy:
            return GreedyVerifier()  # temperature 0: p is a one-hot, greedy is the same rule
        return SpeculativeSamplingVerifier()
    if name == "typical":
        return TypicalVerifier(**args)
    raise ValueError(f"unknown verifier {name!r}; choose one of: {', '.join(VERIFIERS)}")
