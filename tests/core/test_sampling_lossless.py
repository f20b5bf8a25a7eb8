"""End to end: speculative sampling with a real (tiny) draft model preserves the target's
distribution. The joint distribution of the three tokens produced by one speculative step with
k = 2 (two drafts, accepted or recovered, and the bonus after both) is compared, by a chi-square
test, with the exact one computed from the target; a verifier that treats q as 1 fails the same test.
The same at top_p < 1, where p and q are cut to their nucleus; a verifier that forgets it fails.

The draft's own state (its KV cache rollback) cannot show here: speculative sampling is lossless
for any q, as long as the q that drafted is the q that verifies. tests/core/test_decoding.py checks the
draft's cache after every step against a fresh pass instead.
"""

from dataclasses import replace

import pytest
import torch

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.core.sampling import SamplingParams, probabilities
from specdec.core.verify import SpeculativeSamplingVerifier
from specdec.models import tiny_random_model
from specdec.proposers.draft_model import DraftModelProposer
from tests.core.test_verify import QAsOneVerifier
from tests.stats import chi_square_pvalue

V = 8
PROMPT = [3, 5, 2]
PARAMS = SamplingParams(temperature=0.9, top_k=6)


@pytest.fixture(scope="module")
def models():
    return (tiny_random_model(seed=11, vocab_size=V, eos_token_id=None, logit_std=1.5),
            tiny_random_model(seed=12, vocab_size=V, num_layers=1, eos_token_id=None, logit_std=1.5))


def _exact_joint_of_tokens_2_to_4(target, params: SamplingParams = PARAMS) -> torch.Tensor:
    """P(t2, t3, t4) = sum_t1 p(t1) p(t2|t1) p(t3|t1,t2) p(t4|t1,t2,t3), over the shaped target
    distribution, flattened to [V**3] in (t2, t3, t4) order."""
    with torch.inference_mode():
        grid = torch.cartesian_prod(*[torch.arange(V)] * 3)  # [V**3, 3]: (t1, t2, t3)
        seqs = torch.cat([torch.tensor(PROMPT).expand(len(grid), -1), grid], 1)
        p = probabilities(target(seqs).logits[:, -4:], params)  # positions predicting t1 .. t4
    rows = torch.arange(len(grid))
    prefix = p[rows, 0, grid[:, 0]] * p[rows, 1, grid[:, 1]] * p[rows, 2, grid[:, 2]]  # P(t1, t2, t3)
    joint = prefix[:, None] * p[:, 3]  # [V**3, V]: P(t1, t2, t3, t4)
    return joint.view(V, V**3).sum(0)


def _sample_tokens_2_to_4(models, verifier, n=30_000, params: SamplingParams = PARAMS) -> torch.Tensor:
    target, draft = models
    engine = Engine(target, draft, dtype="float32")
    dec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=2, verifier=verifier)
    out = dec.generate([PROMPT] * n, max_new_tokens=4, temperature=params.temperature, top_k=params.top_k,
                       top_p=params.top_p, seed=0)
    t = torch.tensor([o[1:4] for o in out.output_ids])
    assert out.stats.steps >= 1 and 0.05 < out.stats.acceptance_rate < 0.95  # the draft really differs
    # A row done in one step accepted both drafts: its token 4 is the bonus. Enough of them to count.
    assert sum(r.steps == 1 for r in out.stats.rows) > 0.05 * n
    return torch.bincount(t[:, 0] * V * V + t[:, 1] * V + t[:, 2], minlength=V**3)


def test_speculative_sampling_preserves_the_joint_distribution(models):
    expected = _exact_joint_of_tokens_2_to_4(models[0])
    assert chi_square_pvalue(_sample_tokens_2_to_4(models, "auto"), expected) > 1e-3


def test_broken_verifier_fails_the_same_test(models):
    expected = _exact_joint_of_tokens_2_to_4(models[0])
    assert chi_square_pvalue(_sample_tokens_2_to_4(models, QAsOneVerifier()), expected) < 1e-6


NUCLEUS = SamplingParams(temperature=1.5, top_p=0.8)


class NoTopPVerifier(SpeculativeSamplingVerifier):
    """Deliberately broken: verifies against the target's distribution without its nucleus."""

    def __call__(self, logits, proposal, params, generator=None):
        return super().__call__(logits, proposal, replace(params, top_p=1.0), generator)


def _nucleus_counts(models, verifier) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled and exact joints of one step at top_p < 1 (top_k off), 8,000 rows."""
    expected = _exact_joint_of_tokens_2_to_4(models[0], NUCLEUS)
    assert 0.5 < float((expected == 0).double().mean()) < 0.9  # the nucleus really cuts (82% of cells)
    return _sample_tokens_2_to_4(models, verifier, n=8_000, params=NUCLEUS), expected


def test_speculative_sampling_with_top_p_preserves_the_nucleus_joint_distribution(models):
    """p and q both cut to their nucleus, so a draft outside the target's is always rejected: the
    step's joint is the target's nucleus-shaped one (p > 1e-7: false failure < 1e-7), and nothing
    outside the nucleus is ever emitted (the chi-square sees those only pooled with rare cells)."""
    counts, expected = _nucleus_counts(models, "auto")
    assert int(counts[expected == 0].sum()) == 0
    assert chi_square_pvalue(counts, expected) > 1e-7


def test_verifier_without_the_nucleus_fails_the_same_test(models):
    counts, expected = _nucleus_counts(models, NoTopPVerifier())
    assert int(counts[expected == 0].sum()) > 1_000  # 2,524 of 8,000 here
    assert chi_square_pvalue(counts, expected) < 1e-12
