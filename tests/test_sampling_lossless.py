"""End to end: speculative sampling with a real (tiny) draft model preserves the target's
distribution. The joint distribution of two tokens produced inside one speculative step is
compared, by a chi-square test, with the exact one computed from the target; a verifier that
treats q as 1 fails the same test."""

import pytest
import torch

from specdec.decoding import SpeculativeDecoder
from specdec.engine import Engine
from specdec.models import tiny_random_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.sampling import SamplingParams, probabilities
from tests.stats import chi_square_pvalue
from tests.test_verify import QAsOneVerifier

V = 8
PROMPT = [3, 5, 2]
PARAMS = SamplingParams(temperature=0.9, top_k=6)


@pytest.fixture(scope="module")
def models():
    return (tiny_random_model(seed=11, vocab_size=V, eos_token_id=None, logit_std=1.5),
            tiny_random_model(seed=12, vocab_size=V, num_layers=1, eos_token_id=None, logit_std=1.5))


def _exact_joint_of_tokens_2_and_3(target) -> torch.Tensor:
    """P(t2, t3) = sum_t1 p(t1) p(t2|t1) p(t3|t1,t2), over the shaped target distribution."""
    with torch.inference_mode():
        grid = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V*V, 2] (t1, t2)
        seqs = torch.cat([torch.tensor(PROMPT).expand(V * V, -1), grid], 1)
        p = probabilities(target(seqs).logits[:, -3:], PARAMS)  # positions predicting t1, t2, t3
    p1 = p[0, 0]  # [V]
    p2 = p[:, 1].view(V, V, V)[:, 0]  # [t1, t2]
    p3 = p[:, 2].view(V, V, V)  # [t1, t2, t3]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return joint.sum(0).flatten()


def _sample_tokens_2_and_3(models, verifier, n=30_000) -> torch.Tensor:
    target, draft = models
    engine = Engine(target, draft, dtype="float32")
    dec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=2, verifier=verifier)
    out = dec.generate([PROMPT] * n, max_new_tokens=3, temperature=PARAMS.temperature, top_k=PARAMS.top_k, seed=0)
    pairs = torch.tensor([o[1:3] for o in out.output_ids])
    assert out.stats.steps >= 1 and 0.05 < out.stats.acceptance_rate < 0.95  # the draft really differs
    return torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)


def test_speculative_sampling_preserves_the_joint_distribution(models):
    expected = _exact_joint_of_tokens_2_and_3(models[0])
    assert chi_square_pvalue(_sample_tokens_2_and_3(models, "auto"), expected) > 1e-3


def test_broken_verifier_fails_the_same_test(models):
    expected = _exact_joint_of_tokens_2_and_3(models[0])
    assert chi_square_pvalue(_sample_tokens_2_and_3(models, QAsOneVerifier()), expected) < 1e-6
