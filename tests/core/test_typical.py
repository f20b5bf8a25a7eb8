"""Typical acceptance (Medusa): the rule p(x) > min(epsilon, delta * exp(-H(p))) on constructed
distributions, the argmax after the accepted prefix, and that it is never reported as lossless."""

import math

import pytest
import torch

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.sampling import SamplingParams
from specdec.core.verify import GreedyVerifier, TypicalVerifier, make_verifier
from specdec.proposers.base import Proposal
from specdec.proposers.draft_model import DraftModelProposer
from tests.conftest import RAGGED_PROMPTS


def _dist(*probs, v=8):
    """A [v] distribution from the given leading probabilities, the rest spread evenly."""
    head = torch.tensor(probs)
    rest = (1 - head.sum()) / (v - len(probs))
    return torch.cat([head, rest.expand(v - len(probs))])


def test_threshold_is_the_smaller_of_epsilon_and_the_entropy_term():
    v = TypicalVerifier(epsilon=0.09, delta=0.3)
    peaked = _dist(0.97, 0.01)  # low entropy: delta * exp(-H) ~ 0.26 > epsilon
    flat = torch.full((8,), 1 / 8)  # H = ln 8: delta / 8 = 0.0375 < epsilon
    assert v.threshold(peaked).item() == pytest.approx(0.09)
    assert v.threshold(flat).item() == pytest.approx(0.3 / 8)
    h = -(peaked * peaked.log()).sum()
    assert v.threshold(peaked).item() == pytest.approx(min(0.09, 0.3 * math.exp(-h)))


def test_accepts_plausible_tokens_and_rejects_implausible_ones():
    v = TypicalVerifier(epsilon=0.09, delta=0.3)
    # Position 1: flat-ish target, token 1 has p = 0.2 > threshold -> accepted although not the argmax.
    # Position 2: peaked target, token 1 has p = 0.05 < 0.09 -> rejected; the argmax 0 is emitted.
    p = torch.stack([_dist(0.3, 0.2, 0.1), _dist(0.9, 0.05), _dist(0.5, 0.1)])[None]  # [1, 3, V]
    out = v.verify_probs(p, Proposal(torch.tensor([[1, 1]]), [2]))
    assert out.accepted.tolist() == [1]
    assert out.tokens[0, :2].tolist() == [1, 0]
    # All accepted: the bonus is the argmax of the last position.
    out = v.verify_probs(p, Proposal(torch.tensor([[0, 0]]), [2]))
    assert out.accepted.tolist() == [2] and out.tokens[0].tolist() == [0, 0, 0]


def test_the_entropy_term_decides_on_flat_distributions():
    # V = 64 uniform: p(x) = 1/64 ~ 0.0156, threshold = 0.3 / 64 ~ 0.0047: any token is accepted;
    # with delta = 2, threshold = min(0.09, 2/64 = 0.031) > 0.0156: every token is rejected.
    p = torch.full((1, 2, 64), 1 / 64)
    proposal = Proposal(torch.tensor([[17]]), [1])
    assert TypicalVerifier(0.09, 0.3).verify_probs(p, proposal).accepted.tolist() == [1]
    assert TypicalVerifier(0.09, 2.0).verify_probs(p, proposal).accepted.tolist() == [0]


def test_respects_per_row_lengths_and_takes_shaped_logits():
    logits = torch.zeros(2, 3, 6)
    logits[:, :, 2] = 3.0
    proposal = Proposal(torch.tensor([[2, 2], [2, 2]]), [2, 1])
    out = TypicalVerifier()(logits, proposal, SamplingParams(temperature=0.7))
    assert out.accepted.tolist() == [2, 1]  # padding drafts are never accepted
    assert out.tokens[1, :2].tolist() == [2, 2]


def test_at_temperature_zero_it_is_the_greedy_rule():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 5, 10, generator=g)
    drafts = torch.where(torch.rand(16, 4, generator=g) < 0.7, logits[:, :4].argmax(-1), 3)
    proposal = Proposal(drafts, [4] * 16)
    typ = TypicalVerifier()(logits, proposal, SamplingParams())
    greedy = GreedyVerifier()(logits, proposal, SamplingParams())
    assert typ.accepted.tolist() == greedy.accepted.tolist()


def test_make_verifier_builds_typical_with_its_args_and_checks_them():
    v = make_verifier("typical", SamplingParams(temperature=0.7), epsilon=0.2, delta=0.5)
    assert (v.name, v.lossless, v.epsilon, v.delta) == ("typical", False, 0.2, 0.5)
    with pytest.raises(ValueError, match="epsilon"):
        make_verifier("typical", SamplingParams(0.7), epsilon=0.0)
    with pytest.raises(ValueError, match="verifier_args"):
        make_verifier("greedy", SamplingParams(), epsilon=0.1)
    with pytest.raises(ValueError, match="typical"):
        make_verifier("medusa", SamplingParams())


def test_greedy_generations_with_typical_are_the_greedy_output_and_say_they_are_lossless(engine_factory,
                                                                                        unrelated_draft):
    """At temperature 0 typical acceptance is the greedy rule, at any threshold: the output is plain
    greedy decoding's, so the generation is labelled lossless (at temperature > 0 it is not)."""
    engine = engine_factory(unrelated_draft)
    plain = SpeculativeDecoder(engine).generate(RAGGED_PROMPTS, max_new_tokens=16)
    for args in ({}, {"epsilon": 1e-9, "delta": 1e-9}, {"epsilon": 1.0, "delta": 2.0}):
        dec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=3, verifier="typical",
                                 verifier_args=args)
        out = dec.generate(RAGGED_PROMPTS, max_new_tokens=16)
        assert out.output_ids == plain.output_ids and out.lossless is True and out.verifier == "typical"


def test_generations_with_typical_say_they_are_lossy(engine_factory, unrelated_draft):
    engine = engine_factory(unrelated_draft)
    dec = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=3, verifier="typical")
    out = dec.generate(RAGGED_PROMPTS, max_new_tokens=16, temperature=0.7)
    assert out.verifier == "typical" and out.lossless is False
    # A near-zero threshold accepts whatever a useless draft proposes: exactly why it is lossy.
    loose = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=3, verifier="typical",
                               verifier_args={"epsilon": 1e-9, "delta": 1e-9})
    # 17 tokens: the prefill's and four full steps of 3 drafts + 1, so no draft is cut off by max_new_tokens
    assert loose.generate(RAGGED_PROMPTS, max_new_tokens=17, temperature=0.7).stats.acceptance_rate > 0.9
