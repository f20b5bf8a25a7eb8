"""Speculative sampling stays lossless with every drafting strategy: n-gram lookup (a deterministic
draft, q one-hot), suffix decoding's trees, layer skipping, and the draft model under each adaptive
schedule. As in
test_sampling_lossless, the joint distribution of generated tokens 2 and 3 is compared by a
chi-square test with the exact one computed from the target; an n-gram proposer that misstates its q
fails the same test, so the test can see a broken deterministic draft, and so does a tree verifier
that tests siblings against p instead of what the siblings before them left of it."""

import json

import pytest
import torch

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.core.sampling import SamplingParams
from specdec.core.schedules import make_schedule
from specdec.core.tree_verify import TreeVerifier
from specdec.core.verify import SpeculativeSamplingVerifier
from specdec.models import tiny_random_model
from specdec.proposers.base import Proposal
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.layer_skip import LayerSkipProposer
from specdec.proposers.ngram import NgramProposer
from specdec.proposers.suffix import SuffixProposer, SuffixTreeProposer
from tests.core.test_tree import SiblingsAgainstP
from tests.stats import chi_square_pvalue, exact_joint_of_tokens_2_and_3

V = 8
# Every token of the small vocabulary but one appears, so prompt lookup nearly always matches.
PROMPT = [3, 5, 2, 7, 4, 6, 3, 5, 1]
PARAMS = SamplingParams(temperature=0.9, top_k=6)
N = 20_000


@pytest.fixture(scope="module")
def target():
    return tiny_random_model(seed=11, vocab_size=V, num_layers=3, eos_token_id=None, logit_std=1.5)


@pytest.fixture(scope="module")
def draft():
    return tiny_random_model(seed=12, vocab_size=V, num_layers=1, eos_token_id=None, logit_std=1.5)


@pytest.fixture(scope="module")
def expected(target):
    return exact_joint_of_tokens_2_and_3(target, PROMPT, PARAMS, V)


def _sample_pairs(engine, proposer, schedule=None, k=2, verifier="auto", prompt=PROMPT):
    """Counts of (t2, t3) over N rows [V*V], and the run's statistics. Four tokens are generated, so that
    the step after the prefill has room for two drafts (a step drafts no more than its row can still
    emit less one); t4 is not counted."""
    dec = SpeculativeDecoder(engine, proposer, num_speculative_tokens=k, schedule=schedule, verifier=verifier)
    out = dec.generate([prompt] * N, max_new_tokens=4, temperature=PARAMS.temperature, top_k=PARAMS.top_k, seed=0)
    assert out.lossless and out.verifier in ("speculative_sampling", "tree_sampling")
    pairs = torch.tensor([o[1:3] for o in out.output_ids])
    return torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V), out.stats


def _ngram(cls, engine, static: bool):
    proposer = cls(engine, max_ngram=2)
    proposer.static_width = static  # True: k wide, lengths on the device (a GPU's default)
    return proposer


@pytest.mark.parametrize("static", [False, True])
def test_ngram_sampling_is_lossless(target, expected, static):
    engine = Engine(target, dtype="float32")
    counts, stats = _sample_pairs(engine, _ngram(NgramProposer, engine, static))
    assert 0.05 < stats.acceptance_rate < 0.95
    assert chi_square_pvalue(counts, expected) > 1e-3


class UniformQNgram(NgramProposer):
    """Deliberately broken: claims its drafts came from a uniform q instead of a one-hot."""

    def propose(self, state, k):
        p = super().propose(state, k)
        return Proposal(p.tokens, p.lengths, torch.full((*p.tokens.shape, V), 1.0 / V), p.device_lengths)


@pytest.mark.parametrize("static", [False, True])
def test_ngram_with_a_misstated_q_fails_the_same_test(target, expected, static):
    engine = Engine(target, dtype="float32")
    counts, _ = _sample_pairs(engine, _ngram(UniformQNgram, engine, static))
    assert chi_square_pvalue(counts, expected) < 1e-6


def test_layer_skip_sampling_is_lossless(target, expected):
    engine = Engine(target, dtype="float32")
    counts, stats = _sample_pairs(engine, LayerSkipProposer(engine, exit_layer=1))
    assert 0.05 < stats.acceptance_rate < 0.95
    assert chi_square_pvalue(counts, expected) > 1e-3


@pytest.mark.parametrize("schedule, args, early_exit", [
    ("heuristic", {}, None), ("confidence", {"threshold": 0.6}, True), ("confidence", {"threshold": 0.6}, False),
    ("cost_aware", {"min_k": 1}, None)])
def test_schedules_sampling_is_lossless(target, draft, expected, schedule, args, early_exit):
    engine = Engine(target, draft, dtype="float32")
    sched = make_schedule(schedule, 2, **args)
    proposer = DraftModelProposer(engine)
    proposer.early_exit = early_exit  # False: the k passes run, lengths on the device (a GPU's default)
    counts, stats = _sample_pairs(engine, proposer, sched)
    assert 0.05 < stats.acceptance_rate < 0.95
    if schedule == "confidence":  # a good share of rows stopped after one draft
        assert sum(r.proposed for r in stats.rows) < 1.9 * sum(r.steps for r in stats.rows)
    assert chi_square_pvalue(counts, expected) > 1e-3


# Every token followed by two to five different ones: suffix trees branch at every node.
BRANCHING = [0, 1, 2, 0, 3, 1, 4, 2, 5, 3, 6, 4, 7, 5, 0, 6, 1, 7, 2, 6, 3, 7, 4, 0, 5, 1, 6, 2, 7, 3, 1]


def test_suffix_tree_sampling_is_lossless_and_a_broken_tree_verifier_is_caught(target):
    # Siblings (deterministic, a one-hot q each) must be tried against what the siblings rejected
    # before them left of p; tried against p itself, the output's distribution shifts.
    engine = Engine(target, dtype="float32")
    exact = exact_joint_of_tokens_2_and_3(target, BRANCHING, PARAMS, V)
    counts, stats = _sample_pairs(engine, SuffixTreeProposer(budget=6), k=2, prompt=BRANCHING)
    assert 0.05 < stats.acceptance_rate < 0.95
    assert chi_square_pvalue(counts, exact) > 1e-3
    broken = TreeVerifier(SpeculativeSamplingVerifier(), SiblingsAgainstP())
    counts, _ = _sample_pairs(engine, SuffixTreeProposer(budget=6), k=2, verifier=broken, prompt=BRANCHING)
    assert chi_square_pvalue(counts, exact) < 1e-6


@pytest.mark.parametrize("cls", [SuffixProposer, SuffixTreeProposer])
def test_suffix_sampling_from_a_corpus_is_lossless(target, tmp_path, cls):
    """Drafts from a datastore (`corpus`) are deterministic too (a one-hot q): the prompt [0, 1] has no
    repeats of its own, so the drafts come from the corpus, where every token has several successors."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"token_ids": BRANCHING[i:] + BRANCHING[:i]}) for i in range(0, 30, 3)))
    prompt = [0, 1]
    exact = exact_joint_of_tokens_2_and_3(target, prompt, PARAMS, V)
    engine = Engine(target, dtype="float32")
    proposer = cls(engine, corpus=str(corpus), max_cached_requests=0, max_spec_factor=2.0)
    counts, stats = _sample_pairs(engine, proposer, k=2, prompt=prompt)
    assert 0.02 < stats.acceptance_rate < 0.95  # the chain: the likeliest successor only (about 0.04)
    assert chi_square_pvalue(counts, exact) > 1e-3
