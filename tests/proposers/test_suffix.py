"""Suffix decoding: the two indexes (matches, frequencies, memory bound, eviction), the draft's
length rule, cross-request reuse, and greedy token identity with plain decoding; its tree form
(`SuffixTreeProposer`): the best-first expansion and greedy identity (its sampling distribution is
tested in tests/proposers/test_strategies_lossless.py)."""

import functools
import json
import random

import pytest
import torch

from specdec.core.decoding import DecodeState, SpeculativeDecoder
from specdec.core.sampling import SamplingParams
from specdec.core.tree import TreeProposal
from specdec.proposers.suffix import (
    OutputCache,
    SuffixIndex,
    SuffixProposer,
    SuffixTreeProposer,
    TokenPositions,
    continuation,
    expansion,
)
from tests.conftest import RAGGED_PROMPTS


def _dump(node) -> dict:
    return {t: (c.count, _dump(c)) for t, c in sorted(node.children.items())}


def test_trie_counts_continuations_and_proposes_the_most_frequent():
    index = SuffixIndex(max_depth=6)
    for seq in ([1, 2, 3, 7], [1, 2, 3, 7], [1, 2, 4, 8]):
        index.add(seq)
    (m, node), *shorter = index.matches([9, 1, 2], longest=5)
    assert m == 2 and index.children(node) == {3: 2, 4: 1}
    assert [s for s, _ in shorter] == [1]  # "2" alone was also followed by something
    tokens, probs = continuation(index, node, limit=5, min_prob=0.1)
    assert tokens == [3, 7] and probs == pytest.approx([2 / 3, 2 / 3])  # "1 2 3" was always followed by 7
    tokens, _ = continuation(index, node, limit=5, min_prob=0.7)
    assert tokens == []  # 2/3 < 0.7: not even the first token is likely enough
    assert index.matches([5, 6], longest=5) == []  # never seen


def test_trie_is_cut_at_max_depth():
    index = SuffixIndex(max_depth=3)
    index.add([1, 2, 3, 4, 5])
    assert index.find([1, 2, 3]) is not None and index.find([1, 2, 3, 4]) is None
    assert index.nodes == 1 + 5 + 4 + 3  # root, then substrings of length 1, 2, 3


@pytest.mark.parametrize("seed", range(5))
def test_token_positions_answer_like_a_trie_over_the_same_sequence(seed):
    rng = random.Random(seed)
    seq = [rng.randrange(4) for _ in range(120)]
    own, depth = TokenPositions(), 8
    for n in range(1, len(seq) + 1):
        own.extend(seq[n - 1: n])
        trie = SuffixIndex(depth)
        trie.add(seq[:n])
        context = seq[max(n - depth, 0): n]
        a = [(m, own.children(e)) for m, e in own.matches(context, depth - 1)]
        b = [(m, trie.children(node)) for m, node in trie.matches(context, depth - 1)]
        assert a == b, n
        for (m, ends), (_, node) in zip(own.matches(context, depth - 1), trie.matches(context, depth - 1)):
            limit = depth - m  # the trie knows continuations up to its depth
            assert continuation(own, ends, limit, 0.0) == continuation(trie, node, limit, 0.0)


def test_output_cache_evicts_oldest_first_and_stays_within_its_bounds():
    outputs = [[1, 2, 3, 4], [2, 3, 5], [6, 2, 3, 4, 6], [7, 7, 7]]
    cache = OutputCache(max_depth=4, max_requests=2, max_tokens=100)
    for o in outputs:
        cache.add(o)
    fresh = SuffixIndex(4)
    for o in outputs[-2:]:
        fresh.add(o)
    assert _dump(cache.index.root) == _dump(fresh.root) and cache.index.nodes == fresh.nodes
    assert cache.index.find([1]) is None  # the first output is forgotten entirely

    by_tokens = OutputCache(max_depth=4, max_requests=100, max_tokens=8)
    for o in outputs:
        by_tokens.add(o)
        assert by_tokens.tokens <= 8 and by_tokens.index.nodes <= 1 + 4 * by_tokens.tokens
    assert list(by_tokens.held) == outputs[-2:]
    with pytest.raises(ValueError, match="not added"):
        SuffixIndex(4).remove([1, 2])


def _state(rows: list[list[int]], prompt_lens: list[int]) -> DecodeState:
    width = max(map(len, rows)) + 8
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    return DecodeState(tokens, [len(r) for r in rows], prompt_lens, [True] * len(rows), 8, width,
                       SamplingParams(), torch.Generator())


def test_draft_length_follows_the_match_length_and_its_frequency():
    # Row 0 ends in "1 2 3", seen once before followed by 4 5 6 7: a 3-token match allows 3 drafts.
    # Row 1 ends in "9", seen before followed by 5 twice and by 6 once (probability 2/3 then 1).
    state = _state([[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [9, 5, 9, 5, 9, 6, 8, 9]], [4, 4])
    p = SuffixProposer(max_spec_factor=1.0, min_token_prob=0.1).propose(state, 8)
    assert p.lengths == [3, 1] and p.tokens[0, :3].tolist() == [4, 5, 6] and p.tokens[1, 0] == 5
    p = SuffixProposer(max_spec_factor=2.0, min_token_prob=0.1).propose(state, 8)
    assert p.lengths[0] == 6 and p.tokens[0, :6].tolist() == [4, 5, 6, 7, 8, 1]  # 2 x the 3-token match
    p = SuffixProposer(max_spec_factor=2.0, min_token_prob=0.7).propose(state, 8)
    assert p.lengths == [6, 0]  # row 1's best continuation is right only 2/3 of the time
    assert SuffixProposer().propose(state, 2).lengths == [2, 1]  # never more than k


def test_finished_outputs_are_proposed_to_later_requests():
    proposer = SuffixProposer(max_spec_factor=2.0)
    first = _state([[40, 41, 42, 10, 11, 12, 13, 14, 15]], [3])
    proposer.propose(first, 4)
    outcome = type("Outcome", (), {"active": [True]})()
    first.active = [False]
    proposer.observe(first, outcome)  # the request finished: its output is kept
    proposer.reset(None)
    later = _state([[50, 51, 10, 11, 12]], [2])  # a new request whose text meets that output
    p = proposer.propose(later, 4)
    assert p.tokens[0, : p.lengths[0]].tolist() == [13, 14, 15]
    assert SuffixProposer(max_cached_requests=0).propose(later, 4).max_length == 0


def test_tree_expansion_grows_the_most_likely_continuations_first():
    index = SuffixIndex(max_depth=6)
    for seq in ([1, 2, 3, 7], [1, 2, 3, 7], [1, 2, 4, 8], [1, 2, 4, 9]):
        index.add(seq)
    (m, node), *_ = index.matches([9, 1, 2], longest=5)
    tokens, parents, probs = expansion(index, node, depth=3, budget=8, min_prob=0.1)
    # "1 2" went on as 3 7 twice, 4 8 once, 4 9 once: both branches, then their continuations
    assert tokens == [3, 4, 7, 8, 9] and parents == [-1, -1, 0, 1, 1]
    assert probs == pytest.approx([0.5, 0.5, 0.5, 0.25, 0.25])
    assert expansion(index, node, depth=3, budget=3, min_prob=0.1)[0] == [3, 4, 7]  # the budget keeps the likeliest
    assert expansion(index, node, depth=1, budget=8, min_prob=0.1)[0] == [3, 4]  # one level
    assert expansion(index, node, depth=3, budget=8, min_prob=0.3)[0] == [3, 4, 7]  # 0.25 < 0.3


@pytest.mark.parametrize("seed", range(3))
def test_a_tree_without_branches_is_the_chain(seed):
    rng = random.Random(seed)
    seq = [rng.randrange(50) for _ in range(60)]  # 50 symbols: few repeats, so few branches
    seq += seq[:20]
    own = TokenPositions()
    own.extend(seq)
    chains = 0
    for _, ends in own.matches(seq[-8:], 8):
        chain, chain_probs = continuation(own, ends, 6, 0.1)
        tokens, parents, probs = expansion(own, ends, 6, 64, 0.1)
        if all(p == i - 1 for i, p in enumerate(parents)):
            assert (tokens, probs) == (chain, pytest.approx(chain_probs))
            chains += 1
        else:
            assert tokens[0] == chain[0]  # the branch point's likeliest child leads either way
    assert chains > 0  # the long matches continue one way only


def test_suffix_tree_proposals_are_ragged_trees():
    state = _state([[1, 2, 3, 4, 5, 1, 2, 3, 6, 7, 1, 2], [9, 9, 9, 9], [5, 6, 7, 8]], [3, 2, 2])
    p = SuffixTreeProposer(max_spec_factor=2.0, budget=4).propose(state, 4)
    chain = SuffixProposer(max_spec_factor=2.0).propose(state, 4)
    assert isinstance(p, TreeProposal) and p.lengths == [4, chain.lengths[1], 0] and chain.lengths[1] > 0
    # row 0: "1 2" went on as "3 4 5" and "3 6 7": 3, then both branches
    assert p.tokens[0].tolist() == [3, 4, 6, 5] and p.tree.parents[0].tolist() == [-1, 0, 0, 1]
    # row 1: "9"s always went on with 9: no branch, so the tree is the chain
    assert p.tokens[1].tolist() == chain.tokens[1].tolist() and p.tree.parents[1, :2].tolist() == [-1, 0]
    assert SuffixTreeProposer().propose(state, 0).max_length == 0
    with pytest.raises(ValueError, match="budget"):
        SuffixTreeProposer(budget=0)


@pytest.mark.parametrize("batch", ["single", "ragged"])
@pytest.mark.parametrize("kind", [SuffixProposer, SuffixTreeProposer])
def test_suffix_greedy_equals_autoregressive_across_requests(engine_factory, batch, kind):
    engine = engine_factory()
    prompts = RAGGED_PROMPTS[:1] if batch == "single" else RAGGED_PROMPTS
    plain = SpeculativeDecoder(engine)
    dec = SpeculativeDecoder(engine, kind(max_spec_factor=2.0), num_speculative_tokens=6)
    proposed = 0
    for turn in range(3):  # requests in sequence: later ones can draft from earlier outputs
        ps = [p + [turn + 20] for p in prompts]
        ref, out = plain.generate(ps, max_new_tokens=40), dec.generate(ps, max_new_tokens=40)
        assert out.output_ids == ref.output_ids and out.lossless
        proposed += sum(r.proposed for r in out.stats.rows)
    assert proposed > 0 and dec.proposer.outputs.held


@pytest.mark.slow
def test_suffix_policy_and_hybrid_with_its_trained_part_on_the_embedded_target_equal_its_greedy_output(target_time):
    from specdec import Engine, ModelSpec, load_model
    from specdec.adaptive.hybrid import HybridProposer
    from specdec.core.schedules import make_schedule
    from specdec.proposers.eagle import EagleProposer
    from specdec.proposers.ngram import NgramProposer
    from specdec.study.data import build_turn_input

    model, tok = load_model(ModelSpec(path="embedded"))
    engine = Engine(model, dtype="float32")
    prompts = [build_turn_input(tok, [], q) for q in (
        "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.", "Name three primary colors.")]
    plain = SpeculativeDecoder(engine).generate(prompts, max_new_tokens=32)
    target_time(engine)  # the policies' choices below do not depend on the machine's load
    hybrid = HybridProposer(engine, {"suffix": SuffixProposer(), "ngram": NgramProposer,
                                     "eagle": functools.partial(EagleProposer, heads_path="embedded")})
    for proposer, schedule in ((SuffixProposer(), make_schedule("cost_aware", 8)), (hybrid, None)):
        dec = SpeculativeDecoder(engine, proposer, num_speculative_tokens=8, schedule=schedule)
        for _ in range(2):  # the second time, the first outputs are in the cross-request index
            out = dec.generate(prompts, max_new_tokens=32)
            assert out.output_ids == plain.output_ids
        assert sum(r.accepted for r in out.stats.rows) > 0


# ---------------------------------------------------------------- a datastore (`corpus`)


def _corpus(path, rows) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


@pytest.mark.parametrize("kind", [SuffixProposer, SuffixTreeProposer])
def test_a_corpus_is_drafted_from_and_greedy_output_is_unchanged(engine_factory, tmp_path, kind):
    """The corpus holds the target's own answers, once as they are and once with every fifth token
    changed: drafts from it are often right (more accepted than without it) and sometimes wrong, and
    the output is plain decoding's either way."""
    engine = engine_factory()
    ref = SpeculativeDecoder(engine).generate(RAGGED_PROMPTS, max_new_tokens=40)
    spoiled = [[(t + 1) % 97 if i % 5 == 4 else t for i, t in enumerate(o)] for o in ref.output_ids]
    corpus = _corpus(tmp_path / "corpus.jsonl", [{"token_ids": o} for o in ref.output_ids + spoiled])
    accepted = {}
    for name, args in (("none", {}), ("corpus", {"corpus": corpus})):
        dec = SpeculativeDecoder(engine, kind(engine, max_cached_requests=0, **args), num_speculative_tokens=6)
        out = dec.generate(RAGGED_PROMPTS, max_new_tokens=40)
        assert out.output_ids == ref.output_ids and out.lossless
        accepted[name] = sum(r.accepted for r in out.stats.rows)
    assert accepted["corpus"] > 2 * max(accepted["none"], 10), accepted


def test_a_prompt_whose_answer_the_corpus_holds_is_refused(engine_factory, tmp_path):
    engine = engine_factory()
    other = [5, 6, 7]
    corpus = _corpus(tmp_path / "c.jsonl", [{"prompt_token_ids": RAGGED_PROMPTS[1], "output_token_ids": [1, 2, 3]},
                                            {"prompt_token_ids": other, "output_token_ids": [4, 5]}])
    dec = SpeculativeDecoder(engine, SuffixProposer(engine, corpus=corpus))
    with pytest.raises(ValueError, match="prompt 1 is a prompt of method.proposer.corpus=.*whose answer it holds"):
        dec.generate(RAGGED_PROMPTS, max_new_tokens=4)
    assert dec.generate([RAGGED_PROMPTS[0]], max_new_tokens=4).output_ids  # others decode


@pytest.mark.parametrize("text, message", [
    ('{"output_token_ids": [1, 2]}\n{"output_token_ids": [1, 2\n', "line 2: not JSON"),
    ('[1, 2, 3]\n', "line 1: not a JSON object"),
    ('{"text": "hello"}\n', r"line 1: output_token_ids or token_ids must be a list of token ids"),
    ('{"token_ids": [1, -2]}\n', "must be a list of token ids"),
    ('{"token_ids": [1, 2], "prompt_token_ids": "abc"}\n', "prompt_token_ids must be a list"),
    ('{"token_ids": [1, 100000]}\n', r"token id 100000 is outside the target's vocabulary \[0, "),
    ('\n\n', "holds no sequences"),
])
def test_a_bad_corpus_file_is_refused_naming_the_line(engine_factory, tmp_path, text, message):
    path = tmp_path / "corpus.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        SuffixProposer(engine_factory(), corpus=str(path))
    with pytest.raises(FileNotFoundError, match="no such file"):
        SuffixProposer(corpus=str(tmp_path / "missing.jsonl"))


def test_a_results_file_is_a_corpus(tmp_path):
    """specdec's own results.jsonl (a line per prompt, with prompt_token_ids and output_token_ids)."""
    rows = [{"prompt_id": "1", "method": "suffix", "prompt_token_ids": [9, 9], "output_token_ids": [1, 2, 3, 4],
             "tokens_per_s": 3.0}, {"prompt_id": "2", "prompt_token_ids": [8], "output_token_ids": [1, 2, 5]}]
    corpus = SuffixProposer(corpus=_corpus(tmp_path / "results.jsonl", rows)).corpus
    assert (corpus.sequences, corpus.tokens, corpus.prompts) == (2, 7, {(9, 9), (8,)})
    assert corpus.index.children(corpus.index.find([1, 2])) == {3: 1, 5: 1}


def test_methods_that_read_one_corpus_share_it_until_the_file_changes(tmp_path):
    path = _corpus(tmp_path / "c.jsonl", [{"token_ids": [1, 2, 3]}])
    a, b = SuffixProposer(corpus=path), SuffixTreeProposer(corpus=path)
    assert a.corpus is b.corpus
    _corpus(tmp_path / "c.jsonl", [{"token_ids": [1, 2, 3, 4, 5]}])
    c = SuffixProposer(corpus=path)
    assert c.corpus is not a.corpus and c.corpus.tokens == 5 and a.corpus.tokens == 3
