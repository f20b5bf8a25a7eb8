"""End to end: sampling with a tree draft through the decoder (one target pass over the tree, cache
compaction to the accepted path) preserves the target's distribution. The joint distribution of
the second and third generated tokens, both produced by tree steps, is compared by a chi-square test
with the exact one computed from the target; siblings tested against p instead of the residual fail
the same test. Slow (about a minute under load: 30,000 rows per run); the rule itself is tested
fast on constructed distributions in test_tree.py."""

import pytest
import torch

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.core.sampling import SamplingParams, probabilities
from specdec.core.tree import TreeProposal, static_tree
from specdec.core.tree_verify import TreeVerifier
from specdec.core.verify import SpeculativeSamplingVerifier
from specdec.models import tiny_random_model
from specdec.proposers.base import Proposal
from tests.core.test_tree import SiblingsAgainstP
from tests.stats import chi_square_pvalue, exact_joint_of_tokens_2_and_3

V = 8
PROMPT = [3, 5, 2]
PARAMS = SamplingParams(temperature=0.9, top_k=6)
WIDE = [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1]]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models():
    return (tiny_random_model(seed=11, vocab_size=V, eos_token_id=None, logit_std=1.5),
            tiny_random_model(seed=12, vocab_size=V, num_layers=1, eos_token_id=None, logit_std=1.5))


class DraftTree:
    """A static tree drafted by a small model, rows batched by length (no cache). sampled: each
    node drawn from the draft's shaped q at its parent, siblings independently (probs = q);
    otherwise node = the rank-th most likely draft token (deterministic, one-hot q)."""

    name = "test_draft_tree"

    def __init__(self, draft, paths, sampled: bool):
        self.draft, self.shape, self.sampled = draft, static_tree(paths), sampled
        self.num_nodes = self.shape.num_nodes

    def reset(self, state):
        pass

    @torch.inference_mode()
    def propose(self, state, k):
        if k == 0:
            return Proposal.empty(state.batch_size, state.tokens.device)
        n, b = self.num_nodes, state.batch_size
        tree = self.shape.expand(b)
        tokens = torch.zeros(b, n, dtype=torch.long)
        probs = torch.zeros(b, n, V)
        lens = torch.tensor(state.seq_lens)
        for length in lens.unique().tolist():
            rows = (lens == length).nonzero()[:, 0]
            q_at = {}
            for i, (parent, rank) in enumerate(zip(self.shape.parents, self.shape.ranks)):
                if parent not in q_at:
                    path = [j for j in tree.paths[0, parent].tolist() if j >= 0] if parent >= 0 else []
                    seqs = torch.cat([state.tokens[rows, :length], tokens[rows][:, path]], 1)
                    q_at[parent] = probabilities(self.draft(seqs).logits[:, -1], state.sampling)
                q = q_at[parent]
                probs[rows, i] = q
                if self.sampled:
                    tokens[rows, i] = torch.multinomial(q, 1, generator=state.generator)[:, 0]
                else:
                    tokens[rows, i] = q.argsort(-1, descending=True)[:, rank]
        return TreeProposal(tokens, [n] * b, probs if self.sampled else None, tree=tree)

    def observe(self, state, outcome):
        pass


def _tokens_2_and_3(models, sampled: bool, verifier="auto", n=30_000) -> torch.Tensor:
    target, draft = models
    engine = Engine(target, dtype="float32")
    dec = SpeculativeDecoder(engine, DraftTree(draft, WIDE, sampled), verifier=verifier)
    # Four tokens, though t4 is not counted: the step that gives t3 then still has room to draft (a step
    # drafts nothing where its row can emit only one more token).
    out = dec.generate([PROMPT] * n, max_new_tokens=4, temperature=PARAMS.temperature, top_k=PARAMS.top_k, seed=0)
    assert 0.1 < out.stats.acceptance_rate < 0.9  # the draft really differs, and paths are accepted
    pairs = torch.tensor([o[1:3] for o in out.output_ids])
    return torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)


@pytest.mark.parametrize("sampled", [True, False])
def test_tree_sampling_through_the_engine_preserves_the_joint_distribution(models, sampled):
    counts = _tokens_2_and_3(models, sampled)
    assert chi_square_pvalue(counts, exact_joint_of_tokens_2_and_3(models[0], PROMPT, PARAMS, V)) > 1e-3


def test_siblings_tested_against_p_fail_through_the_engine(models):
    broken = TreeVerifier(SpeculativeSamplingVerifier(), SiblingsAgainstP())
    counts = _tokens_2_and_3(models, False, verifier=broken)
    assert chi_square_pvalue(counts, exact_joint_of_tokens_2_and_3(models[0], PROMPT, PARAMS, V)) < 1e-6
