"""Medusa heads (Cai et al. 2024): residual heads on the target's last hidden state, each guessing a
token further ahead, verified as a static tree.

After a step, the target's cache ends at the token before the last committed one, X; its final
hidden state h is the one whose output head produced X. Head d (d = 1..K) reads h and guesses the
token d places after X: head_d(h) = W_out (h + SiLU(A_d h + b_d)), with W_out the target's frozen
output head (optionally a reduced vocabulary, see `heads.py`) and A_d zero at initialisation, so
an untrained head repeats the target's own next-token guess. The tree's node at depth d with rank r
is head d's r-th guess: the heads do not see each other's tokens, which is what makes them cheap
(one matmul per head for the whole tree, no drafting passes) and what limits their acceptance.

h comes from the target's scoring pass itself: the engine keeps the final hidden states in the
cache beside the keys and values (`CachedModel.keep_hidden_states`), compacted with them after a
tree step, so h is simply the last valid entry.

Under `compile=on` the heads, the output head and the top-k run as one compiled call
(`specdec.accel.compiled.CompiledCall`): the output head is the target's whole vocabulary, and its
matmul for a few rows costs far less compiled, with its weight packed once (experiments/gpu/LOG.md,
"Output heads").

Greedy verification makes the output the target's greedy output; at temperature > 0 the nodes are
deterministic, a one-hot q, and recursive rejection sampling keeps the target's distribution.

`heads_path` is a specdec checkpoint (a file, `scripts/train_heads.py`), or a published Medusa
drafter's folder, which `formats.read_drafter` reads as kind `medusa` (vLLM's names). A published
head is `x + SiLU(W x + b)` repeated L times, then the head's own output head `[V', H]`, read from
the same final hidden state h (/work/shared FORMATS.md, section 1.2); head i (from 0) guesses token
t+i+2, head d = i+1 above. What comes from the file: the bias (vLLM's dialect has one only where
the tensors do: its ResidualBlock defaults to none), the vocabulary (`token_map`, the target ids of
a truncated head's rows; a truncated head without one covers the first ids), and the sharing of
FasterDecoding's `[ResBlock(H)] * L`, which is one module listed L times: loading its file copies
each layer's tensors into that one block in turn, so the last layer's weights are what all L
applications use (identical files, the usual case, give the same either way).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from specdec.core.device import to_device
from specdec.core.engine import Engine
from specdec.core.errors import InvalidInput, MissingInput
from specdec.core.tree import TreeProposal, static_tree
from specdec.proposers.base import Proposal
from specdec.proposers.eagle import is_published, read_files
from specdec.proposers.heads import OutputHead, load_checkpoint

HEADS_HINT = ("a specdec checkpoint (scripts/train_heads.py kind=medusa) or a published Medusa drafter's folder "
              "(FasterDecoding's medusa_lm_head.pt with its config.json, or vLLM's model_type medusa) trained "
              "for this target")

# A CPU-sized tree: the heads' top two guesses for the next token and the top guess after the first.
# Medusa's GPU trees have 60+ nodes; on a CPU each node costs a scored token, and the shipped heads'
# deeper guesses are rarely accepted, so this tree is faster than the earlier 9-node default in both
# dtypes and compiled (experiments/trees/LOG.md, "10. Medusa's tree"; experiments/gpu/LOG.md,
# "Output heads", runs 21-24). A GPU, where scoring a few dozen tokens costs about as much as one,
# wants a wider tree: method.tree=.
DEFAULT_TREE = [[0], [1], [0, 0]]


class ResidualStack(torch.nn.Module):
    """A published Medusa head's residual blocks: `x + SiLU(layers[l](x))` for l < L. `shared`:
    FasterDecoding's one block listed L times, whose weights are the last layer's (the module
    docstring)."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool, shared: bool):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden_size, hidden_size, bias=bias)
                                          for _ in range(num_layers))
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., H] -> [..., H]."""
        for layer in self.layers:
            x = x + F.silu((self.layers[-1] if self.shared else layer)(x))
        return x


class MedusaHeads(torch.nn.Module):
    """K heads; `forward` gives the hidden states the output head turns into logits.

    specdec's own (`num_layers` None): one residual block a head, `blocks.{h}` with a bias. A
    published drafter's: `blocks.{h}.layers.{l}` (vLLM's names), L blocks a head, with a bias or
    not, FasterDecoding's shared or not (`ResidualStack`)."""

    def __init__(self, hidden_size: int, num_heads: int, num_layers: int | None = None, bias: bool = True,
                 shared: bool = False):
        super().__init__()
        if num_layers is not None:
            self.blocks = torch.nn.ModuleList(ResidualStack(hidden_size, num_layers, bias, shared)
                                              for _ in range(num_heads))
            return
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for block in self.blocks:  # an untrained head predicts what the target's head predicts
            torch.nn.init.zeros_(block.weight)
            torch.nn.init.zeros_(block.bias)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """hidden: [..., H] final hidden states of the target -> [..., D, H], one per head of the
        first `depth` (default: all K)."""
        return torch.stack([block(hidden) if isinstance(block, ResidualStack) else hidden + F.silu(block(hidden))
                            for block in self.blocks[:depth]], dim=-2)

    @classmethod
    def from_files(cls, files: Any, target_model: torch.nn.Module) -> tuple[MedusaHeads, OutputHead]:
        """The heads of a published drafter (`files`: a `DrafterFiles` of kind `medusa`) and their own
        output heads, as an `OutputHead` whose weight is `[K, V', H]` (one per head) and whose
        `vocab_ids` are the target ids of the rows (`token_map`; the first V' ids of a truncated head
        without one; None for a whole one); checked against the target first."""
        where = getattr(files, "path", "the drafter")
        config, tensors = files.config, dict(files.tensors)
        text = target_model.config.get_text_config(decoder=True)
        hidden, vocab = text.hidden_size, target_model.get_output_embeddings().out_features
        if config["hidden_size"] != hidden:
            raise InvalidInput(f"method.heads_path={where}: the Medusa heads are {config['hidden_size']} wide where the "
                               f"target's final hidden states are {hidden}; use {HEADS_HINT}")
        k = config["num_heads"]
        weight = torch.stack([tensors.pop(f"lm_heads.{h}.weight") for h in range(k)])  # [K, V', H]
        rows = weight.shape[1]
        token_map = tensors.pop("token_map", None)
        if token_map is not None:
            vocab_ids = token_map.long()
            if int(vocab_ids.min()) < 0 or int(vocab_ids.max()) >= vocab:
                raise InvalidInput(f"method.heads_path={where}: token_map holds ids in [{int(vocab_ids.min())}, "
                                   f"{int(vocab_ids.max())}], outside the target's {vocab} tokens; use {HEADS_HINT}")
        elif rows < vocab:
            vocab_ids = torch.arange(rows)  # vLLM's truncated head without a map: the first ids
        elif rows == vocab:
            vocab_ids = None
        else:
            raise InvalidInput(f"method.heads_path={where}: the heads' output heads have {rows} rows where the target "
                               f"has {vocab} tokens; use {HEADS_HINT}")
        said = config.get("vocab_size")
        if said is not None and said != vocab:
            raise InvalidInput(f"method.heads_path={where}: the drafter is for a vocabulary of {said} tokens where the "
                               f"target has {vocab}; use {HEADS_HINT}")
        shared = files.format == "medusa-fasterdecoding" and config["num_layers"] > 1
        heads = cls(hidden, k, config["num_layers"], bool(config["bias"]), shared)
        missing, unexpected = heads.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise InvalidInput(f"method.heads_path={where}: the Medusa tensors do not match its config (missing "
                               f"{sorted(missing)}, unexpected {sorted(unexpected)}); use {HEADS_HINT}")
        return heads, OutputHead(weight, None, vocab_ids)


class MedusaGuesses(torch.nn.Module):
    """The heads and the output head as one module, so that `compile=on` compiles a step's guesses
    as one call with every weight frozen. `weight`: the output head's `[V', H]` rows (and `bias`, its
    `[V']` bias or None), buffers that share the target's tensors (no copy)."""

    def __init__(self, heads: MedusaHeads, head: OutputHead):
        super().__init__()
        self.heads = heads
        self.register_buffer("weight", head.weight, persistent=False)
        self.register_buffer("bias", head.bias, persistent=False)

    def forward(self, hidden: torch.Tensor, depth: int, ranks: int) -> torch.Tensor:
        """hidden: [B, H] -> the indices (into the head's vocabulary) of the `ranks` likeliest
        tokens of each of the first `depth` heads, [B, depth, ranks]."""
        # The target's logit scale and soft cap (`OutputHead.scale`, `cap`) are increasing: no rank changes.
        x = self.heads(hidden, depth)  # [B, depth, H]
        if self.weight.dim() == 3:  # a published drafter's own output head per head: [K, V', H]
            logits = (x[..., None, :] @ self.weight[:depth].transpose(-1, -2)).squeeze(-2)
        else:
            logits = F.linear(x, self.weight, self.bias)  # [B, depth, V']
        return logits.topk(ranks, dim=-1).indices


class MedusaProposer:
    """Drafts `tree` (a list of rank paths; default `DEFAULT_TREE` cut to the checkpoint's number of
    heads) from Medusa heads loaded from `heads_path`. The schedule's k caps the tree's depth (k = 0: no draft this step)."""

    name = "medusa"
    drafts_trees = True  # its proposals are TreeProposals: only verifiers with a tree form (config checks it)

    def __init__(self, engine: Engine, heads_path: str, tree: list | None = None):
        self.engine, target = engine, engine.target
        target.hidden_source()  # a target without usable hidden states is refused before the file is read
        if is_published(heads_path):
            self.heads, self.head = MedusaHeads.from_files(read_files(heads_path, "medusa", HEADS_HINT), target.model)
            self.head.weight = self.head.weight.to(engine.device, engine.dtype)
            if self.head.vocab_ids is not None:
                self.head.vocab_ids = self.head.vocab_ids.to(engine.device)
        else:
            if heads_path is None or heads_path == "":
                raise MissingInput(f"method=medusa needs heads: set method.heads_path=<path>, {HEADS_HINT}")
            tensors, meta = load_checkpoint(heads_path, "medusa", target.model)
            self.heads = MedusaHeads(meta["hidden_size"], meta["num_heads"])
            self.heads.load_state_dict({k: v for k, v in tensors.items() if k != "vocab_ids"})
            self.head = OutputHead.of(target.model, tensors.get("vocab_ids"))
        self.heads.to(engine.device, engine.dtype).eval()
        if tree is None:  # the default tree, as deep as the checkpoint has heads
            tree = [p for p in DEFAULT_TREE if len(p) <= self.heads.num_heads]
        self.shape = static_tree(tree)
        if self.shape.max_depth > self.heads.num_heads:
            raise ValueError(f"method.tree is {self.shape.max_depth} deep but the checkpoint has "
                             f"{self.heads.num_heads} heads; use a tree at most {self.heads.num_heads} deep")
        vocab = self.head.weight.shape[-2]
        if max(self.shape.ranks) >= vocab:  # topk would fail at the first step
            raise InvalidInput(f"method.tree: rank {max(self.shape.ranks)} asks each head for more guesses than "
                               f"the {vocab} tokens it proposes from"
                               f"{' (the drafter reduced the vocabulary)' if self.head.vocab_ids is not None else ''}; "
                               f"use ranks below {vocab}")
        self.num_nodes = self.shape.num_nodes
        self.target = target
        target.keep_hidden_states()
        self.guesses = MedusaGuesses(self.heads, self.head)
        # Where the engine compiles, the guesses compile with the target's options (None: eager).
        self.compiled = engine.compiled("medusa heads", self.guesses, "call")

    @staticmethod
    def heads_info(heads_path: Any) -> tuple[int, bool, dict] | None:
        """For the config's checks before any model loads: (tokens each head proposes from, whether
        that is a reduced vocabulary, {"num_heads": K}) of a published drafter's folder, refusing
        what the reader refuses; None for a specdec checkpoint, which the config checks from its header."""
        if not is_published(heads_path):
            return None
        files = read_files(heads_path, "medusa", HEADS_HINT)
        rows = files.tensors["lm_heads.0.weight"].shape[0]
        reduced = "token_map" in files.tensors or rows < (files.config.get("vocab_size") or rows)
        return rows, reduced, {"num_heads": files.config["num_heads"]}

    def reset(self, state) -> None:
        pass

    def _shape(self, k: int):
        """The tree cut to depth k (cached per shape)."""
        if k >= self.shape.max_depth:
            return self.shape
        return static_tree([p for p in self.shape.paths if len(p) <= k])

    @torch.inference_mode()
    def propose(self, state, k: int) -> Proposal:
        b, device = state.batch_size, state.tokens.device
        if k == 0:
            return Proposal.empty(b, device)
        shape = self._shape(k)
        last = to_device(self.target.lengths, device) - 1  # the entry that produced the last token
        hidden = self.target.hidden_at(None, torch.arange(b, device=device), last)  # [B, H]
        guesses = self.compiled.forward if self.compiled is not None else self.guesses
        top = guesses(hidden, shape.max_depth, max(shape.ranks) + 1)  # [B, D, R]
        depth = to_device(shape.depths, device) - 1
        rank = to_device(shape.ranks, device)
        tokens = self.head.token_ids(top[:, depth, rank])  # [B, N]
        return TreeProposal(tokens, [shape.num_nodes] * b, None, tree=shape.expand(b, device))

    def observe(self, state, outcome) -> None:
        pass
