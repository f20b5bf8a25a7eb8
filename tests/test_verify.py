"""Verifier rules on constructed distributions: greedy prefix rule, and the losslessness of
speculative sampling checked statistically (first token, second token, the bonus token after the
last accepted draft), with a deliberately broken verifier failing the check."""

import torch

from specdec.proposers.base import Proposal
from specdec.sampling import SamplingParams, probabilities
from specdec.verify import GreedyVerifier, SpeculativeSamplingVerifier, make_verifier
from tests.stats import chi_square_pvalue


def test_greedy_accepts_longest_matching_prefix_then_emits_target_token():
    # target argmax per position: 3, 1, 4, 1 (k = 3 drafts, plus the bonus slot)
    logits = torch.full((2, 4, 6), -5.0)
    for i, t in enumerate([3, 1, 4, 1]):
        logits[:, i, t] = 5.0
    drafts = torch.tensor([[3, 1, 0], [3, 1, 4]])
    out = GreedyVerifier()(logits, Proposal(drafts, [3, 3]), SamplingParams())
    assert out.accepted.tolist() == [2, 3]
    assert out.tokens[0, :3].tolist() == [3, 1, 4]  # two accepted + recovered 4
    assert out.tokens[1, :4].tolist() == [3, 1, 4, 1]  # three accepted + bonus 1


def test_greedy_respects_per_row_draft_lengths():
    logits = torch.zeros(1, 4, 6)
    logits[0, :, 2] = 1.0
    out = GreedyVerifier()(logits, Proposal(torch.tensor([[2, 2, 2]]), [1]), SamplingParams())
    assert out.accepted.tolist() == [1]  # the padding drafts are never accepted


def _random_dists(v: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, v, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(k, v, generator=g) * 1.5, -1)
    return p, q


class QAsOneVerifier(SpeculativeSamplingVerifier):
    """Deliberately broken: accepts with min(1, p(x)), as if q(x) were 1."""

    @staticmethod
    def acceptance_ratio(p_x, q_x):
        return p_x


def _first_emitted_counts(verifier, p, q, n: int, seed: int):
    """Draft n rows from q, verify against p; histogram of the first emitted token."""
    g = torch.Generator().manual_seed(seed)
    k, v = q.shape
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(k)], 1)
    proposal = Proposal(drafts, [k] * n, q.expand(n, k, v))
    out = verifier.verify_probs(p.expand(n, k + 1, v), proposal, g)
    return torch.bincount(out.tokens[:, 0], minlength=v), out


def test_speculative_sampling_first_token_follows_p():
    p, q = _random_dists(v=6, k=3, seed=0)
    counts, out = _first_emitted_counts(SpeculativeSamplingVerifier(), p, q, n=40_000, seed=1)
    assert chi_square_pvalue(counts, p[0]) > 1e-3
    # The expected acceptance of the first draft is sum_x min(p, q): checks the accept rule itself.
    alpha = torch.minimum(p[0], q[0]).sum()
    assert abs((out.accepted > 0).float().mean() - alpha) < 0.01


def test_speculative_sampling_second_token_follows_p_given_first_accepted():
    p, q = _random_dists(v=5, k=2, seed=3)
    _, out = _first_emitted_counts(SpeculativeSamplingVerifier(), p, q, n=60_000, seed=4)
    second = out.tokens[out.accepted >= 1, 1]  # accepted or recovered/bonus after an accepted first
    assert chi_square_pvalue(torch.bincount(second, minlength=5), p[1]) > 1e-3


def test_bonus_token_follows_p_at_the_slot_after_the_last_draft():
    """q == p: every draft is accepted, so every row draws the bonus, which must follow p[k]
    (drawing it from p[k-1], the last draft's slot, fails here)."""
    p, _ = _random_dists(v=6, k=2, seed=7)
    _, out = _first_emitted_counts(SpeculativeSamplingVerifier(), p, p[:2].clone(), n=40_000, seed=8)
    assert (out.accepted == 2).all()
    assert chi_square_pvalue(torch.bincount(out.tokens[:, 2], minlength=6), p[2]) > 1e-3


def test_bonus_token_follows_p_given_all_drafts_accepted():
    """The same with q != p: among the rows that accepted both drafts, the bonus follows p[k]."""
    p, q = _random_dists(v=5, k=2, seed=9)
    _, out = _first_emitted_counts(SpeculativeSamplingVerifier(), p, q, n=60_000, seed=10)
    full = out.accepted == 2
    assert full.sum() > 5_000
    assert chi_square_pvalue(torch.bincount(out.tokens[full, 2], minlength=5), p[2]) > 1e-3


def test_deterministic_draft_is_lossless_with_one_hot_q():
    p, q = _random_dists(v=6, k=2, seed=5)
    drafts = torch.full((30_000, 2), 2)  # always proposes token 2, twice
    g = torch.Generator().manual_seed(6)
    out = SpeculativeSamplingVerifier().verify_probs(p.expand(30_000, 3, 6), Proposal(drafts, [2] * 30_000), g)
    assert chi_square_pvalue(torch.bincount(out.tokens[:, 0], minlength=6), p[0]) > 1e-3


def test_broken_verifier_that_treats_q_as_one_fails_the_same_test():
    p, q = _random_dists(v=6, k=3, seed=0)
    counts, _ = _first_emitted_counts(QAsOneVerifier(), p, q, n=40_000, seed=1)
    assert chi_square_pvalue(counts, p[0]) < 1e-6


def test_probabilities_shape_top_k_top_p_and_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert probabilities(logits, SamplingParams(1.0, top_k=2))[0, 2:].sum() == 0
    probs = probabilities(logits, SamplingParams(1.0, top_p=0.7))
    assert probs[0, 0] > 0 and probs[0, 1] > 0 and probs[0, 2:].sum() == 0  # 0.64 < 0.7 needs two
    assert torch.allclose(probs.sum(-1), torch.ones(1))
    cold, hot = probabilities(logits, SamplingParams(0.5)), probabilities(logits, SamplingParams(2.0))
    assert cold[0, 0] > hot[0, 0]


def test_make_verifier_chooses_greedy_at_temperature_zero():
    assert make_verifier("auto", SamplingParams(0.0)).name == "greedy"
    assert make_verifier("auto", SamplingParams(0.7)).name == "speculative_sampling"
