"""Suffix decoding (Oliaro et al. 2024, "SuffixDecoding"; Arctic Inference, vLLM `method: suffix`).

Two indexes of token sequences answer "what followed this context before, and how often":
- per request, the row's own prompt and output so far (`TokenPositions`, rebuilt per generation);
- across requests, the outputs of earlier requests (`SuffixIndex`, kept between generations,
  oldest evicted first, bounded by `max_cached_requests` and `max_cached_tokens`);
- optionally, a datastore read from a file (`corpus`; `Corpus`): the target's own answers to other
  prompts, as REST (He et al. 2024) retrieves drafts from a datastore. It starts the run warm, as a
  server's cache is after many requests, and it is never evicted.

`SuffixIndex` is a suffix trie cut at depth `max_depth`: every substring of length <= max_depth
of the indexed outputs is a path from the root, and each node counts its occurrences. So after a
context suffix s (a node), child c was seen count(s + c) times, and count(s + c) / (sum of the
children's counts) is the empirical probability that c comes next. Adding a token costs max_depth
dictionary steps (one per open suffix), evicting one the same; memory is at most max_depth nodes
per held token, and far fewer in practice since repeated text shares paths. A query walks at most
max_depth suffixes, whatever the number of requests held.

A request's own text can be thousands of tokens (RAG, summarization) and changes every
generation, so it gets an index that is cheap to build: the positions of every token
(`TokenPositions`). The earlier occurrences of the context's last m tokens are the positions of
its last token filtered m - 1 times; the tokens after them give the same counts a trie would.
Building it is one append per token; a query costs the number of earlier occurrences of the last
token, shrinking with every filter.

Proposing, per row: for each suffix of the context found in an index (length m, longest first),
follow the most frequent child while the product of the empirical probabilities stays above
`min_token_prob`, for at most min(k, floor(max_spec_factor * m + max_spec_offset)) tokens: a
longer match earns a longer draft, and a frequent continuation a longer draft than a rare one.
The candidate with the largest expected number of accepted tokens (sum of those products) wins.
`SuffixProposer` drafts that chain. `SuffixTreeProposer` (`method=suffix_tree`) drafts a tree
instead, as SuffixDecoding does: from each candidate match it grows the continuations best first by
that same product, up to `budget` nodes, so that where the past continued a context in two ways both
are verified in one pass.

There is no q: a deterministic draft is a one-hot q, so speculative sampling stays lossless. The
indexes hold only committed tokens, so every proposal is a function of the past.
"""

from __future__ import annotations

import heapq
import json
from collections import Counter, deque
from pathlib import Path

import torch

from specdec.core.device import reads_are_free, to_device
from specdec.core.tree import TokenTree, TreeProposal
from specdec.proposers.base import Proposal


class _Node:
    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixIndex:
    """Occurrence counts of every substring of length <= `max_depth` of the added sequences (a
    suffix trie cut at that depth). `nodes` counts the trie's nodes: its memory."""

    def __init__(self, max_depth: int = 24):
        if max_depth < 2:
            raise ValueError(f"method.proposer.max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        self.nodes = 1

    def add(self, tokens: list[int]) -> None:
        """Index a sequence: each token extends the open suffixes (cursors[d] ends the last d tokens)."""
        cursors, depth = [self.root], self.max_depth
        for t in tokens:
            nxt = [self.root]
            for node in cursors[:depth]:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                    self.nodes += 1
                child.count += 1
                nxt.append(child)
            cursors = nxt

    def remove(self, tokens: list[int]) -> None:
        """Forget one earlier `add(tokens)`: counts drop, nodes no longer seen are deleted."""
        cursors, depth = [self.root], self.max_depth
        for t in tokens:
            nxt = [self.root]
            for node in cursors[:depth]:
                child = node.children.get(t)
                if child is None:
                    raise ValueError("SuffixIndex.remove: this sequence was not added")
                child.count -= 1
                if child.count == 0:  # its subtree reaches 0 later in this same replay
                    del node.children[t]
                    self.nodes -= 1
                nxt.append(child)
            cursors = nxt

    def find(self, tokens: list[int]) -> _Node | None:
        node = self.root
        for t in tokens:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def matches(self, context: list[int], longest: int) -> list[tuple[int, _Node]]:
        """(m, node) for every suffix of `context` of length m <= longest that was seen followed by
        something, longest first."""
        out = []
        for m in range(min(longest, len(context), self.max_depth - 1), 0, -1):
            node = self.find(context[len(context) - m:])
            if node is not None and node.children:
                out.append((m, node))
        return out

    @staticmethod
    def children(node: _Node) -> dict[int, int]:
        """Token -> how often it followed the string `node` stands for."""
        return {t: c.count for t, c in node.children.items()}

    @staticmethod
    def child(node: _Node, token: int) -> _Node:
        return node.children[token]


class TokenPositions:
    """One growing sequence and, per token, the positions where it occurs; answers the same
    questions as `SuffixIndex` about that sequence (a match is the list of its end positions)."""

    def __init__(self):
        self.seq: list[int] = []
        self.where: dict[int, list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.where.setdefault(t, []).append(len(self.seq))
            self.seq.append(t)

    def matches(self, context: list[int], longest: int) -> list[tuple[int, list[int]]]:
        """(m, end positions) for every suffix of `context` (the sequence's own tail) of length
        m <= longest that occurred earlier with a token after it, longest first."""
        n, seq = len(self.seq), self.seq
        ends = [p for p in self.where.get(context[-1], []) if p < n - 1] if context else []
        out, m = [], 1
        while ends and m <= min(longest, len(context)):
            out.append((m, ends))
            if m == len(context):
                break
            t = context[-m - 1]
            ends = [p for p in ends if p >= m and seq[p - m] == t]
            m += 1
        return out[::-1]

    def children(self, ends: list[int]) -> dict[int, int]:
        counts: dict[int, int] = {}
        n = len(self.seq)
        for p in ends:
            if p + 1 < n:
                t = self.seq[p + 1]
                counts[t] = counts.get(t, 0) + 1
        return counts

    def child(self, ends: list[int], token: int) -> list[int]:
        n = len(self.seq)
        return [p + 1 for p in ends if p + 1 < n and self.seq[p + 1] == token]


def continuation(index: SuffixIndex | TokenPositions, match, limit: int,
                 min_prob: float) -> tuple[list[int], list[float]]:
    """Most frequent next tokens after `match` (from `index.matches`), at most `limit`, while the
    running product of empirical probabilities stays >= min_prob. Returns the tokens and those
    products (the chance, under the counts, that the draft is right up to each token)."""
    tokens, probs, p = [], [], 1.0
    while len(tokens) < limit:
        counts = index.children(match)
        if not counts:
            break
        # ties go to the smaller token id, so proposals do not depend on insertion order
        t, c = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))
        p *= c / sum(counts.values())
        if p < min_prob:
            break
        tokens.append(t)
        probs.append(p)
        match = index.child(match, t)
    return tokens, probs


def expansion(index: SuffixIndex | TokenPositions, match, depth: int, budget: int,
              min_prob: float) -> tuple[list[int], list[int], list[float]]:
    """The continuations of `match` as a tree of at most `budget` nodes and `depth` levels, grown best
    first by the product of empirical probabilities along each path (kept while >= min_prob).
    Returns per node its token, its parent (an index into the nodes, -1 for the root) and that
    product: the chance, under the counts, that the path to the node is right; their sum is the
    tree's expected number of accepted tokens. Nodes come out in topological order (a child's
    product is at most its parent's), and siblings most likely first. With one continuation per
    node it is `continuation`'s chain."""
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    # (-product, depth, token, parent node, the parent's match): ties go to the shallower node, then
    # the smaller token id, so the tree does not depend on insertion order
    heap: list[tuple[float, int, int, int, object]] = []

    def grow(parent: int, at, p: float, d: int) -> None:
        counts = index.children(at)
        total = sum(counts.values())
        for t, c in counts.items():
            if p * c / total >= min_prob:
                heapq.heappush(heap, (-p * c / total, d, t, parent, at))

    grow(-1, match, 1.0, 1)
    while heap and len(tokens) < budget:
        neg, d, t, parent, at = heapq.heappop(heap)
        tokens.append(t)
        parents.append(parent)
        probs.append(-neg)
        if d < depth:
            grow(len(tokens) - 1, index.child(at, t), -neg, d + 1)
    return tokens, parents, probs


class OutputCache:
    """The cross-request index: earlier outputs, oldest forgotten first once more than
    `max_requests` outputs or `max_tokens` tokens are held."""

    def __init__(self, max_depth: int, max_requests: int, max_tokens: int):
        if max_requests < 0 or max_tokens < 0:
            raise ValueError("method.proposer: max_cached_requests and max_cached_tokens must be >= 0")
        self.index = SuffixIndex(max_depth)
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.held: deque[list[int]] = deque()
        self.tokens = 0

    def add(self, tokens: list[int]) -> None:
        if not tokens or self.max_requests == 0 or len(tokens) > self.max_tokens:
            return
        self.index.add(tokens)
        self.held.append(tokens)
        self.tokens += len(tokens)
        while len(self.held) > self.max_requests or self.tokens > self.max_tokens:
            old = self.held.popleft()
            self.index.remove(old)
            self.tokens -= len(old)


class Corpus:
    """A datastore of token sequences for suffix decoding, read from a JSONL file: one object per line
    with `output_token_ids` (specdec's results.jsonl, or `scripts/train_heads.py kind=corpus`) or
    `token_ids`, and optionally `prompt_token_ids`, the prompt the sequence answers. Those prompts are
    kept so that a request whose prompt is one of them is refused: its answer would be in the datastore.
    The trie holds at most `max_depth` nodes per token: 111k tokens made 1.6M nodes, 0.4 GB, in 4 s."""

    def __init__(self, path: str | Path, max_depth: int = 24, vocab_size: int | None = None):
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise FileNotFoundError(f"method.proposer.corpus={path}: no such file; give a JSONL file of earlier "
                                    "outputs (a results.jsonl, or scripts/train_heads.py kind=corpus out=<file>.jsonl)")
        self.index = SuffixIndex(max_depth)
        self.prompts: set[tuple[int, ...]] = set()
        self.sequences = self.tokens = 0
        with self.path.open() as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"method.proposer.corpus={path}, line {n}: not JSON ({err})") from None
                    self._add(row, n, vocab_size)
        if not self.sequences:
            raise ValueError(f"method.proposer.corpus={path}: the file holds no sequences")

    def _add(self, row, n: int, vocab_size: int | None) -> None:
        where = f"method.proposer.corpus={self.path}, line {n}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: not a JSON object; each line is {{\"output_token_ids\": [...]}} or "
                             "{\"token_ids\": [...]}")
        tokens = row.get("output_token_ids", row.get("token_ids"))
        prompt = row.get("prompt_token_ids") or []
        for name, ids in (("output_token_ids or token_ids", tokens), ("prompt_token_ids", prompt)):
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                    for t in ids):
                raise ValueError(f"{where}: {name} must be a list of token ids (integers >= 0), got "
                                 f"{str(ids)[:60]}")
            if vocab_size is not None and ids and max(ids) >= vocab_size:
                raise ValueError(f"{where}: token id {max(ids)} is outside the target's vocabulary "
                                 f"[0, {vocab_size}); was this corpus made with another tokenizer?")
        if prompt:
            self.prompts.add(tuple(prompt))
        if tokens:
            self.index.add(tokens)
            self.sequences += 1
            self.tokens += len(tokens)

    def check(self, prompts: list[list[int]]) -> None:
        """Refuse prompts whose answers the datastore holds: drafting from them would measure recall."""
        for i, p in enumerate(prompts):
            if tuple(p) in self.prompts:
                raise ValueError(f"prompt {i} is a prompt of method.proposer.corpus={self.path}, whose answer it "
                                 "holds: build the corpus from other prompts than the ones evaluated")


_CORPORA: dict[tuple, Corpus] = {}


def read_corpus(path: str | Path, max_depth: int = 24, vocab_size: int | None = None) -> Corpus:
    """`Corpus(path, ...)`, read once per file version: the methods of one run that draft from the same
    corpus share its trie (it is never written after reading), which can take gigabytes."""
    file = Path(path).expanduser()
    stat = file.stat() if file.is_file() else None
    key = (str(file.resolve()), stat and (stat.st_mtime_ns, stat.st_size), max_depth, vocab_size)
    if stat is None or key not in _CORPORA:
        corpus = Corpus(path, max_depth, vocab_size)
        _CORPORA.clear()  # one at a time: an old version's trie is not kept alive
        _CORPORA[key] = corpus
    return _CORPORA[key]


class SuffixProposer:
    """Drafts from suffix matches in the row's own tokens and in earlier requests' outputs.

    max_depth:           longest match considered, and depth of the cross-request trie (vLLM's default 24).
    max_spec_factor:     draft at most factor * match length + max_spec_offset tokens (and k).
    max_spec_offset:     see above.
    min_token_prob:      stop when the draft's estimated chance of being right so far falls below it.
    max_cached_requests: earlier outputs kept for the cross-request index (0 turns it off).
    max_cached_tokens:   and at most this many tokens in them (memory: <= max_depth nodes per token).
    corpus:              a JSONL file of other outputs to draft from as well (`Corpus`; None: none).
    """

    name = "suffix"

    def __init__(self, engine=None, max_depth: int = 24, max_spec_factor: float = 1.0, max_spec_offset: float = 0.0,
                 min_token_prob: float = 0.1, max_cached_requests: int = 1000, max_cached_tokens: int = 200_000,
                 corpus: str | Path | None = None):
        if max_spec_factor < 0 or not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"method.proposer: need max_spec_factor >= 0 and 0 <= min_token_prob <= 1, got "
                             f"{max_spec_factor}, {min_token_prob}")
        self.max_depth, self.factor, self.offset, self.min_prob = max_depth, max_spec_factor, max_spec_offset, min_token_prob
        self.outputs = OutputCache(max_depth, max_cached_requests, max_cached_tokens)
        vocab = getattr(getattr(engine, "target", None), "vocab_size", None)
        self.corpus = read_corpus(corpus, max_depth, vocab) if corpus is not None else None
        self.rows: dict[int, TokenPositions] = {}  # row -> its prompt and output so far

    def reset(self, state) -> None:
        self.rows = {}
        if self.corpus is not None and state is not None:
            self.corpus.check([c[:n] for c, n in zip(state.committed, state.prompt_lens)])

    def indexes(self, own: TokenPositions) -> list:
        """Where drafts come from: the row's own text, earlier outputs, the corpus."""
        return [own, self.outputs.index] + ([self.corpus.index] if self.corpus is not None else [])

    def _sync(self, state, b: int) -> list[int]:
        """Index row b's committed tokens not indexed yet; returns its context (last max_depth tokens)."""
        n = state.seq_lens[b]
        own = self.rows.setdefault(b, TokenPositions())
        if len(own.seq) < n:
            own.extend(state.committed[b][len(own.seq):n])
        return own.seq[max(n - self.max_depth, 0):]

    def best(self, context: list[int], own: TokenPositions, k: int, grow) -> tuple[list[int], list]:
        """Over every suffix of the row's context found in its own text or in earlier outputs (match
        length m), what `grow(index, match, limit)` drafts there, at most min(k, factor * m + offset)
        deep: (tokens, extra, probs), `probs` the chance under the counts that each token is right.
        Returns the candidate with the most expected accepted tokens, sum(probs) (ties: the longer
        match), as (tokens, extra)."""
        best: tuple[float, int, list[int], list] = (0.0, 0, [], [])
        for index in self.indexes(own):
            for m, match in index.matches(context, self.max_depth):
                limit = min(k, int(self.factor * m + self.offset))
                if limit < 1:
                    continue
                tokens, extra, probs = grow(index, match, limit)
                if tokens and (sum(probs), m) > best[:2]:
                    best = (sum(probs), m, tokens, extra)
        return best[2], best[3]

    def draft_row(self, context: list[int], own: TokenPositions, k: int) -> tuple[list[int], list[float]]:
        """The best chain for one row (`best` over `continuation`): its tokens and their products."""
        def chain(index, match, limit):
            tokens, probs = continuation(index, match, limit, self.min_prob)
            return tokens, probs, probs

        return self.best(context, own, k, chain)

    @torch.inference_mode()
    def propose(self, state, k: int) -> Proposal:
        b, device = state.batch_size, state.tokens.device
        if k == 0:
            return Proposal.empty(b, device)
        drafts = []
        for row in range(b):
            tokens = []
            if state.active[row]:
                context = self._sync(state, row)
                tokens, _ = self.draft_row(context, self.rows[row], k)
            drafts.append(tokens)
        t = max(len(d) for d in drafts)
        if t == 0:
            return Proposal.empty(b, device)
        out = torch.zeros(b, t, dtype=torch.long)
        for row, d in enumerate(drafts):
            out[row, : len(d)] = torch.tensor(d, dtype=torch.long)
        return Proposal(to_device(out, device), [len(d) for d in drafts], host_tokens=drafts)

    def observe(self, state, outcome) -> None:
        # A row that finished this step is a finished request: its output joins the cross-request
        # index, and its own index is no longer needed.
        for b, (was, now) in enumerate(zip(outcome.active, state.active)):
            if was and not now:
                self.outputs.add(state.output_ids(b))
                self.rows.pop(b, None)


class SuffixTreeProposer(SuffixProposer):
    """Suffix decoding with token trees: per row, the tree of at most `budget` nodes (see
    `expansion`) with the most expected accepted tokens over the candidate matches, at most
    min(k, max_spec_factor x match length + max_spec_offset) deep. Other arguments as `SuffixProposer`.

    A tree costs its node count in scoring width, so on a CPU, where width is not free, a small
    budget wins; with one continuation per node the tree is the chain `SuffixProposer` drafts."""

    name = "suffix_tree"
    drafts_trees = True  # its proposals are TreeProposals: only verifiers with a tree form (config checks it)

    def __init__(self, engine=None, budget: int = 8, **args):
        super().__init__(engine, **args)
        if budget < 1:
            raise ValueError(f"method.proposer.budget must be >= 1, got {budget}")
        self.budget = budget
        self.num_nodes = budget  # the most a step scores beyond the root: caches make room for it

    def tree_row(self, context: list[int], own: TokenPositions, k: int) -> tuple[list[int], list[int]]:
        """The best tree for one row (`best` over `expansion`): its tokens and parents."""
        return self.best(context, own, k,
                         lambda index, match, depth: expansion(index, match, depth, self.budget, self.min_prob))

    @torch.inference_mode()
    def propose(self, state, k: int) -> Proposal:
        b, device = state.batch_size, state.tokens.device
        if k == 0:
            return Proposal.empty(b, device)
        trees = [self.tree_row(self._sync(state, row), self.rows[row], k) if state.active[row] else ([], [])
                 for row in range(b)]
        n = max(len(tokens) for tokens, _ in trees)
        if n == 0:
            return Proposal.empty(b, device)
        tokens = torch.zeros(b, n, dtype=torch.long)
        parents = torch.full((b, n), -1, dtype=torch.long)
        for row, (t, p) in enumerate(trees):
            tokens[row, : len(t)] = torch.tensor(t, dtype=torch.long)
            parents[row, : len(p)] = torch.tensor(p, dtype=torch.long)
        lengths = [len(t) for t, _ in trees]
        # The trees were made here, on the host: their bounds are known without reading the device.
        depth, children = [], Counter()
        for row, (_, p) in enumerate(trees):
            row_depth = []
            for parent in p:
                row_depth.append(1 if parent < 0 else row_depth[parent] + 1)
                children[row, parent] += 1
            depth.extend(row_depth)
        tree = TokenTree.build(to_device(parents, device), lengths, max_depth=max(depth), max_children=max(children.values()),
                               check=reads_are_free(device))
        return TreeProposal(to_device(tokens, device), lengths, None, tree=tree)
