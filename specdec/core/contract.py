"""What a proposer must return, checked once per step where the loop takes it.

A proposer is the part researchers write themselves, and its `Proposal` is read by every verifier,
the scoring pass, the schedule and the statistics. A wrong one fails far from its cause: tokens of
shape `[k]` or lengths given as an int end in an IndexError or a TypeError deep in a verifier, and
lengths above the tokens' width run silently, every missing draft counted as a rejection. So the
loop checks a proposal once, as it receives it (`check_proposal`), and an error names the proposer's
class and the field, says what was expected and what came, and what to do.

It also makes a padded proposal mean the same to every verifier. A proposer may pad its tokens wider
than its longest row (to k, as the `Proposal` docstring allows); the scoring pass scores only
`max(lengths)` drafts, so a verifier handed the padded width would compare `[B, k]` drafts with
fewer logits. The proposal is cut here to `max(lengths)` columns (its q too; a tree keeps its first
`max(lengths)` nodes, padding in every row beyond them), so that greedy, speculative sampling,
block, typical, forced and tree verification see the proposal the proposer would have returned
unpadded, and draw the same random numbers for it.

Cost: the step loop is hot, and on a GPU reading a device value back makes the host wait for the
device. Types, shapes, dtypes and devices are known on the host and are always checked, and so are
lengths held on the host; the values on the device (ids inside the target's vocabulary, lengths
left on the device) only where reads are free (`reads_are_free`: the CPU).
"""

from __future__ import annotations

import dataclasses
import numbers

import torch

from specdec.core.device import reads_are_free
from specdec.core.tree import TokenTree, TreeProposal
from specdec.core.types import DecodeState, Proposal

__all__ = ["check_proposal"]


def check_proposal(proposer, proposal, state: DecodeState, k: int, vocab_size: int) -> Proposal:
    """`proposal`, which `proposer.propose(state, k)` returned, checked against the batch of `state`
    and a target of `vocab_size` logits, and cut to its longest row (see the module docstring).
    Raises TypeError for a wrong type or dtype, ValueError for a wrong shape or value."""
    where = f"{type(proposer).__name__}.propose(state, k={k})"
    if not isinstance(proposal, Proposal):
        raise TypeError(f"{where} returned {_described(proposal)}, not a Proposal: return "
                        "Proposal(tokens [B, k] ids, lengths: a list of B ints), e.g. "
                        "Proposal(tokens, [tokens.shape[1]] * state.batch_size)")
    b, device = state.batch_size, state.tokens.device
    tree = isinstance(proposal, TreeProposal)
    tokens = _tokens(where, proposal.tokens, b, device)
    lengths = _lengths(where, proposal.lengths, b, tokens.shape[1])
    if not tree and max(lengths, default=0) > k:
        raise ValueError(f"{where}: lengths {lengths} ask to score more than the k={k} drafts asked for "
                         f"(the caches keep room for k): draft at most k tokens per row")
    _probs(where, proposal.probs, tokens.shape, vocab_size, device)
    _device_lengths(where, proposal, b, device)
    _host_tokens(where, proposal, b)
    if tree:
        _tree(where, proposal)
    if reads_are_free(device) and tokens.numel() and bool(((tokens < 0) | (tokens >= vocab_size)).any()):
        bad = tokens[(tokens < 0) | (tokens >= vocab_size)][0].item()
        raise ValueError(f"{where}: tokens hold the id {bad}, outside the target's vocabulary [0, {vocab_size}); "
                         "padding included (every column is scored): pad with any valid id, e.g. 0")
    return _cut(proposal, tokens, lengths)


def _described(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a bare {tuple(value.shape)} tensor"
    return f"a {type(value).__name__}"


def _integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _tokens(where: str, tokens, b: int, device: torch.device) -> torch.Tensor:
    """tokens: [B, k] integer ids on the batch's device."""
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"{where}: Proposal.tokens must be a [B, k] tensor of token ids, got {_described(tokens)}: "
                        "build it with torch.tensor(drafts) or torch.stack")
    if tokens.ndim != 2 or tokens.shape[0] != b:
        hint = " (one row: tokens[None])" if tokens.ndim == 1 and b == 1 else ""
        raise ValueError(f"{where}: Proposal.tokens must be [B, k] with B = {b} (one row per sequence of the "
                         f"batch), got shape {tuple(tokens.shape)}: give each row its drafts{hint}")
    if not _integer(tokens.dtype):
        raise TypeError(f"{where}: Proposal.tokens must hold integer token ids, got {tokens.dtype}: "
                        "ids are indices into the vocabulary (argmax or sample them, then .long())")
    if tokens.device != device:
        raise ValueError(f"{where}: Proposal.tokens are on {tokens.device}, the batch on {device}: "
                         f"make them on state.tokens.device")
    return tokens


def _lengths(where: str, lengths, b: int, width: int) -> list[int]:
    """lengths: B ints on the host, each 0..width (`Proposal.lengths`)."""
    if isinstance(lengths, torch.Tensor):
        raise TypeError(f"{where}: Proposal.lengths must be a list of {b} ints on the host, got a tensor: "
                        "pass lengths.tolist(), or, to keep them on the device, device_lengths=lengths with "
                        f"lengths=[{width}] * B as their bound")
    if isinstance(lengths, numbers.Integral):
        raise TypeError(f"{where}: Proposal.lengths must be a list of {b} ints (one per row), got the "
                        f"{type(lengths).__name__} {lengths!r}: pass [{lengths!r}] * {b}")
    if not isinstance(lengths, (list, tuple)) or len(lengths) != b \
            or not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in lengths):
        got = f"{len(lengths)} values {list(lengths)!r}" if isinstance(lengths, (list, tuple)) else \
            _described(lengths)
        raise TypeError(f"{where}: Proposal.lengths must be a list of {b} ints (one per row), got {got}")
    lengths = [int(n) for n in lengths]
    if any(not 0 <= n <= width for n in lengths):
        raise ValueError(f"{where}: Proposal.lengths {lengths} must each be in [0, {width}], the width of "
                         f"tokens ({width} columns): a row's length counts its real drafts, which its "
                         "tokens must hold")
    return lengths


def _probs(where: str, probs, shape: torch.Size, vocab_size: int, device: torch.device) -> None:
    """probs: None or [B, k, V] floats, V the target's."""
    if probs is None:
        return
    expected = (*shape, vocab_size)
    if not isinstance(probs, torch.Tensor) or tuple(probs.shape) != expected or not probs.is_floating_point():
        got = f"{tuple(probs.shape)} {probs.dtype}" if isinstance(probs, torch.Tensor) else _described(probs)
        raise ValueError(f"{where}: Proposal.probs must be None (a deterministic draft) or the draft's "
                         f"distributions, floats of shape {expected} ([B, k, V]), got {got}")
    if probs.device != device:
        raise ValueError(f"{where}: Proposal.probs are on {probs.device}, the batch on {device}: "
                         "make them on state.tokens.device")


def _device_lengths(where: str, proposal: Proposal, b: int, device: torch.device) -> None:
    """device_lengths: None or [B] integers on the device, each within its bound in `lengths`."""
    lengths = proposal.device_lengths
    if lengths is None:
        return
    if isinstance(proposal, TreeProposal):
        raise ValueError(f"{where}: a TreeProposal keeps its lengths on the host (its tree's); "
                         "leave device_lengths None")
    if not isinstance(lengths, torch.Tensor) or tuple(lengths.shape) != (b,) or not _integer(lengths.dtype) \
            or lengths.device != device:
        got = f"{tuple(lengths.shape)} {lengths.dtype} on {lengths.device}" \
            if isinstance(lengths, torch.Tensor) else _described(lengths)
        raise ValueError(f"{where}: Proposal.device_lengths must be None or a [{b}] integer tensor on "
                         f"{device} (the rows' lengths, `lengths` holding their bound), got {got}")
    if reads_are_free(device):
        bound = torch.tensor(proposal.lengths, dtype=lengths.dtype)
        if bool(((lengths < 0) | (lengths > bound)).any()):
            raise ValueError(f"{where}: Proposal.device_lengths {lengths.tolist()} must each be in "
                             f"[0, lengths[b]], their bound {list(proposal.lengths)}")


def _host_tokens(where: str, proposal: Proposal, b: int) -> None:
    """host_tokens: None or per row its real drafts, as many as its length (once settled)."""
    rows = proposal.host_tokens
    if rows is None:
        return
    if not isinstance(rows, (list, tuple)) or len(rows) != b \
            or (proposal.settled and [len(r) for r in rows] != list(proposal.lengths)):
        raise ValueError(f"{where}: Proposal.host_tokens must be None or, per row, its real drafts "
                         f"(a list of {b} lists, row b of lengths[b] ids), got {rows!r}")


def _tree(where: str, proposal: TreeProposal) -> None:
    """A tree's own lengths are the proposal's, and it has a node per token."""
    tree = proposal.tree
    if tuple(tree.parents.shape) != tuple(proposal.tokens.shape):
        raise ValueError(f"{where}: the tree has {tuple(tree.parents.shape)} nodes for tokens of shape "
                         f"{tuple(proposal.tokens.shape)}: build the tree from the same [B, N] nodes")
    if list(tree.lengths) != list(proposal.lengths):
        raise ValueError(f"{where}: TreeProposal.lengths {list(proposal.lengths)} differ from its tree's "
                         f"{list(tree.lengths)}: pass the lengths the tree was built with")


def _cut(proposal: Proposal, tokens: torch.Tensor, lengths: list[int]) -> Proposal:
    """The proposal as every verifier reads it: long ids, lengths as a list, and no column (no tree
    node) past its longest row, whose padding the scoring pass leaves out. The same object where
    nothing changes."""
    width = max(lengths, default=0)
    if width == 0 and isinstance(proposal, TreeProposal):  # a tree of padding alone: a step that drafts nothing
        return Proposal.empty(len(lengths), tokens.device)
    changes = {}
    if tokens.dtype != torch.long:
        changes["tokens"] = tokens = tokens.long()
    if type(proposal.lengths) is not list or any(type(n) is not int for n in proposal.lengths):
        changes["lengths"] = lengths  # a tuple, numpy ints: as the loop's bookkeeping reads them
    if tokens.shape[1] > width:
        changes["tokens"] = tokens[:, :width]
        if proposal.probs is not None:
            changes["probs"] = proposal.probs[:, :width]
        if isinstance(proposal, TreeProposal):
            changes["tree"] = _first_nodes(proposal.tree, width)
    return dataclasses.replace(proposal, **changes) if changes else proposal


def _first_nodes(tree: TokenTree, n: int) -> TokenTree:
    """`tree` with its first `n` nodes, where every row's real nodes are among them: a node's
    ancestors come before it, and padding nodes have no children (`TokenTree.build` puts them in a
    column it cuts off), so the buffers of the first n nodes are a prefix of each."""
    return TokenTree(tree.parents[:, :n], list(tree.lengths), tree.depth[:, :n], tree.mask[:, : n + 1, : n + 1],
                     tree.paths[:, :n], tree.children[:, : n + 1])
