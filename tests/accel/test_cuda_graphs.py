"""compile=on with explicit CUDA graphs (`specdec.accel.cuda_graphs`): every compiled call of a new shape is
captured once and replayed after, its changing inputs copied into the graph's own buffers.

A CPU cannot capture CUDA graphs, so these tests capture with a stand-in (`tests.taped_graph.TapedGraph`)
that replays as a real graph does: the operators recorded at the capture, without the caller's Python,
over the capture's memory, its results written into the tensors the capture returned. An input that
the caller forgot to copy into the graph's buffers is then read stale, and a host decision that a
later call would make differently is frozen, exactly as on a GPU, and the tokens differ from the eager
path's. The same checks on a GPU, with real graphs, are at the end (skipped without CUDA; run by
scripts/device_check.py).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from specdec.accel.compiled import CompiledForward
from specdec.accel.cuda_graphs import CapturedCall, CudaGraph
from specdec.accel.passes import Accelerated
from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.models import tiny_random_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.eagle import EagleProposer
from specdec.proposers.layer_skip import LayerSkipProposer
from tests.conftest import RAGGED_PROMPTS
from tests.taped_graph import TapedGraph, taped_engine

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def _decoder(engine, method: str, k: int = 4) -> SpeculativeDecoder:
    proposer = {
        "plain": lambda: None,
        "draft": lambda: DraftModelProposer(engine),
        "layer_skip": lambda: LayerSkipProposer(engine, exit_layer=1),
        "eagle": lambda: EagleProposer(engine, str(ASSETS / "tiny_random_eagle.safetensors"), budget=10, topk=3,
                                       width=3, depth=4),
    }[method]()
    return SpeculativeDecoder(engine, proposer, num_speculative_tokens=k)


def test_the_stand_in_replays_what_was_captured_without_the_python():
    """A replay runs the capture's operators: a host value the Python read at the capture stays
    frozen (a stand-in that re-ran the call would follow it), inputs are read from the captured
    tensors, in-place writes and views land where they did, and the outputs are overwritten."""
    class Holder:
        scale = 2

    buffer = torch.zeros(4)
    x = torch.tensor([1.0, 2.0])

    def fn():
        y = x * Holder.scale  # a host value, read by the Python
        buffer[:2].copy_(y)  # an in-place write through a view
        return y + buffer.sum()

    graph = TapedGraph("cpu")
    out = graph.capture(fn)
    assert out.tolist() == [8.0, 10.0]  # x * 2 + (2 + 4)
    Holder.scale = 10
    x.copy_(torch.tensor([3.0, 4.0]))
    graph.replay()
    assert out.tolist() == [20.0, 22.0]  # x * 2 + (6 + 8): the scale of the capture, x of now
    assert buffer.tolist() == [6.0, 8.0, 0.0, 0.0]
    assert fn().tolist() == [100.0, 110.0]  # the Python itself follows the host value


@pytest.mark.parametrize("refused", ["item", "tolist", "nonzero", "bool index", "host tensor", "generator"])
def test_the_stand_in_refuses_what_a_cuda_capture_refuses(refused):
    x = torch.tensor([1.0, -2.0])
    generator = torch.Generator().manual_seed(0)
    fn = {"item": lambda: x.sum().item(), "tolist": lambda: x.tolist(), "nonzero": lambda: x.nonzero(),
          "bool index": lambda: x[x > 0], "host tensor": lambda: x + torch.tensor([1.0, 2.0]),
          "generator": lambda: torch.rand(2, generator=generator)}[refused]
    fn()  # fine outside a capture
    with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
        TapedGraph("cpu").capture(fn)
    assert x.tolist() == [1.0, -2.0]  # the methods are restored


def test_captured_call_copies_every_input_and_replays():
    """Tensors in the arguments (nested too) and the holder's tensors are copied into the graph's
    buffers; the outputs are the captured tensors, overwritten by each replay."""
    class Holder:
        y = torch.tensor([10.0])

    holder = Holder()

    def fn(x, pair):
        return x * 2 + pair["a"] + holder.y

    args = (torch.tensor([1.0]), {"a": torch.tensor([100.0])})
    call = CapturedCall(fn, args, {"y": holder.y}, holder, TapedGraph("cpu"))
    first = call(args, {"y": torch.tensor([10.0])})
    assert first.tolist() == [112.0]
    second = call((torch.tensor([3.0]), {"a": torch.tensor([200.0])}), {"y": torch.tensor([20.0])})
    assert second is first and second.tolist() == [226.0]
    with pytest.raises(RuntimeError, match="other inputs"):
        call((torch.tensor([3.0]),), {"y": torch.tensor([20.0])})


@pytest.mark.parametrize("method", ["plain", "draft", "layer_skip", "eagle"])
@pytest.mark.parametrize("batch", ["single", "ragged"])
def test_explicit_graphs_greedy_equals_eager(target, unrelated_draft, method, batch):
    """Plain decoding, a draft model (its catch-up passes and greedy chain), layer skipping (a model
    of the proposer's own) and EAGLE trees (hidden states kept, the drafter's own passes): the
    eager path's tokens, every compiled call after the first of its shape a replay, and a second
    generation captures nothing new."""
    prompts = RAGGED_PROMPTS[:1] if batch == "single" else RAGGED_PROMPTS
    draft = unrelated_draft if method == "draft" else None
    eager = _decoder(taped_engine(target, draft, "off"), method).generate(prompts, max_new_tokens=24)
    engine = taped_engine(target, draft, "on")
    decoder = _decoder(engine, method)
    before = TapedGraph.captures, TapedGraph.replays
    compiled = decoder.generate(prompts, max_new_tokens=24)
    assert compiled.output_ids == eager.output_ids
    assert [r.accepted for r in compiled.stats.rows] == [r.accepted for r in eager.stats.rows]
    report = engine.compile_report()
    captured = sum(len(c._captured) for c in _callers(engine, decoder))
    calls = sum(r["compiled_calls"] for r in report.values())
    assert TapedGraph.captures - before[0] == captured <= sum(r["shapes"] for r in report.values())
    assert TapedGraph.replays - before[1] == calls > captured
    again = decoder.generate(prompts, max_new_tokens=24)
    assert again.output_ids == eager.output_ids
    assert TapedGraph.captures - before[0] == captured


def test_explicit_graphs_run_medusas_heads_compiled_but_uncaptured(target):
    """Medusa's heads are a `CompiledCall`: no cache view to capture over, so under explicit graphs
    (the graph class is what a GPU's would be) they run compiled and uncaptured, while the target's
    tree passes are captured and replayed; the eager path's tokens either way."""
    from specdec.proposers.medusa import MedusaProposer

    def medusa(engine):
        return SpeculativeDecoder(engine, MedusaProposer(engine, str(ASSETS / "tiny_random_medusa.safetensors")),
                                  num_speculative_tokens=2)

    eager = medusa(taped_engine(target, None, "off")).generate(RAGGED_PROMPTS, max_new_tokens=16)
    engine = taped_engine(target, None, "on")
    decoder = medusa(engine)
    heads = decoder.proposer.compiled
    assert heads.graph_class is TapedGraph
    assert decoder.generate(RAGGED_PROMPTS, max_new_tokens=16).output_ids == eager.output_ids
    assert heads.compiled_calls > 0 and not heads._captured
    assert engine.target.compiled._captured


def _callers(engine, decoder):
    callers = [m.compiled for m in (engine.target, engine.draft) if m is not None]
    proposer = decoder.proposer
    if isinstance(proposer, LayerSkipProposer):
        callers.append(proposer.draft.compiled)
    if isinstance(proposer, EagleProposer):
        callers.append(proposer.compiled)
    return callers


def test_proposers_compile_as_the_target_does(target):
    """A proposer's own compiled passes (EAGLE's drafter, layer skipping's view) take the target's
    backend and CUDA-graph mode."""
    engine = taped_engine(target, None, "on")
    for proposer in (LayerSkipProposer(engine, exit_layer=1),
                     EagleProposer(engine, str(ASSETS / "tiny_random_eagle.safetensors"))):
        compiled = proposer.draft.compiled if isinstance(proposer, LayerSkipProposer) else proposer.compiled
        assert compiled.options() == engine.target.compiled.options()
        assert compiled.options()["cuda_graphs"] == "explicit"


def test_a_pool_that_grows_drops_its_graphs():
    """Graphs record the cache buffers' addresses: when a longer generation needs longer pooled
    buffers, the graphs captured on the old ones are dropped and captured again."""
    target = tiny_random_model(seed=0, eos_token_id=None, max_position_embeddings=4096)
    engine = taped_engine(target, None, "on")
    decoder = _decoder(engine, "plain")
    decoder.generate(RAGGED_PROMPTS[:1], max_new_tokens=8)
    compiled = engine.target.compiled
    old = {id(k) for k, _ in compiled._pool.values()}
    assert compiled._captured
    long_prompt = list(range(1, 200)) * 6  # past the smallest pooled length (MIN_BUFFER)
    out = decoder.generate([long_prompt], max_new_tokens=4)
    assert {id(k) for k, _ in compiled._pool.values()} != old
    eager = _decoder(taped_engine(target, None, "off"), "plain").generate([long_prompt], max_new_tokens=4)
    assert out.output_ids == eager.output_ids
    assert all(entry[3][1][0][0] in {id(k) for k, _ in compiled._pool.values()} for entry in compiled._captured)


def test_cuda_graph_modes_are_checked(target):
    with pytest.raises(ValueError, match="cuda_graphs='static' is not one of: trees, explicit"):
        Engine(target, dtype="float32", passes=Accelerated(cuda_graphs="static"))
    with pytest.raises(ValueError, match="cuda_graphs"):
        CompiledForward(Engine(target, dtype="float32").target, cuda_graphs="static")


def test_explicit_graphs_capture_nothing_on_a_cpu(target):
    """Without a stand-in, a CPU runs the compiled calls as they are."""
    engine = Engine(target, dtype="float32", passes=Accelerated(compile="on", cuda_graphs="explicit"))
    assert engine.target.compiled.graph_class is None


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["plain", "draft", "eagle"])
def test_explicit_cuda_graphs_greedy_equal_eager(target, unrelated_draft, method):
    """Real CUDA graphs over inductor's kernels: the eager path's tokens on a ragged batch."""
    draft = unrelated_draft if method == "draft" else None
    outs = []
    for compile in ("off", "on"):
        engine = Engine(target, draft, device="cuda", dtype="float32", passes=Accelerated(compile=compile, cuda_graphs="explicit"))
        outs.append(_decoder(engine, method).generate(RAGGED_PROMPTS, max_new_tokens=24))
        if compile == "on":
            assert engine.compile_report()["target"]["cuda_graph_captures"] > 0
    assert outs[1].output_ids == outs[0].output_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_pool_outlives_the_graphs_that_used_it():
    """A capture after every earlier graph was dropped while an output of theirs lives on: the state
    in which the allocator's pool has no graph left but still holds memory. Without the pool's own
    graph (`graph_pool`) the second capture fails the allocator's assertion (`use_count > 0`), as a
    second decoder's first explicit capture did on an H200."""
    device = torch.device("cuda")
    x = torch.arange(8.0, device=device)
    first = CudaGraph(device)
    kept = first.capture(lambda: x * 2)
    del first
    gc.collect()
    second = CudaGraph(device)
    out = second.capture(lambda: x + 1)
    x.fill_(1.0)
    second.replay()
    assert torch.equal(out, torch.full((8,), 2.0, device=device))
    assert torch.equal(kept, torch.arange(8.0, device=device) * 2)
