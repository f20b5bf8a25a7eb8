"""Tree verification: keep the longest accepted root-to-node path of a draft tree.

Both verifiers take the target's logits at every slot of the scored block (`[B, N+1, V]`, slot 0
the root, slot 1+i node i) and return a `TreeVerification`: the emitted tokens (the accepted path
followed by one target token), the number accepted, and the accepted path's node indices, which
the caller uses to compact each KV cache down to exactly that path.

Greedy: a node is accepted when its token is the target's argmax at its parent and its parent was
accepted; the deepest accepted node (the first one at that depth) ends the path and the argmax
after it is emitted. The emitted sequence is the target's greedy continuation.

Sampling: SpecInfer's multi-step speculative sampling (Miao et al. 2024, "recursive rejection
sampling"). From the root, with r = p at the current node, try its children c_1, c_2, ... in order:
accept c_i with probability min(1, r(c_i) / q_i(c_i)) and move to it (r = p there); otherwise
r <- norm(max(r - q_i, 0)) and try the next child. When every child is rejected, sample the
recovered token from r; after an accepted leaf, sample the bonus token from p at the leaf.

Why it is lossless: each trial is one speculative-sampling step whose target is the current
residual r. Given everything drafted and decided before it, child c_i is a draw from q_i (the
distribution recorded in `probs`, one-hot for a deterministic node). Accepting emits x with
probability min(r(x), q_i(x)); rejecting has probability sum_x max(r(x) - q_i(x), 0) and, by
induction over the remaining children (the last step samples r itself), then emits x with
probability norm(max(r - q_i, 0))(x). Their sum is r(x). At the root r = p, so the first emitted
token follows p, and after an acceptance the same argument starts afresh one level down with p at
the accepted node, so every emitted token follows p given the tokens before it. Siblings may be
drawn with or without replacement, from one draft or several, as long as `probs` holds each node's
actual conditional draw distribution. A chain is a tree with one child per node, and the rule is
then exactly `SpeculativeSamplingVerifier` (same random draws, same results).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.core.device import reads_are_free, to_device
from specdec.core.sampling import SamplingParams, greedy_tokens, one_hot, probabilities, sample
from specdec.core.tree import TreeProposal
from specdec.core.verify import Verification


@dataclass
class TreeVerification(Verification):
    """tokens: [B, D+1] emitted (first accepted[b]+1 valid); accepted: [B];
    path: [B, D] the accepted nodes from depth 1 down, -1 beyond accepted[b]."""

    path: torch.Tensor


def _emitted(proposal: TreeProposal, path: torch.Tensor, accepted: torch.Tensor,
             last: torch.Tensor) -> torch.Tensor:
    """The path's tokens followed by `last: [B]` at position accepted[b]; -> [B, D+1]."""
    b, d = path.shape
    tokens = proposal.tokens.gather(1, path.clamp(min=0))
    tokens = torch.cat([tokens, tokens.new_zeros(b, 1)], dim=1)
    tokens[torch.arange(b, device=path.device), accepted] = last
    return tokens


class TreeGreedyVerifier:
    """The longest path of nodes equal to the target's argmax at their parent; then the argmax."""

    name = "greedy"
    lossless = True

    def __call__(self, logits: torch.Tensor, proposal: TreeProposal, params: SamplingParams,
                 generator: torch.Generator | None = None) -> TreeVerification:
        """logits: [B, N+1, V] target logits at the root and every node."""
        tree = proposal.tree
        b, n = proposal.tokens.shape
        target = greedy_tokens(logits)  # [B, N+1]
        real = torch.arange(n, device=target.device)[None, :] < to_device(tree.lengths, target.device)[:, None]
        ok = (proposal.tokens == target.gather(1, tree.parents + 1)) & real  # [B, N]
        # A node is accepted when every node on its root path is: gather ok along the paths.
        ok_or_root = torch.cat([torch.ones_like(ok[:, :1]), ok], dim=1)  # index 0 stands for "no node"
        on_path = ok_or_root.gather(1, (tree.paths + 1).flatten(1)).view_as(tree.paths)
        reach = torch.where(on_path.all(-1), tree.depth, 0)  # [B, N]
        accepted, best = reach.max(dim=1)  # the first node of greatest accepted depth
        rows = torch.arange(b, device=target.device)
        path = tree.paths[rows, best]  # [B, D]
        path = torch.where(torch.arange(path.shape[1], device=path.device) < accepted[:, None], path, -1)
        slot = torch.where(accepted > 0, path.gather(1, (accepted - 1).clamp(min=0)[:, None])[:, 0] + 1, 0)
        return TreeVerification(_emitted(proposal, path, accepted, target[rows, slot]), accepted, path)


class TreeSamplingVerifier:
    """SpecInfer's recursive rejection sampling over each node's children (see the module docstring)."""

    name = "tree_sampling"
    lossless = True

    def __call__(self, logits: torch.Tensor, proposal: TreeProposal, params: SamplingParams,
                 generator: torch.Generator | None = None) -> TreeVerification:
        """logits: [B, N+1, V] target logits at the root and every node."""
        return self.verify_probs(probabilities(logits, params), proposal, generator)

    @staticmethod
    def trial_target(p_node: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The distribution a child is tested against: the residual left by its earlier siblings."""
        return residual

    def verify_probs(self, p: torch.Tensor, proposal: TreeProposal,
                     generator: torch.Generator | None = None) -> TreeVerification:
        """p: [B, N+1, V] shaped target probabilities at the root and every node."""
        tree = proposal.tree
        b, n = proposal.tokens.shape
        v = p.shape[-1]
        device = p.device
        rows = torch.arange(b, device=device)
        # One uniform per node, drawn up front in node order: a chain consumes the generator exactly
        # as the chain verifier does.
        u = torch.rand(b, n, generator=generator, device=device)
        slot = torch.zeros(b, dtype=torch.long, device=device)  # current node's slot (0 = root)
        p_node = p[:, 0]
        residual = p_node
        accepted = torch.zeros(b, dtype=torch.long, device=device)
        path = torch.full((b, tree.max_depth), -1, dtype=torch.long, device=device)
        searching = torch.ones(b, dtype=torch.bool, device=device)
        for depth in range(tree.max_depth):
            kids = tree.children[rows, slot]  # [B, C]
            moved = torch.zeros(b, dtype=torch.bool, device=device)
            for c in range(kids.shape[1]):
                child = kids[:, c]
                live = (child >= 0) & searching & ~moved
                node = child.clamp(min=0)
                x = proposal.tokens[rows, node]
                if proposal.probs is None:
                    q = one_hot(x, v, p.dtype)
                else:
                    q = proposal.probs[rows, node].to(p.dtype)
                target = self.trial_target(p_node, residual)
                ratio = target.gather(1, x[:, None])[:, 0] / q.gather(1, x[:, None])[:, 0]
                ok = live & (u[rows, node] < ratio)
                rejected = live & ~ok
                rest = (residual - q).clamp(min=0)
                mass = rest.sum(-1, keepdim=True)
                # mass == 0 only when the residual equals q, where a rejection has probability 0.
                rest = torch.where(mass > 0, rest / mass.clamp(min=1e-30), residual)
                residual = torch.where(rejected[:, None], rest, residual)
                path[:, depth] = torch.where(ok, child, path[:, depth])
                slot = torch.where(ok, child + 1, slot)
                moved |= ok
            accepted += moved
            searching &= moved
            p_node = torch.where(moved[:, None], p[rows, slot], p_node)
            residual = torch.where(moved[:, None], p_node, residual)
            if reads_are_free(device) and not bool(searching.any()):
                break
        last = sample(residual, generator)  # recovered from the residual, or the bonus from p at a leaf
        return TreeVerification(_emitted(proposal, path, accepted, last), accepted, path)




# The chain verifiers that have a tree form here (by `name`), and so the ones a proposer that drafts
# trees takes: greedy (tree greedy) and speculative sampling (recursive rejection sampling). Block
# verification judges a chain's block jointly and has no tree rule; lossy rules have none either.
TREE_VERIFIERS = ("greedy", "speculative_sampling")


class TreeVerifier:
    """What the decoding loop uses for a proposer that drafts trees: a `TreeProposal` goes to the
    tree rule, a plain `Proposal` (the prefill, a step that drafted a chain or nothing) to the
    chain rule it generalises, which gives the same results on a chain.

    chain: the chain verifier (`make_verifier`); it must be lossless, as only lossless rules have a
           tree form here. tree: the tree rule; by default greedy for a greedy chain rule and
           recursive rejection sampling otherwise.
    """

    lossless = True

    def __init__(self, chain, tree=None):
        if not chain.lossless or chain.name not in TREE_VERIFIERS:
            raise ValueError(f"verifier={chain.name} has no tree form; methods that draft trees take "
                             "verifier=auto, greedy or speculative_sampling")
        self.chain = chain
        self.tree = tree or (TreeGreedyVerifier() if chain.name == "greedy" else TreeSamplingVerifier())
        self.name = self.tree.name

    def __call__(self, logits: torch.Tensor, proposal, params: SamplingParams,
                 generator: torch.Generator | None = None) -> Verification:
        rule = self.tree if isinstance(proposal, TreeProposal) else self.chain
        return rule(logits, proposal, params, generator)
