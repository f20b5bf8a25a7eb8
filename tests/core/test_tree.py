"""Token trees and their verifiers on constructed distributions: the buffers of a static tree, the
greedy longest-path rule, a chain given as a tree equal to the chain verifiers, and the losslessness
of recursive rejection sampling (chi-square on the joint of three emitted tokens, trees of width 2
and 3), with a broken variant that tests siblings against p instead of the residual failing it."""

import pytest
import torch

from specdec.core.sampling import SamplingParams
from specdec.core.tree import TokenTree, TreeProposal, chain_tree, static_tree
from specdec.core.tree_verify import TreeGreedyVerifier, TreeSamplingVerifier
from specdec.core.verify import GreedyVerifier, SpeculativeSamplingVerifier
from specdec.proposers.base import Proposal
from tests.stats import chi_square_pvalue

MEDUSA_LIKE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def test_static_tree_buffers():
    shape = static_tree([[1], [0, 0], [0], [0, 1], [1, 0], [0, 0, 0]])  # order of the list does not matter
    assert shape.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert shape.parents == (-1, -1, 0, 0, 1, 2)
    assert shape.ranks == (0, 1, 0, 1, 0, 0) and shape.depths == (1, 1, 2, 2, 2, 3)
    tree = shape.expand(2)
    assert tree.depth[1].tolist() == [1, 1, 2, 2, 2, 3]
    assert tree.paths[0].tolist() == [[0, -1, -1], [1, -1, -1], [0, 2, -1], [0, 3, -1], [1, 4, -1], [0, 2, 5]]
    assert tree.children[0].tolist() == [[0, 1], [2, 3], [4, -1], [5, -1], [-1, -1], [-1, -1], [-1, -1]]
    # slot 0 is the root, slot 1+i node i; node 5 (slot 6) sees the root, nodes 0, 2 and itself
    assert tree.mask[0, 6].nonzero().flatten().tolist() == [0, 1, 3, 6]
    assert tree.mask[0, 0].nonzero().flatten().tolist() == [0]
    assert tree.positions(torch.tensor([10, 3])).tolist()[1] == [3, 4, 4, 5, 5, 5, 6]
    assert static_tree(MEDUSA_LIKE) is static_tree([list(p) for p in MEDUSA_LIKE])  # cached per shape


def test_ragged_trees_pad_with_unreachable_nodes():
    tree = TokenTree.build(torch.tensor([[-1, 0, 0, 1], [-1, -1, 0, 0]]), [4, 2])
    assert tree.children[1].tolist()[:3] == [[0, 1], [-1, -1], [-1, -1]]  # padding nodes are nobody's child
    assert tree.depth[1].tolist() == [1, 1, 1, 1]


@pytest.mark.parametrize("paths, message", [
    ([], "empty"),
    ([[0], [0, 1, 0]], "no parent"),
    ([[0], [0]], "twice"),
    ([[0], [-1]], "ranks >= 0"),
    ([0, 1], "list of lists"),
    ("abc", "list of lists of child ranks.*got 'abc'"),  # method.tree=abc on the command line
    ([["0"]], "list of lists"),
    ([[0.5]], "list of lists"),
])
def test_bad_static_trees_are_refused_with_the_fix(paths, message):
    with pytest.raises(ValueError, match=message):
        static_tree(paths)


def test_nodes_out_of_topological_order_are_refused():
    with pytest.raises(ValueError, match="topological order"):
        TokenTree.build(torch.tensor([[1, -1]]), [2])


def _logits_with_argmax(argmax: list[list[int]], v: int = 8) -> torch.Tensor:
    logits = torch.randn(len(argmax), len(argmax[0]), v, generator=torch.Generator().manual_seed(0))
    for b, row in enumerate(argmax):
        for s, t in enumerate(row):
            logits[b, s, t] = 10.0
    return logits


def test_greedy_tree_takes_the_longest_matching_path_and_returns_its_nodes():
    tree = static_tree(MEDUSA_LIKE).expand(2)
    # argmax per slot: root, nodes 0..5
    logits = _logits_with_argmax([[3, 5, 6, 2, 7, 1, 4], [3, 5, 6, 2, 7, 1, 4]])
    tokens = torch.tensor([
        [4, 3, 0, 0, 6, 1],  # node0 (4) no, node1 (3) ok; node4 (6, the argmax at node1) ok: then 1
        [3, 4, 7, 5, 0, 2],  # node0 (3) ok; argmax at node0 is 5: node2 (7) no, node3 (5) ok; then 7
    ])
    out = TreeGreedyVerifier()(logits, TreeProposal(tokens, [6, 6], tree=tree), SamplingParams())
    assert out.accepted.tolist() == [2, 2]
    assert out.path.tolist() == [[1, 4, -1], [0, 3, -1]]
    assert out.tokens[0, :3].tolist() == [3, 6, 1]  # node 4's argmax (slot 5) is 1
    assert out.tokens[1, :3].tolist() == [3, 5, 7]  # node 3's argmax (slot 4) is 7


def test_greedy_tree_ignores_padding_nodes():
    tree = TokenTree.build(torch.tensor([[-1, -1, 0]]), [1])
    logits = _logits_with_argmax([[3, 5, 6, 2]])
    out = TreeGreedyVerifier()(logits, TreeProposal(torch.tensor([[4, 3, 5]]), [1], tree=tree), SamplingParams())
    assert out.accepted.tolist() == [0] and out.tokens[0, 0].item() == 3


def _random_chain(seed: int, b: int = 64, k: int = 4, v: int = 6):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(b, k + 1, v, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(b, k, v, generator=g) * 1.5, -1)
    drafts = torch.multinomial(q.flatten(0, 1), 1, generator=g).view(b, k)
    lengths = torch.randint(0, k + 1, (b,), generator=g).tolist()
    return p, q, drafts, lengths


def test_chain_as_tree_matches_the_chain_greedy_verifier():
    p, _, _, lengths = _random_chain(0)
    logits = p.log()
    target = logits.argmax(-1)
    drafts = target[:, :-1].clone()
    drafts[torch.rand(drafts.shape, generator=torch.Generator().manual_seed(1)) < 0.3] = 0  # break some
    chain = GreedyVerifier()(logits, Proposal(drafts, lengths), SamplingParams())
    tree = TreeGreedyVerifier()(logits, TreeProposal(drafts, lengths, tree=chain_tree(64, 4, lengths)), SamplingParams())
    assert torch.equal(tree.accepted, chain.accepted) and 0 < chain.accepted.float().mean() < 3
    for b, a in enumerate(chain.accepted.tolist()):
        assert tree.tokens[b, : a + 1].tolist() == chain.tokens[b, : a + 1].tolist()
        assert tree.path[b, :a].tolist() == list(range(a))


@pytest.mark.parametrize("with_q", [True, False])
def test_chain_as_tree_matches_the_chain_sampling_verifier_draw_for_draw(with_q):
    p, q, drafts, lengths = _random_chain(2)
    q = q if with_q else None
    chain = SpeculativeSamplingVerifier().verify_probs(p, Proposal(drafts, lengths, q), torch.Generator().manual_seed(7))
    tree = TreeSamplingVerifier().verify_probs(
        p, TreeProposal(drafts, lengths, q, tree=chain_tree(64, 4, lengths)), torch.Generator().manual_seed(7))
    assert torch.equal(tree.accepted, chain.accepted)
    assert chain.accepted.sum() > 5 and (chain.accepted < torch.tensor(lengths)).sum() > 5  # both outcomes
    for b, a in enumerate(chain.accepted.tolist()):
        assert tree.tokens[b, : a + 1].tolist() == chain.tokens[b, : a + 1].tolist()


# ---------------------------------------------------------------- the distribution test

V = 5


class _Tables:
    """A toy target and draft over V tokens: p0 [V], p1 [V, V] (given t1), p2 [V, V, V]; q likewise."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.p = [torch.softmax(torch.randn(*[V] * (i + 1), generator=g) * 1.2, -1) for i in range(3)]
        self.q = [torch.softmax(torch.randn(*[V] * (i + 1), generator=g) * 1.2, -1) for i in range(2)]

    def at(self, dists, prefix: torch.Tensor) -> torch.Tensor:
        """prefix: [R, d] tokens -> dists[d] at that prefix, [R, V]."""
        table = dists[prefix.shape[1]]
        return table[tuple(prefix.T)] if prefix.shape[1] else table.expand(prefix.shape[0], V)

    def exact_joint(self) -> torch.Tensor:
        p0, p1, p2 = self.p
        return (p0[:, None, None] * p1[:, :, None] * p2).flatten()


def _draft_tree(tables: _Tables, shape, n: int, g: torch.Generator, sampled: bool):
    """n trees of `shape` (depth <= 2). sampled: each node drawn from q at its parent, siblings i.i.d.;
    otherwise node = the rank-th most likely token under q (deterministic, one-hot q)."""
    tree = shape.expand(n)
    tokens = torch.zeros(n, shape.num_nodes, dtype=torch.long)
    probs = torch.zeros(n, shape.num_nodes, V)
    for i, (par, rank) in enumerate(zip(shape.parents, shape.ranks)):
        prefix = tokens[:, :0] if par < 0 else tokens[:, [j for j in tree.paths[0, par].tolist() if j >= 0]]
        q = tables.at(tables.q, prefix)
        probs[:, i] = q
        if sampled:
            tokens[:, i] = torch.multinomial(q, 1, generator=g)[:, 0]
        else:
            tokens[:, i] = q.argsort(-1, descending=True)[:, rank]
    return TreeProposal(tokens, [shape.num_nodes] * n, probs if sampled else None, tree=tree)


def _target_probs(tables: _Tables, proposal: TreeProposal) -> torch.Tensor:
    """p at the root and at every node, from the node's root path: [n, N+1, V]."""
    tree = proposal.tree
    n, m = proposal.tokens.shape
    out = [tables.at(tables.p, proposal.tokens[:, :0])]
    for i in range(m):
        path = [j for j in tree.paths[0, i].tolist() if j >= 0]
        out.append(tables.at(tables.p, proposal.tokens[:, path]))
    return torch.stack(out, 1)


def _three_tokens(verifier, tables, shape, sampled, n=60_000, seed=0) -> torch.Tensor:
    """Run one tree step per row; rows that emitted fewer than 3 tokens continue by sampling from
    p (what later steps do); histogram of (t1, t2, t3)."""
    g = torch.Generator().manual_seed(seed)
    proposal = _draft_tree(tables, shape, n, g, sampled)
    out = verifier.verify_probs(_target_probs(tables, proposal), proposal, g)
    emitted = out.accepted + 1
    seq = torch.zeros(n, 3, dtype=torch.long)
    width = min(3, out.tokens.shape[1])
    seq[:, :width] = out.tokens[:, :width]
    for d in (1, 2):
        short = emitted <= d
        nxt = torch.multinomial(tables.at(tables.p, seq[:, :d]), 1, generator=g)[:, 0]
        seq[:, d] = torch.where(short, nxt, seq[:, d])
    # the accepted path really is a path of the tree with the emitted tokens
    for d in range(out.path.shape[1]):
        on = out.accepted > d
        assert torch.equal(proposal.tokens.gather(1, out.path[:, d:d + 1].clamp(min=0))[on, 0], out.tokens[on, d])
    assert 0.2 < (out.accepted > 0).float().mean() < 0.95  # the draft really differs from p
    assert (out.accepted == 2).any()  # the bonus after a full path is reached
    return torch.bincount(seq[:, 0] * V * V + seq[:, 1] * V + seq[:, 2], minlength=V ** 3)


WIDE = [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1]]
WIDER = [[0], [1], [2], [0, 0], [0, 1], [0, 2], [1, 0], [2, 0]]


class SiblingsAgainstP(TreeSamplingVerifier):
    """Deliberately broken: tests every sibling against p at the parent, not the residual left by the
    siblings rejected before it (the residual is still used for the final draw)."""

    @staticmethod
    def trial_target(p_node, residual):
        return p_node


@pytest.mark.parametrize("paths", [WIDE, WIDER])
@pytest.mark.parametrize("sampled", [True, False])
def test_recursive_rejection_sampling_preserves_the_joint_of_three_tokens(paths, sampled):
    tables = _Tables(seed=3)
    counts = _three_tokens(TreeSamplingVerifier(), tables, static_tree(paths), sampled)
    assert chi_square_pvalue(counts, tables.exact_joint()) > 1e-3


@pytest.mark.parametrize("sampled", [True, False])
def test_siblings_tested_against_p_fail_the_same_test(sampled):
    tables = _Tables(seed=3)
    counts = _three_tokens(SiblingsAgainstP(), tables, static_tree(WIDER), sampled)
    assert chi_square_pvalue(counts, tables.exact_joint()) < 1e-6
