"""Verifier rules on constructed distributions: greedy prefix rule, and the losslessness of
speculative sampling checked statistically (first token, second token, the bonus token after the
last accepted draft, whole sequences of rows with ragged draft lengths), with a deliberately broken
verifier failing the check; and `probabilities` against transformers' own warpers."""

import pytest
import torch

from specdec.core.sampling import SamplingParams, probabilities
from specdec.core.verify import ForcedVerifier, GreedyVerifier, SpeculativeSamplingVerifier, make_verifier
from specdec.proposers.base import Proposal
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


@pytest.mark.parametrize("verifier", [GreedyVerifier(), ForcedVerifier(1.0)])
def test_padding_drafts_are_never_accepted_whichever_rows_are_full(verifier):
    """Only rows shorter than k are masked (rows of k drafts skip the mask): a full row beside a short
    one, and lengths the host does not know yet (on the device), each keep the short row's bound."""
    logits = torch.zeros(2, 4, 6)
    logits[:, :, 2] = 1.0
    drafts = torch.full((2, 3), 2)
    for proposal in (Proposal(drafts, [3, 1]), Proposal(drafts, [3, 3], device_lengths=torch.tensor([3, 1]))):
        assert verifier(logits, proposal, SamplingParams()).accepted.tolist() == [3, 1]
    assert verifier(logits, Proposal(drafts, [3, 3]), SamplingParams()).accepted.tolist() == [3, 3]


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


def _transformers_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The same shaping by transformers' own warpers, in the order generate() applies them
    (temperature, top-k, top-p, as `probabilities` does), over [N, V] rows."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = logits.reshape(-1, logits.shape[-1]).float()
    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    for warper in warpers:
        scores = warper(None, scores)
    return torch.softmax(scores, -1).reshape(logits.shape)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [
    (0.7, 0, 1.0), (1.0, 7, 1.0), (1.3, 0, 0.8), (0.6, 20, 0.9), (1.5, 5, 0.5), (2.0, 12, 0.3), (1.0, 1, 1.0)])
def test_probabilities_match_transformers_warpers_on_unsorted_logits(temperature, top_k, top_p):
    """Random (unsorted, tie-free) logits of shape [2, 3, V]: a mask computed in sorted order and
    not put back in vocabulary order, a temperature applied twice or a top-k that keeps k-1 all differ.
    Both keep the smallest set whose mass reaches top_p, the token that crosses it included."""
    logits = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(top_k + int(10 * temperature))) * 2
    params = SamplingParams(temperature, top_k, top_p)
    ours, theirs = probabilities(logits, params), _transformers_probabilities(logits, params)
    assert ours.shape == logits.shape and ours.dtype == torch.float32
    assert torch.equal(ours > 0, theirs > 0)  # the same tokens kept
    assert torch.allclose(ours, theirs, atol=1e-6, rtol=1e-5)
    if top_k or top_p < 1.0:
        assert (ours == 0).any(-1).all()  # the filters really cut every row here


def test_probabilities_by_hand_on_unsorted_logits():
    """logits [0, 2, 1, -1] (token 1 first, then 2, 0, 3): each filter keeps the right token ids."""
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    e = torch.tensor([0.0, 2.0, 1.0, -1.0], dtype=torch.float64).exp()
    two = torch.tensor([0.0, e[1], e[2], 0.0]) / (e[1] + e[2])  # tokens {1, 2}, renormalised
    # masses in order: 0.644, 0.237, 0.087, 0.032; 0.644 < 0.7, so top_p = 0.7 needs a second token
    assert torch.allclose(probabilities(logits, SamplingParams(1.0, top_p=0.7))[0].double(), two)
    assert torch.allclose(probabilities(logits, SamplingParams(1.0, top_k=2))[0].double(), two)
    hot = (torch.tensor([0.0, 2.0, 1.0, -1.0], dtype=torch.float64) / 2).softmax(-1)
    assert torch.allclose(probabilities(logits, SamplingParams(2.0))[0].double(), hot)
    # The token that crosses top_p is kept: just under a prefix's mass keeps it, just over needs one more.
    m1, m2 = float(e[1] / e.sum()), float((e[1] + e[2]) / e.sum())
    assert (probabilities(logits, SamplingParams(1.0, top_p=m1 - 1e-3)) > 0).tolist() == [[False, True, False, False]]
    assert (probabilities(logits, SamplingParams(1.0, top_p=m1 + 1e-3)) > 0).tolist() == [[False, True, True, False]]
    assert (probabilities(logits, SamplingParams(1.0, top_p=m2 + 1e-3)) > 0).tolist() == [[True, True, True, False]]
    assert (probabilities(logits, SamplingParams(1.0, top_p=1e-6)) > 0).sum() == 1  # never an empty set
    # top-k keeps every token tied with the k-th, as transformers' TopKLogitsWarper does
    tied = torch.tensor([[1.0, 3.0, 1.0, 0.0]])
    assert (probabilities(tied, SamplingParams(1.0, top_k=2)) > 0).tolist() == [[True, True, True, False]]
    assert torch.allclose(probabilities(tied, SamplingParams(1.0, top_k=2)),
                          _transformers_probabilities(tied, SamplingParams(1.0, top_k=2)))


def test_speculative_sampling_with_ragged_lengths_emits_sequences_distributed_as_p():
    """Rows of 0..3 drafts in one batch (k = 3; the padding slots hold real q's drafts): a row of L
    drafts emits a prefix of L+1 tokens, which the target's own sampling completes to L+1; that
    sequence must follow p[0] x .. x p[L]. A row that accepts all its L drafts draws its bonus from
    p[L]; a verifier that took every row's length for k would draw it from the residual at a
    padding slot instead. Each of the 4 tests has p > 1e-7 (false failure < 4e-7 in all)."""
    v, k, n = 4, 3, 20_000
    p, q = _random_dists(v, k, seed=11)
    g = torch.Generator().manual_seed(12)
    lengths = torch.arange(k + 1).repeat(n)  # [0, 1, 2, 3, 0, 1, ...]
    drafts = torch.stack([torch.multinomial(q[i], len(lengths), replacement=True, generator=g) for i in range(k)], 1)
    proposal = Proposal(drafts, lengths.tolist(), q.expand(len(lengths), k, v))
    out = SpeculativeSamplingVerifier().verify_probs(p.expand(len(lengths), k + 1, v), proposal, g)
    assert (out.accepted <= lengths).all()
    own = torch.stack([torch.multinomial(p[i], len(lengths), replacement=True, generator=g) for i in range(k + 1)], 1)
    filled = torch.arange(k + 1)[None, :] > out.accepted[:, None]  # after the emitted prefix
    seqs = torch.where(filled, own, out.tokens)
    for length in range(k + 1):
        rows = seqs[lengths == length, : length + 1]
        cells = (rows * v ** torch.arange(length, -1, -1)).sum(1)  # the sequence as a base-v number
        expected = p[0]
        for i in range(1, length + 1):
            expected = (expected[:, None] * p[i][None, :]).flatten()
        assert chi_square_pvalue(torch.bincount(cells, minlength=v ** (length + 1)), expected) > 1e-7, length
