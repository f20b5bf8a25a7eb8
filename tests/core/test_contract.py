"""What a proposer returns is checked once per step (`specdec.core.contract`): a padded proposal gives
every verifier (greedy, speculative sampling, block, typical, forced, trees) the tokens its unpadded
form gives, and a malformed one fails on its first step with an error that names the proposer and
the field; on a device where reads cost a synchronisation, the check reads nothing."""

import re

import pytest
import torch

from specdec.accel.syncs import count_host_syncs
from specdec.core.contract import check_proposal
from specdec.core.decoding import SpeculativeDecoder
from specdec.core.tree import TreeProposal, chain_tree
from specdec.core.types import DecodeState, Proposal
from specdec.proposers.draft_model import DraftModelProposer

PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13]]
K = 4
VOCAB = 256  # the tiny random target's


class Ragged:
    """A draft model's drafts, row b cut to k - 1 - b % 2 of them, its tokens (and q) padded with
    zeros to `width` columns (None: to the longest row, unpadded); as a chain tree with `tree`.
    Records the width of each proposal the loop hands back in `observe`."""

    name = "ragged"
    drafts_trees = False

    def __init__(self, engine, width: int | None = None, tree: bool = False):
        self.inner = DraftModelProposer(engine)
        self.width, self.tree = width, tree
        self.drafts_trees = tree
        if tree:
            self.num_nodes = width or K - 1
        self.seen: list[tuple[int, int]] = []  # (proposal width, longest row) per step

    def reset(self, state):
        self.seen.clear()
        self.inner.reset(state)

    def propose(self, state, k):
        drafted = self.inner.propose(state, k)
        lengths = [max(0, min(n, k - 1 - b % 2)) for b, n in enumerate(drafted.lengths)]
        longest = max(lengths)
        width = self.width or longest
        tokens = torch.zeros(state.batch_size, width, dtype=torch.long)
        tokens[:, :longest] = drafted.tokens[:, :longest]
        probs = None
        if drafted.probs is not None:
            probs = torch.zeros(state.batch_size, width, drafted.probs.shape[-1])
            probs[:, :longest] = drafted.probs[:, :longest]
        if self.tree and width:  # a step with no room to draft (k = 0) proposes no tree
            return TreeProposal(tokens, lengths, probs, tree=chain_tree(state.batch_size, width, lengths))
        return Proposal(tokens, lengths, probs)

    def observe(self, state, outcome):
        self.seen.append((outcome.proposal.k, outcome.proposal.max_length))
        self.inner.observe(state, outcome)


CASES = [  # verifier, temperature, verifier_args, tree
    ("auto", 0.0, None, False),  # greedy
    ("auto", 0.8, None, False),  # speculative sampling
    ("block", 0.8, None, False),
    ("typical", 0.8, None, False),
    ("forced", 0.8, {"acceptance": 0.7}, False),
    ("auto", 0.0, None, True),  # tree greedy
    ("auto", 0.8, None, True),  # recursive rejection sampling
]


@pytest.mark.parametrize("pad", [K, K + 3])
@pytest.mark.parametrize("verifier, temperature, args, tree", CASES)
def test_a_padded_proposal_decodes_as_its_unpadded_form(engine_factory, verifier, temperature, args, tree, pad):
    engine = engine_factory("self")
    runs = {}
    for width in (None, pad):
        proposer = Ragged(engine, width, tree)
        decoder = SpeculativeDecoder(engine, proposer, K, verifier=verifier, verifier_args=args)
        out = decoder.generate(PROMPTS, 12, temperature=temperature, seed=3)
        runs[width] = (out.output_ids, [r.accepted for r in out.stats.rows], proposer.seen)
    (tokens, accepted, seen), (padded_tokens, padded_accepted, padded_seen) = runs[None], runs[pad]
    assert padded_tokens == tokens and padded_accepted == accepted
    assert sum(accepted) > 0  # drafts were kept: the padded columns sat next to real ones
    assert seen and all(width == longest for width, longest in padded_seen)  # every verifier saw the cut width
    assert max(longest for _, longest in padded_seen) < pad  # and there was padding to cut


def _run(engine, propose, batch=2, temperature=0.0):
    class Bad:
        name = "bad"

        def reset(self, state):
            pass

        def propose(self, state, k):
            return propose(state.batch_size, k)

        def observe(self, state, outcome):
            pass

    return SpeculativeDecoder(engine, Bad(), K).generate(PROMPTS[:batch], 6, temperature=temperature)


def _ids(b, k):
    return torch.full((b, k), 7, dtype=torch.long)


BAD = [  # name, proposal(B, k), error, message
    ("rank-1 tokens", lambda b, k: Proposal(torch.full((k,), 7), [k] * b), ValueError,
     r"Proposal.tokens must be \[B, k\] with B = 2 .* got shape \(4,\)"),
    ("a bare tensor", lambda b, k: _ids(b, k), TypeError,
     r"returned a bare \(2, 4\) tensor, not a Proposal: return Proposal\(tokens"),
    ("lengths as an int", lambda b, k: Proposal(_ids(b, k), k), TypeError,
     r"Proposal.lengths must be a list of 2 ints \(one per row\), got the int 4: pass \[4\] \* 2"),
    ("lengths as a tensor", lambda b, k: Proposal(_ids(b, k), torch.full((b,), k)), TypeError,
     r"lengths must be a list of 2 ints on the host, got a tensor: pass lengths.tolist\(\), or, to keep them on the device, device_lengths="),
    ("one length for two rows", lambda b, k: Proposal(_ids(b, k), [k]), TypeError,
     r"lengths must be a list of 2 ints \(one per row\), got 1 values \[4\]"),
    ("lengths longer than the width", lambda b, k: Proposal(_ids(b, k - 1), [k] * b), ValueError,
     r"Proposal.lengths \[4, 4\] must each be in \[0, 3\], the width of tokens \(3 columns\)"),
    ("a negative length", lambda b, k: Proposal(_ids(b, k), [-1, k]), ValueError,
     r"Proposal.lengths \[-1, 4\] must each be in \[0, 4\]"),
    ("more drafts than k", lambda b, k: Proposal(_ids(b, k + 2), [k + 2] * b), ValueError,
     r"lengths \[6, 6\] ask to score more than the k=4 drafts asked for"),
    ("ids out of the vocabulary", lambda b, k: Proposal(_ids(b, k).fill_(VOCAB), [2] * b), ValueError,
     r"tokens hold the id 256, outside the target's vocabulary \[0, 256\); padding included"),
    ("a negative id in the padding", lambda b, k: Proposal(torch.tensor([[7, -1, -1, -1]] * b), [1] * b), ValueError,
     r"tokens hold the id -1, outside the target's vocabulary"),
    ("the wrong batch size", lambda b, k: Proposal(_ids(b + 1, k), [k] * (b + 1)), ValueError,
     r"Proposal.tokens must be \[B, k\] with B = 2 .* got shape \(3, 4\)"),
    ("float tokens", lambda b, k: Proposal(_ids(b, k).float(), [k] * b), TypeError,
     r"Proposal.tokens must hold integer token ids, got torch.float32"),
    ("q of another vocabulary", lambda b, k: Proposal(_ids(b, k), [k] * b, torch.full((b, k, 100), 0.01)),
     ValueError, r"Proposal.probs must be None .* shape \(2, 4, 256\) \(\[B, k, V\]\), got \(2, 4, 100\)"),
    ("device lengths above their bound",
     lambda b, k: Proposal(_ids(b, k), [2] * b, device_lengths=torch.tensor([1, 3])), ValueError,
     r"Proposal.device_lengths \[1, 3\] must each be in \[0, lengths\[b\]\], their bound \[2, 2\]"),
    ("a tree whose lengths are not its tree's",
     lambda b, k: TreeProposal(_ids(b, k), [k] * b, None, tree=chain_tree(b, k, [2] * b)), ValueError,
     r"TreeProposal.lengths \[4, 4\] differ from its tree's \[2, 2\]"),
]


@pytest.mark.parametrize("name, propose, error, message", BAD, ids=[c[0] for c in BAD])
def test_a_malformed_proposal_fails_its_first_step_naming_proposer_and_field(engine_factory, name, propose, error,
                                                                              message):
    with pytest.raises(error, match=message) as caught:
        _run(engine_factory(), propose)
    assert str(caught.value).startswith("Bad.propose(state, k=4)")


def test_integer_ids_of_another_dtype_and_lengths_as_a_tuple_are_taken(engine_factory):
    """int32 ids are made long (speculative sampling gathers q and p at them, which takes long only)."""
    engine = engine_factory()
    plain = _run(engine, lambda b, k: Proposal(_ids(b, k), [k] * b), temperature=0.8)
    other = _run(engine, lambda b, k: Proposal(_ids(b, k).int(), tuple([k] * b)), temperature=0.8)
    assert other.output_ids == plain.output_ids


def _state(b: int) -> DecodeState:
    from specdec.core.sampling import SamplingParams

    tokens = torch.zeros(b, 16, dtype=torch.long)
    return DecodeState(tokens, [4] * b, [4] * b, [True] * b, 8, 16, SamplingParams(), torch.Generator())


def test_a_well_formed_proposal_passes_as_it_is():
    proposal = Proposal(_ids(2, K), [K, 2])
    assert check_proposal(object(), proposal, _state(2), K, VOCAB) is proposal  # nothing copied in the hot loop
    cut = check_proposal(object(), Proposal(_ids(2, K + 2), [3, 2]), _state(2), K, VOCAB)
    assert cut.k == 3 and cut.lengths == [3, 2]


def test_where_reads_cost_a_synchronisation_the_check_reads_nothing():
    """While the counter counts, the CPU answers as a GPU: only what the host knows is checked."""
    state = _state(2)
    unsettled = Proposal(_ids(2, K), [K] * 2, device_lengths=torch.tensor([1, 3]))
    out_of_vocabulary = Proposal(_ids(2, K).fill_(VOCAB), [K] * 2)
    with count_host_syncs() as syncs:
        check_proposal(object(), unsettled, state, K, VOCAB)
        check_proposal(object(), out_of_vocabulary, state, K, VOCAB)  # a device value: not read here
        with pytest.raises(ValueError, match=re.escape("lengths [5, 5] must each be in [0, 4]")):
            check_proposal(object(), Proposal(_ids(2, K), [K + 1] * 2), state, K + 1, VOCAB)  # host lengths: checked
    assert syncs.total == 0
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        check_proposal(object(), out_of_vocabulary, state, K, VOCAB)  # where reads are free, it is
