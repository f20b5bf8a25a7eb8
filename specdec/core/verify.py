"""Verifiers: given the target's logits over the drafted positions, decide what to keep.

greedy and speculative sampling (token by token) and block verification (the block judged jointly)
are lossless; typical acceptance and forced acceptance (a benchmark tool) are not, and say so.

Every verifier returns a `Verification`: row b emits `tokens[b, :accepted[b] + 1]`, i.e. its
accepted drafts followed by one target token, which is *recovered* (at the first rejection) or a
*bonus* (after the last draft). `lossless` says whether the output distribution is exactly the
target's; it is carried into every result so that a lossy method can never pass as lossless.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdec.core.arguments import build_named
from specdec.core.device import to_device
from specdec.core.sampling import SamplingParams, greedy_tokens, one_hot, probabilities, sample
from specdec.core.types import Proposal, Verification

__all__ = ["BlockVerifier", "ByTemperature", "ForcedVerifier", "GreedyVerifier", "SpeculativeSamplingVerifier",
           "TypicalVerifier", "Verification", "make_verifier"]


def _draft_mask(proposal: Proposal) -> torch.Tensor:
    """[B, k] True where a real (not padding) draft token sits."""
    lengths = proposal.lengths_on(proposal.tokens.device)
    return torch.arange(proposal.k, device=lengths.device)[None, :] < lengths[:, None]


def _only_real(ok: torch.Tensor, proposal: Proposal) -> torch.Tensor:
    """`ok: [B, k]` with every padding slot (past a row's draft length) False. When the host knows
    that every row has k drafts (a draft model's steps, always), `ok` as it is: no upload of the
    lengths and no kernels, a step's verifier being launches the host pays on a GPU."""
    if proposal.settled and all(n == proposal.k for n in proposal.lengths):
        return ok
    return ok & _draft_mask(proposal)


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
        if proposal.k == 0:  # a plain decoding step: nothing to compare, fewer kernels to launch
            return Verification(tokens=target, accepted=target.new_zeros(target.shape[0]))
        ok = _only_real(proposal.tokens == target[:, : proposal.k], proposal)
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
            q = one_hot(x, v, p.dtype)
        p_x = p[:, :k].gather(-1, x[..., None]).squeeze(-1)  # [B, k]
        q_x = q.gather(-1, x[..., None]).squeeze(-1).to(p.dtype)
        u = torch.rand(b, k, generator=generator, device=p.device)
        ok = (u < self.acceptance_ratio(p_x, q_x)) & _draft_mask(proposal)
        accepted = _accepted_prefix(ok)
        rows = torch.arange(b, device=p.device)
        p_a = p[rows, accepted]  # [B, V] target distribution at the first non-accepted slot
        lengths = proposal.lengths_on(p.device)
        rejected = accepted < lengths
        if k:  # computed for every row and kept where it rejected: asking whether any did is a host sync
            q_a = q[rows, accepted.clamp(max=k - 1)].to(p.dtype)
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
    the threshold min(epsilon, delta) < 1 admits only the argmax (and 1 admits nothing), and the
    rule coincides with greedy: a greedy generation is lossless (`lossless_when_greedy`).
    """

    name = "typical"
    lossless = False
    lossless_when_greedy = True

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
        ok = _only_real(p_x > self.threshold(p[:, :k]), proposal)
        accepted = _accepted_prefix(ok)
        tokens = torch.cat([x, x.new_zeros(x.shape[0], 1)], dim=1)
        rows = torch.arange(x.shape[0], device=x.device)
        tokens[rows, accepted] = p[rows, accepted].argmax(-1)
        return Verification(tokens=tokens, accepted=accepted)


class BlockVerifier:
    """Block verification (Sun et al. 2024, "Block verification accelerates speculative decoding",
    arXiv 2403.10444, Algorithm 2): the drafted block is judged jointly instead of token by token.

    With p the target's and q the draft's shaped distributions after the first i drafts X^i:

        w_0 = 1,  w_i = min(1, w_{i-1} p(X_i | X^{i-1}) / q(X_i | X^{i-1}))      (a weight per prefix)
        r_i = sum_x max(w_i p(x | X^i) - q(x | X^i), 0)                          (its residual mass)
        h_i = r_i / (r_i + 1 - w_i) for i < gamma,  h_gamma = w_gamma             (keep-X^i probability)

    Draw eta_i ~ U(0, 1) and keep the longest prefix X^tau with eta_tau <= h_tau (tau = 0 if none),
    not the first failure as token-level verification does: a draft may fail alone yet be kept with
    the drafts after it. Then emit one target token: from p(. | X^gamma) if tau = gamma (the bonus),
    else from the residual norm(max(w_tau p(. | X^tau) - q(. | X^tau), 0)) (recovered; tau = 0 gives
    the token-level residual). The output is distributed exactly as sampling from p, and the
    expected number of accepted drafts is at least token-level verification's on the same drafts
    (the paper's Theorems 1 and 2; tests/test_block_forced.py checks both exactly and by sampling).
    A row with gamma_b < k drafts is a block of gamma_b.
    """

    name = "block"
    lossless = True

    def __call__(self, logits: torch.Tensor, proposal: Proposal, params: SamplingParams,
                 generator: torch.Generator | None = None) -> Verification:
        """logits: [B, k+1, V] target logits; proposal.probs: [B, k, V] or None (one-hot q)."""
        return self.verify_probs(probabilities(logits, params), proposal, generator)

    @staticmethod
    def draft_probs(p: torch.Tensor, proposal: Proposal) -> torch.Tensor:
        """q: [B, k, V], one-hot at the drafts for a deterministic proposer."""
        if proposal.probs is not None:
            return proposal.probs.to(p.dtype)
        return one_hot(proposal.tokens, p.shape[-1], p.dtype)

    @staticmethod
    def weights(p: torch.Tensor, q: torch.Tensor, proposal: Proposal) -> torch.Tensor:
        """w: [B, k+1], w[:, i] = w_i for the prefix of i drafts (w_0 = 1); 0 past a row's drafts."""
        x = proposal.tokens
        k = proposal.k
        mask = _draft_mask(proposal)
        p_x = p[:, :k].gather(-1, x[..., None]).squeeze(-1)  # [B, k]
        q_x = q.gather(-1, x[..., None]).squeeze(-1)  # > 0 wherever a real draft was sampled from q
        ratio = torch.where(mask, p_x / q_x.clamp(min=1e-30), torch.zeros_like(p_x))
        w = [torch.ones(p.shape[0], dtype=p.dtype, device=p.device)]
        for i in range(k):
            w.append(torch.clamp(w[-1] * ratio[:, i], max=1.0))
        return torch.stack(w, dim=1)

    @staticmethod
    def residual_mass(p: torch.Tensor, q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """r: [B, k], r[:, i] = sum_x max(w_i p(x | X^i) - q(x | X^i), 0) for i = 0..k-1."""
        k = q.shape[1]
        return (w[:, :k, None] * p[:, :k] - q).clamp(min=0).sum(-1)

    @staticmethod
    def keep_probability(r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """h_i = r_i / (r_i + 1 - w_i), for prefixes shorter than the block."""
        stop = r + 1 - w
        # r_i + 1 - w_i = 0 means w_i = 1 and p = q after X^i: then w_{i+1} = 1 and a later h is 1,
        # so h_i is never the one that decides; 0 keeps the arithmetic finite.
        return torch.where(stop > 0, r / stop.clamp(min=1e-30), torch.zeros_like(r))

    def keep_probabilities(self, p: torch.Tensor, q: torch.Tensor, proposal: Proposal,
                           w: torch.Tensor) -> torch.Tensor:
        """h: [B, k], h[:, i-1] = h_i, the probability of keeping X^i when no longer prefix is kept."""
        k = proposal.k
        h = self.keep_probability(self.residual_mass(p, q, w)[:, 1:], w[:, 1:k])  # h_1 .. h_{k-1}
        h = torch.cat([h, torch.zeros_like(w[:, :1])], dim=1)  # [B, k], a slot for h_k
        lengths = proposal.lengths_on(p.device)
        last = (lengths - 1).clamp(min=0)
        rows = torch.arange(p.shape[0], device=p.device)
        h[rows, last] = w[rows, lengths]  # h_gamma = w_gamma at each row's own block length
        return h * _draft_mask(proposal)

    def residual(self, p_t: torch.Tensor, q_t: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
        """p_t, q_t: [B, V] at the kept prefix X^tau, w_t: [B] -> norm(max(w_tau p - q, 0)) [B, V]."""
        res = (w_t[:, None] * p_t - q_t).clamp(min=0)
        mass = res.sum(-1, keepdim=True)
        # mass 0 happens only with probability 0 (the prefix is kept only if its h > 0, i.e. r > 0).
        return torch.where(mass > 0, res / mass.clamp(min=1e-30), p_t)

    def verify_probs(self, p: torch.Tensor, proposal: Proposal,
                     generator: torch.Generator | None = None) -> Verification:
        """p: [B, k+1, V] shaped target probabilities."""
        b, k = p.shape[0], proposal.k
        x = proposal.tokens
        rows = torch.arange(b, device=p.device)
        q = self.draft_probs(p, proposal)
        w = self.weights(p, q, proposal)
        h = self.keep_probabilities(p, q, proposal, w)  # [B, k]
        eta = torch.rand(b, k, generator=generator, device=p.device)
        kept = (eta <= h) & (h > 0)
        positions = torch.arange(1, k + 1, device=p.device)
        tau = (kept * positions).amax(dim=1) if k else torch.zeros(b, dtype=torch.long, device=p.device)
        lengths = proposal.lengths_on(p.device)
        p_t = p[rows, tau]
        if k:
            q_t = q[rows, tau.clamp(max=k - 1)]
            dist = torch.where((tau < lengths)[:, None], self.residual(p_t, q_t, w[rows, tau]), p_t)
        else:
            dist = p_t
        tokens = torch.cat([x, x.new_zeros(b, 1)], dim=1)
        tokens[rows, tau] = sample(dist, generator)
        return Verification(tokens=tokens, accepted=tau)


class ForcedVerifier:
    """Forced acceptance, for benchmarks only: draft i is accepted with probability a_i given drafts
    1..i-1 were, whatever it is, and the first slot not accepted gets the target's own token (its
    argmax at temperature 0, a sample from its shaped p otherwise). The accepted drafts are kept even
    when the target would never have produced them: the point is to set the acceptance curve apart
    from draft quality, to check the cost model (speed as a function of acceptance and k).

    LOSSY, by construction: `lossless` is False, results carry it and tables mark the method lossy.

    acceptance: [a_1, ..., a_k], one probability per draft position (at least k of them), or one
                number for the same a at every position.
    """

    name = "forced"
    lossless = False

    def __init__(self, acceptance: float | Sequence[float]):
        values = [acceptance] if isinstance(acceptance, (int, float)) else list(acceptance)
        if not values or not all(isinstance(a, (int, float)) and 0.0 <= a <= 1.0 for a in values):
            raise ValueError("verifier_args.acceptance must be a probability in [0, 1] or a list of them, "
                             f"one per draft position, e.g. [0.9, 0.8, 0.7, 0.6]; got {acceptance!r}")
        self.constant = isinstance(acceptance, (int, float))
        self.acceptance = [float(a) for a in values]
        self._curves: dict[tuple, torch.Tensor] = {}
        # Uniforms drawn per step: the decoder's k (`check_k`), also for a step whose drafts a row's
        # room cut shorter, so that the generator's stream does not depend on where steps were cut.
        self.width = 0

    def check_k(self, k: int) -> None:
        """Raise unless the curve covers k draft positions."""
        self.width = max(self.width, k)
        if not self.constant and k > len(self.acceptance):
            raise ValueError(f"verifier_args.acceptance has {len(self.acceptance)} values but k = {k} drafts "
                             "are proposed per step; give one probability per position (or one number "
                             "for all of them)")

    def curve(self, k: int) -> torch.Tensor:
        """[k] a_1 .. a_k."""
        self.check_k(k)
        return torch.tensor(self.acceptance * k if self.constant else self.acceptance[:k])

    def _curve_on(self, k: int, device: torch.device) -> torch.Tensor:
        """`curve(k)` on `device`, uploaded once per (k, device) rather than at every step."""
        key = (k, torch.device(device))
        if key not in self._curves:
            self._curves[key] = to_device(self.curve(k), device, dtype=torch.float32)
        return self._curves[key]

    def __call__(self, logits: torch.Tensor, proposal: Proposal, params: SamplingParams,
                 generator: torch.Generator | None = None) -> Verification:
        """logits: [B, k+1, V] target logits at the last committed token and each draft."""
        u = self.draw(logits.shape[0], max(proposal.k, self.width), logits.device, generator)[:, :proposal.k]
        return self.decide(logits, proposal, params, u, generator)

    @staticmethod
    def draw(b: int, k: int, device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
        """`[B, k]` the uniforms a step's acceptance is decided by: drawn apart from `decide`, so that
        a step captured as one CUDA graph takes them as an input (`specdec.accel.pipeline`)."""
        return torch.rand(b, k, generator=generator, device=device)

    def decide(self, logits: torch.Tensor, proposal: Proposal, params: SamplingParams, u: torch.Tensor,
               generator: torch.Generator | None = None) -> Verification:
        """The step given its uniforms `u: [B, k]` (`draw`); draws nothing more at temperature 0."""
        b, k = logits.shape[0], proposal.k
        ok = _only_real(u < self._curve_on(k, logits.device), proposal)
        accepted = _accepted_prefix(ok)
        rows = torch.arange(b, device=logits.device)
        at = logits[rows, accepted]  # [B, V] the target at the first slot not accepted
        last = greedy_tokens(at) if params.greedy else sample(probabilities(at, params), generator)
        tokens = torch.cat([proposal.tokens, proposal.tokens.new_zeros(b, 1)], dim=1)
        tokens[rows, accepted] = last
        return Verification(tokens=tokens, accepted=accepted)


class ByTemperature:
    """A rule that depends on the temperature: `greedy` serves temperature 0, `sampling` the rest;
    either may be None (not served). At temperature 0 every lossless rule is the greedy one, since p
    is one-hot, so lossless sampling verifiers name GreedyVerifier for it (conf/method/verifier/)."""

    def __init__(self, greedy=None, sampling=None):
        self.greedy, self.sampling = greedy, sampling
        self.label: str | None = None  # how errors name it (the study sets `verifier=<name>`)

    def pick(self, params: SamplingParams, label: str):
        chosen = self.greedy if params.greedy else self.sampling
        if chosen is None:
            need = "generation.temperature > 0" if params.greedy else "generation.temperature=0"
            raise ValueError(f"{label} needs {need}; use verifier=auto")
        return chosen


def _speculative_sampling() -> ByTemperature:
    """Greedy at temperature 0, speculative sampling above it (`auto`)."""
    return ByTemperature(GreedyVerifier(), SpeculativeSamplingVerifier())


def _greedy_only() -> ByTemperature:
    """Greedy at temperature 0 and nothing above it."""
    return ByTemperature(GreedyVerifier())


def _block() -> ByTemperature:
    """Greedy at temperature 0, block verification above it."""
    return ByTemperature(GreedyVerifier(), BlockVerifier())


# The verifiers a name gives (`verifier="auto"`), each called with `verifier_args`. The study layer
# builds named verifiers from conf/method/verifier/ (which may name others) and hands the objects over.
VERIFIERS: dict[str, Callable] = {"auto": _speculative_sampling, "speculative_sampling": _speculative_sampling,
                                  "greedy": _greedy_only, "block": _block, "typical": TypicalVerifier,
                                  "forced": ForcedVerifier}


def make_verifier(spec, params: SamplingParams, **args):
    """`spec`: a name of `VERIFIERS`, called with `args` (`verifier_args`), or a verifier object
    (anything with `name`, `lossless` and the call signature), returned as it is; a `ByTemperature`
    rule is resolved for `params`."""
    if isinstance(spec, str):
        verifier = build_named("verifier", VERIFIERS, spec, args)
    elif args:
        raise ValueError(f"verifier arguments {sorted(args)} given with a verifier object; pass them to it")
    else:
        verifier = spec
    if isinstance(verifier, ByTemperature):
        verifier = verifier.pick(params, verifier.label or (f"verifier={spec}" if isinstance(spec, str) else "verifier"))
    return verifier
