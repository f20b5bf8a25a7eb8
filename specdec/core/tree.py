"""Token trees: a draft that branches, scored by the target in one pass.

A tree draft holds N nodes per batch row; node i is a token and the index of its parent (-1 for a
child of the *root*, the row's last committed token). Nodes are in topological order (a parent's
index is below its children's) and siblings in the order the verifier tries them. Rows of a batch
carry different trees padded to one node budget N: nodes at or beyond `lengths[b]` are padding,
hang off the root and are never accepted.

The target scores the root and the N nodes as one block of N+1 *slots* (slot 0 the root, slot 1+i
node i). Everything the scoring pass and the verifier need is derived once from the parents, on
the device, in `TokenTree.build`:

- `mask`: slot s attends to slot s' of the block iff s' is s or one of its ancestors (the root is
  everyone's ancestor), so each node sees exactly the sequence it would continue;
- `depth`: a node's distance from the root; its position id is the root's position plus its depth;
- `paths`: the root-to-node path of every node (the root-to-leaf paths of Medusa's "retrieve
  indices" are the rows of the leaves), used to read off an accepted path and compact caches;
- `children`: each slot's children in sibling order, which recursive rejection sampling walks.

Static trees (Medusa, EAGLE-1) are given as a list of paths of child ranks, `[[0], [1], [0, 0]]`:
node `[0, 1]` is the second-ranked child of the first-ranked child of the root. Each shape is turned
into buffers once and cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

from specdec.core.device import to_device
from specdec.core.types import Proposal


@dataclass
class TokenTree:
    """The shape of a batch of draft trees and the buffers derived from it.

    parents:  [B, N] long, parent node of each node, -1 for a child of the root; padding nodes -1.
    lengths:  per row, real nodes (the first lengths[b]); on the host.
    depth:    [B, N] long, 1 for a child of the root.
    mask:     [B, N+1, N+1] bool, slot s sees slot s' of the block (0 = root, 1+i = node i).
    paths:    [B, N, D] long, paths[b, i, :depth] the nodes from depth 1 down to node i; -1 after.
    children: [B, N+1, C] long, children of each slot as node indices in sibling order; -1 after.
    """

    parents: torch.Tensor
    lengths: list[int]
    depth: torch.Tensor
    mask: torch.Tensor
    paths: torch.Tensor
    children: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[1]

    @property
    def max_depth(self) -> int:
        return self.paths.shape[2]

    @staticmethod
    def build(parents: torch.Tensor, lengths: list[int], max_depth: int | None = None,
              max_children: int | None = None, check: bool = True) -> TokenTree:
        """Derive the buffers from `parents: [B, N]` (-1 = root) with `lengths[b]` real nodes per row.

        A proposer that knows bounds on its trees passes them, and then the build never reads the
        device (on a GPU each read is a synchronisation): `max_depth` >= the deepest node's depth
        (the paths get that many columns), `max_children` >= the most children of one slot (the
        children get that many columns), `check=False` for trees valid by construction. Without
        them the build reads the tree's depth, its widest slot and its validity back."""
        b, n = parents.shape
        device = parents.device
        if len(lengths) != b or any(not 0 <= m <= n for m in lengths):
            raise ValueError(f"tree lengths {lengths} do not fit {b} rows of {n} nodes")
        node = torch.arange(n, device=device)
        real = node[None, :] < to_device(lengths, device)[:, None]  # [B, N]
        parents = torch.where(real, parents.long(), -1)
        if check:
            if bool(((parents < -1) | (parents >= node[None, :])).any()):
                raise ValueError("a tree node's parent must be -1 (the root) or an earlier node: "
                                 "give nodes in topological order")
            if bool((real & (parents >= 0) & ~real.gather(1, parents.clamp(min=0))).any()):
                raise ValueError("a real tree node has a padding node as its parent")

        # Ancestors by repeated parent lookups: chain[..., j] is the j-th ancestor-or-self (j = 0 self).
        chain = [node.expand(b, n)]
        while max_depth is None or len(chain) < max_depth:
            up = chain[-1]
            nxt = torch.where(up >= 0, parents.gather(1, up.clamp(min=0)), -1)
            if max_depth is None and not bool((nxt >= 0).any()):
                break
            chain.append(nxt)
        if check and max_depth is not None and bool((parents.gather(1, chain[-1].clamp(min=0)) >= 0)
                                                    .logical_and(chain[-1] >= 0).any()):
            raise ValueError(f"a tree node lies deeper than max_depth={max_depth}")
        chain = torch.stack(chain, dim=-1)  # [B, N, D]
        depth = (chain >= 0).sum(-1)  # [B, N]
        d = chain.shape[-1]
        # Root-to-node order: paths[..., j] = chain[..., depth - 1 - j] for j < depth.
        j = torch.arange(d, device=device)
        rev = (depth[..., None] - 1 - j).clamp(min=0)
        paths = torch.where(j < depth[..., None], chain.gather(-1, rev), -1)

        # A node sees its ancestors and itself; slot 0 (the root) is seen by all (chain's -1 pads land there too).
        mask = torch.zeros(b, n + 1, n + 1, dtype=torch.bool, device=device)
        mask[:, :, 0] = True
        mask[:, 1:].scatter_(2, chain + 1, True)

        # Sibling rank: how many earlier nodes share the parent.
        same = (parents[:, :, None] == parents[:, None, :]) & (node[None, :] < node[:, None])[None]
        rank = (same & real[:, None, :]).sum(-1)  # [B, N]
        c = max_children if max_children is not None else int(torch.where(real, rank, 0).max()) + 1
        if check and max_children is not None and bool((real & (rank >= c)).any()):
            raise ValueError(f"a tree slot has more than max_children={c} children")
        # Scatter real nodes into [B, N+1, C]; padding goes to a spill column that is cut off.
        children = torch.full((b, n + 1, c + 1), -1, dtype=torch.long, device=device)
        col = torch.where(real, rank, c)
        children[torch.arange(b, device=device)[:, None], parents + 1, col] = torch.where(real, node, -1)
        return TokenTree(parents, list(lengths), depth, mask, paths, children[:, :, :c])

    def positions(self, starts: torch.Tensor) -> torch.Tensor:
        """starts: [B] position of each row's root -> position ids `[B, N+1]` of the block."""
        zero = torch.zeros_like(self.depth[:, :1])
        return starts[:, None] + torch.cat([zero, self.depth], dim=1)


@dataclass
class TreeProposal(Proposal):
    """A draft tree: `tokens: [B, N]` node tokens, `lengths` real nodes per row, `probs: [B, N, V]`
    the distribution each node was drawn from given everything drafted before it (its parent's
    context and its earlier siblings), or None for deterministic nodes (a one-hot q)."""

    tree: TokenTree | None = None

    def depths(self) -> torch.Tensor:
        """`[B]` per row, the depth of its tree (the longest path it could accept), on the device."""
        real = torch.arange(self.tree.num_nodes, device=self.tokens.device)[None, :] < to_device(
            self.tree.lengths, self.tokens.device)[:, None]
        return torch.where(real, self.tree.depth, 0).amax(1) if self.tree.num_nodes else real.new_zeros(real.shape[0], dtype=torch.long)

    @cached_property
    def drafted(self) -> list[int]:
        """`depths()` on the host, read once (the loop, the schedule and the hybrid all ask). The
        decoding loop reads it together with the verification (`proposal.drafted = ...`), in the
        step's one copy to the host."""
        return self.depths().tolist()

    def __post_init__(self):
        if self.tree is None:
            raise ValueError("TreeProposal needs its tree (TokenTree.build or StaticTree.expand)")
        if self.tokens.shape != self.tree.parents.shape:
            raise ValueError(f"tree tokens {tuple(self.tokens.shape)} do not match its parents "
                             f"{tuple(self.tree.parents.shape)}")


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree shape from a list of paths of child ranks (Medusa's and EAGLE-1's `tree`).

    paths:   the nodes, sorted by depth then rank path: node i is reached by ranks `paths[i]`.
    parents: parent node of each node (-1 for the root's children).
    ranks:   each node's rank among the candidates for its slot (its path's last entry).
    depths:  each node's depth (its path's length).
    """

    paths: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]
    ranks: tuple[int, ...]
    depths: tuple[int, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def expand(self, batch_size: int, device: torch.device | str = "cpu") -> TokenTree:
        """The tree's buffers for `batch_size` identical rows (built once per shape and device)."""
        one = _static_buffers(self, str(device))
        return TokenTree(
            one.parents.expand(batch_size, -1), [self.num_nodes] * batch_size,
            one.depth.expand(batch_size, -1), one.mask.expand(batch_size, -1, -1),
            one.paths.expand(batch_size, -1, -1), one.children.expand(batch_size, -1, -1),
        )


def static_tree(paths) -> StaticTree:
    """A `StaticTree` from a list of rank paths, e.g. `[[0], [1], [0, 0]]`; checked and cached."""
    try:
        if isinstance(paths, str) or any(isinstance(p, str) or isinstance(r, (str, float)) for p in paths for r in p):
            raise TypeError(paths)  # "abc" and [["0"]] would pass int(); 0.5 would be cut to 0
        key = tuple(tuple(int(r) for r in p) for p in paths)
    except (TypeError, ValueError) as e:
        raise ValueError(f"method.tree must be a list of lists of child ranks, e.g. [[0], [1], [0, 0]]; got {paths!r}") from e
    return _static_tree(key)


@lru_cache(maxsize=64)
def _static_tree(key: tuple[tuple[int, ...], ...]) -> StaticTree:
    if not key:
        raise ValueError("method.tree is empty; give at least one path, e.g. [[0]]")
    if len(set(key)) != len(key):
        raise ValueError(f"method.tree lists a path twice: {sorted(p for p in set(key) if key.count(p) > 1)}")
    for p in key:
        if not p or min(p) < 0:
            raise ValueError(f"method.tree path {list(p)}: a path is a non-empty list of ranks >= 0")
        if len(p) > 1 and p[:-1] not in key:
            raise ValueError(f"method.tree path {list(p)} has no parent: add {list(p[:-1])}")
    ordered = tuple(sorted(key, key=lambda p: (len(p), p)))
    index = {p: i for i, p in enumerate(ordered)}
    parents = tuple(index[p[:-1]] if len(p) > 1 else -1 for p in ordered)
    return StaticTree(ordered, parents, tuple(p[-1] for p in ordered), tuple(len(p) for p in ordered))


@lru_cache(maxsize=64)
def _static_buffers(tree: StaticTree, device: str) -> TokenTree:
    parents = to_device([tree.parents], device, torch.long)
    return TokenTree.build(parents, [tree.num_nodes])


def chain_tree(batch_size: int, k: int, lengths: list[int] | None = None,
               device: torch.device | str = "cpu") -> TokenTree:
    """A chain of k nodes per row (node i's parent is node i-1): a chain draft seen as a tree."""
    parents = (torch.arange(k, device=device) - 1).expand(batch_size, -1)
    return TokenTree.build(parents, lengths if lengths is not None else [k] * batch_size)
