"""The host learns a step's outcome once per step.

On a GPU every read of a device value stalls the host until the device catches up; a step with
one read per draft token or per row cannot keep the GPU busy. `count_host_syncs` counts those
reads on the CPU too (where the early exits that only the CPU takes are switched off), so these
tests bound, for every method, greedy and sampling, a single row and a ragged batch, the reads a
generation makes: one per step (the accepted counts and tokens, read together) plus one for the
prefill's first token; the hybrid judges the drafts of a lookup it did not use from the host's own
copy (`Proposal.host_tokens`), without a read. The CUDA test checks the counter against CUDA's own
sync detector.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec.accel.syncs import count_host_syncs, detect_cuda_syncs, is_sync_report, reads_are_free
from specdec.adaptive.hybrid import HybridProposer
from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.core.sampling import one_hot
from specdec.core.schedules import make_schedule
from specdec.core.tree import TokenTree
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.layer_skip import LayerSkipProposer
from specdec.proposers.medusa import MedusaProposer
from specdec.proposers.ngram import NgramProposer
from specdec.proposers.suffix import SuffixProposer, SuffixTreeProposer
from tests.conftest import RAGGED_PROMPTS, make_engine

ASSETS = Path(__file__).resolve().parents[1] / "assets"
# Prompts that repeat themselves, so that n-gram and suffix lookups find drafts.
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [3, 4], [10, 11, 12, 13, 14, 15, 16, 10, 11, 12]]


def test_counter_sees_every_kind_of_read():
    x = torch.arange(6)
    with count_host_syncs() as syncs:
        x.max().item()
        bool((x > 3).any())
        int(x.sum())
        x.tolist()
        x.nonzero()
        x[x > 2]  # boolean indexing: the result's shape depends on the data
        torch.nn.functional.one_hot(x, 8)  # reads the ids' smallest and largest back: two reads
        if x[0] == 0:
            pass
    assert syncs.total == 9, syncs
    assert syncs.by_kind["tolist"] == 1 and syncs.by_kind["nonzero"] == 1 and syncs.by_kind["index.Tensor"] == 1
    with torch.inference_mode(), count_host_syncs() as syncs:  # item and bool() dispatch otherwise there
        x.max().item()
        bool((x > 3).any())
    assert syncs.total == 2, syncs


def test_only_reports_of_a_synchronisation_count_as_detected():
    """CUDA's detector's first warning in a process says it is a prototype; an H200 run counted it as a
    sync (17 detected against 16 counted) until the filter took only the reports."""
    notice = ("Synchronization debug mode is a prototype feature and does not yet detect all synchronizing "
              "operations (Triggered internally at /pytorch/torch/csrc/cuda/Module.cpp:1003.)")
    report = "called a synchronizing CUDA operation (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:162.)"
    assert not is_sync_report(notice)
    assert is_sync_report(report)


def test_counting_leaves_dynamo_compiling():
    """A compiled call that would need a new graph inside the counter runs as its Python there, and a
    later call of another shape still compiles: dynamo, asked to compile under a dispatch mode, would
    have given up on the function for the rest of the process."""
    def f(x):
        return torch.nonzero(x * 2)

    compiled = torch.compile(f, backend="eager", dynamic=False)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled(torch.ones(3))
    with count_host_syncs() as syncs:
        assert compiled(torch.ones(4)).shape == (4, 1)
    assert syncs.by_kind == {"nonzero": 1}
    compiled(torch.ones(5))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 2  # shapes 3 and 5, not 4


def test_counter_ignores_device_work_and_copies_to_the_device():
    x = torch.arange(6)
    with count_host_syncs(where=True) as syncs:
        y = torch.tensor([1, 2, 3])  # host to device: no wait for the device
        (x * 2 + y.sum()).cumsum(0).gather(0, torch.tensor([0, 2]))
        torch.where(x > 2, x, 0).amax()
        one_hot(x, 8)  # specdec's one-hot reads nothing back
        assert not reads_are_free(x.device)  # while counting, the CPU answers like a GPU
    assert syncs.total == 0, syncs
    assert reads_are_free(x.device)
    with count_host_syncs(), pytest.raises(RuntimeError, match="nest"):
        with count_host_syncs():
            pass


def _proposer(method: str, engine: Engine):
    if method == "draft":
        return DraftModelProposer(engine)
    if method == "layer_skip":
        return LayerSkipProposer(engine, exit_layer=1)
    if method == "ngram":
        return NgramProposer(engine)
    if method == "suffix":
        return SuffixProposer(max_spec_factor=2.0)
    if method == "suffix_tree":
        return SuffixTreeProposer(max_spec_factor=2.0, budget=8)
    if method == "eagle":
        return EagleProposer(engine, str(ASSETS / "tiny_random_eagle.safetensors"), budget=10, topk=3, width=3, depth=4)
    if method == "hybrid":  # a draft model and suffix decoding, one chosen per step
        return HybridProposer(engine, parts={"draft": DraftModelProposer(engine), "suffix": SuffixProposer()})
    if method == "medusa":
        return MedusaProposer(engine, str(ASSETS / "tiny_random_medusa.safetensors"),
                              tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    return None


@pytest.mark.parametrize("method", ["plain", "draft", "layer_skip", "ngram", "suffix", "suffix_tree", "eagle", "medusa",
                                    "hybrid"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("batch", ["single", "ragged"])
def test_one_read_per_step(target, unrelated_draft, method, temperature, batch):
    prompts = PROMPTS[:1] if batch == "single" else PROMPTS
    def decoder():  # a fresh one each time: suffix decoding also drafts from earlier generations' outputs
        engine = make_engine(target, unrelated_draft)
        return SpeculativeDecoder(engine, _proposer(method, engine), num_speculative_tokens=4)

    free = decoder().generate(prompts, max_new_tokens=20, temperature=temperature, seed=3)
    counted = decoder()
    with count_host_syncs(where=True) as syncs:
        out = counted.generate(prompts, max_new_tokens=20, temperature=temperature, seed=3)
    # The early exits the CPU takes change no token. (The hybrid chooses its proposer by measured
    # time, so only its greedy output, the target's whichever it chose, repeats exactly; n-gram
    # lookup, counted as on a GPU, verifies k-wide proposals, so a sampled run draws its uniforms
    # over other widths: the same distribution, tested in test_strategies_lossless, not the same draws.)
    if method not in ("hybrid", "ngram") or temperature == 0.0:
        assert out.output_ids == free.output_ids
    steps = out.stats.steps
    # n-gram's match lengths come back with the step's read (`Proposal.device_lengths`). The hybrid
    # values the lookup drafts it did not use, in hindsight, from the host's copy of them; a draft
    # model tried beside the lookups and not used has its drafts on the device, read once that step.
    unused = sum(n for w, n in syncs.where.items() if w.startswith("core/types.py")) if method == "hybrid" else 0
    assert unused <= steps
    assert syncs.total == 1 + steps + unused, syncs.where
    if method != "plain":
        assert sum(out.stats.draft_lengths) > 0  # the method drafted: its reads were exercised


@pytest.mark.parametrize("method", ["suffix", "ngram"])
def test_lookups_hand_their_drafts_to_the_host_without_a_read(target, method):
    """What the hybrid judges a lookup it did not use by (`Proposal.drafts_on_host`): the drafts the
    lookup proposed, from the host's own copy, with no read of the device (n-gram as the hybrid runs
    it: its match lengths read before scoring, the drafts with them)."""
    engine = Engine(target, None, dtype="float32")
    proposer = _proposer(method, engine)
    if method == "ngram":
        proposer.static_width = False
    proposals, propose = [], proposer.propose
    proposer.propose = lambda state, k: proposals.append(propose(state, k)) or proposals[-1]
    SpeculativeDecoder(engine, proposer, num_speculative_tokens=4).generate(PROMPTS, max_new_tokens=30, seed=3)
    proposals = [p for p in proposals if p.max_length > 0]
    assert proposals
    for p in proposals:
        with count_host_syncs() as syncs:
            drafts = p.drafts_on_host()
        assert syncs.total == 0
        assert drafts == [row[:n] for row, n in zip(p.tokens.tolist(), p.lengths)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_confidence_schedule_reads_once_a_step_off_a_cpu(target, unrelated_draft, temperature):
    """Counted as on a GPU, the draft runs its k passes and its rows' stopping points come back with
    the step's read, instead of a read per pass asking whether every row has stopped."""
    engine = Engine(target, unrelated_draft, dtype="float32")
    decoder = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=6,
                                 schedule=make_schedule("confidence", 6, threshold=0.3))
    with count_host_syncs(where=True) as syncs:
        out = decoder.generate(PROMPTS, max_new_tokens=20, temperature=temperature, seed=3)
    assert syncs.total == 1 + out.stats.steps, syncs.where
    assert min(out.stats.draft_lengths) < 6  # rows did stop early: the lengths came back


@pytest.mark.parametrize("method", ["draft", "eagle", "suffix_tree"])
def test_the_cost_aware_schedule_reads_once_a_step(target, unrelated_draft, method):
    """The policy that plans each step's k reads nothing of its own: a chain's offered lengths are on
    the host, a tree's depths come back with the step's read."""
    engine = Engine(target, unrelated_draft, dtype="float32")
    decoder = SpeculativeDecoder(engine, _proposer(method, engine), num_speculative_tokens=4,
                                 schedule=make_schedule("cost_aware", 4))
    with count_host_syncs(where=True) as syncs:
        out = decoder.generate(PROMPTS, max_new_tokens=20, seed=3)
    assert syncs.total == 1 + out.stats.steps, syncs.where
    assert sum(out.stats.draft_lengths) > 0


def test_tree_bounds_replace_reads_and_are_checked():
    parents = torch.tensor([[-1, 0, 0, 1], [-1, -1, 0, 0]])
    read = TokenTree.build(parents, [4, 2])
    with count_host_syncs() as syncs:
        bounded = TokenTree.build(parents, [4, 2], max_depth=3, max_children=2, check=False)
    assert syncs.total == 0
    for name in ("depth", "mask", "paths", "children"):
        assert torch.equal(getattr(bounded, name), getattr(read, name)), name
    wider = TokenTree.build(parents, [4, 2], max_depth=5, max_children=4)  # loose bounds pad with -1
    assert torch.equal(wider.paths[..., :3], read.paths) and bool((wider.paths[..., 3:] == -1).all())
    assert torch.equal(wider.children[..., :2], read.children) and bool((wider.children[..., 2:] == -1).all())
    with pytest.raises(ValueError, match="deeper than max_depth=2"):
        TokenTree.build(parents, [4, 2], max_depth=2)
    with pytest.raises(ValueError, match="more than max_children=1"):
        TokenTree.build(parents, [4, 2], max_children=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["plain", "draft", "ngram", "eagle"])
def test_cuda_sync_detector_agrees(target, unrelated_draft, method):
    """On a GPU, CUDA's own detector (`set_sync_debug_mode`) sees no more synchronisations in a
    generation than the counter does."""
    engine = Engine(target, unrelated_draft, device="cuda", dtype="float32")
    decoder = SpeculativeDecoder(engine, _proposer(method, engine), num_speculative_tokens=4)
    decoder.generate(RAGGED_PROMPTS, max_new_tokens=8)
    torch.cuda.synchronize()
    with count_host_syncs() as syncs:
        decoder.generate(RAGGED_PROMPTS, max_new_tokens=16)
    torch.cuda.synchronize()
    with detect_cuda_syncs() as detected:
        out = decoder.generate(RAGGED_PROMPTS, max_new_tokens=16)
    assert syncs.total <= 1 + 2 * out.stats.steps
    assert len(detected) <= syncs.total, detected[:5]
