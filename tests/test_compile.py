"""compile=on: greedy outputs token-identical to the eager path (float32, tiny models, batch 1 and a
ragged batch, k in 1, 4, 8), a bounded number of compiled graphs when k changes every step, and
`compile=off` leaves the eager path alone.

The fast tests compile with dynamo's `eager` backend: the same graph capture, guards, shapes and
recompilations as `compile=on`, without generating kernels (inductor takes minutes on a busy CPU).
The inductor run itself is a slow test, and CUDA graphs a CUDA-only one.
"""

import pytest
import torch

from specdec.compiled import CompiledForward, bucket, resolve_compile
from specdec.decoding import SpeculativeDecoder
from specdec.engine import Engine
from specdec.proposers.draft_model import DraftModelProposer
from specdec.schedules import HeuristicSchedule
from tests.conftest import RAGGED_PROMPTS


def _engine(target, draft, compile: str, backend: str = "eager", device: str = "cpu") -> Engine:
    engine = Engine(target, draft, device=device, dtype="float32", compile=compile)
    if engine.compile:
        for model in (engine.target, engine.draft):
            if model is not None:
                model.compiled = CompiledForward(model, backend=backend)
    return engine


def _generate(engine, k, prompts, max_new_tokens=24, schedule=None, exact_greedy=True):
    proposer = DraftModelProposer(engine) if k else None
    decoder = SpeculativeDecoder(engine, proposer, num_speculative_tokens=k or 1, schedule=schedule)
    decoder.exact_greedy = exact_greedy
    return decoder.generate(prompts, max_new_tokens=max_new_tokens)


@pytest.mark.parametrize("k", [0, 1, 4, 8])
@pytest.mark.parametrize("batch", ["single", "ragged"])
def test_compiled_greedy_equals_eager(target, unrelated_draft, k, batch):
    prompts = RAGGED_PROMPTS[:1] if batch == "single" else RAGGED_PROMPTS
    eager = _generate(_engine(target, unrelated_draft, "off"), k, prompts)
    compiled_engine = _engine(target, unrelated_draft, "on")
    compiled = _generate(compiled_engine, k, prompts)
    assert compiled.output_ids == eager.output_ids
    report = compiled_engine.compile_report()
    assert report["target"]["compiled_calls"] == compiled.stats.steps  # every step compiled, the prefill eager
    assert report["target"]["eager_calls"] == 1
    assert compiled.reports["compile"] == report


def test_compiled_speculative_equals_compiled_plain_without_fixed_width(target):
    """Widths vary with k (exact greedy off): padding to a width bucket must not change any token."""
    engine = _engine(target, target, "on")
    plain = _generate(engine, 0, RAGGED_PROMPTS, exact_greedy=False)
    spec = _generate(engine, 3, RAGGED_PROMPTS, exact_greedy=False)
    assert spec.output_ids == plain.output_ids
    assert spec.stats.per_position_acceptance == [1.0] * 3  # the draft is the target: all accepted


def test_adaptive_k_compiles_a_bounded_number_of_graphs(target):
    """40 steps whose k changes (heuristic schedule from 1 up to 8: the draft is the target, so every
    draft is accepted) and whose width follows it: the target runs at most 4 width buckets x 2 key
    buckets, the draft at most 2 x 2, instead of a graph a step."""
    torch._dynamo.reset()
    engine = _engine(target, target, "on")
    out = _generate(engine, 8, RAGGED_PROMPTS, max_new_tokens=40, schedule=HeuristicSchedule(8, start=1),
                    exact_greedy=False)
    report = engine.compile_report()
    assert len(set(out.stats.draft_lengths)) >= 4
    assert 1 <= report["target"]["graphs"] <= report["target"]["shapes"] <= 8
    assert 1 <= report["draft"]["graphs"] <= report["draft"]["shapes"] <= 4
    again = _generate(engine, 8, RAGGED_PROMPTS, max_new_tokens=40, schedule=HeuristicSchedule(8, start=1),
                      exact_greedy=False)
    assert again.output_ids == out.output_ids
    assert engine.compile_report()["target"]["graphs"] == report["target"]["graphs"]  # all reused


def test_prompts_of_other_lengths_reuse_graphs(target):
    """Generations with prompts of other lengths share the pooled cache buffers: one graph per
    (batch, width, key bucket), never one per prompt length."""
    torch._dynamo.reset()
    engine = _engine(target, None, "on")
    for n in (5, 70, 20, 40):
        _generate(engine, 0, [list(range(1, n + 1))], max_new_tokens=40)
    report = engine.compile_report()["target"]
    assert report["shapes"] == 2 and report["graphs"] == 2  # key buckets 64 and 128, width 8


def test_compile_off_is_the_eager_path(target):
    engine = Engine(target, dtype="float32")
    assert not engine.compile and engine.target.compiled is None and engine.compile_report() is None


def test_resolve_compile():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_compile("auto", cpu) is False and resolve_compile("auto", cuda) is True
    assert resolve_compile("on", cpu) and not resolve_compile("off", cuda)
    with pytest.raises(ValueError, match="compile='yes' is not one of: off, on, auto"):
        resolve_compile("yes", cpu)


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert bucket(10, least=64) == 64 and bucket(65, least=64) == 128


@pytest.mark.slow
def test_inductor_greedy_equals_eager(target, unrelated_draft):
    """What compile=on runs on a CPU: inductor's kernels, ragged batch, k = 4."""
    eager = _generate(_engine(target, unrelated_draft, "off"), 4, RAGGED_PROMPTS)
    compiled = _generate(_engine(target, unrelated_draft, "on", backend="inductor"), 4, RAGGED_PROMPTS)
    assert compiled.output_ids == eager.output_ids


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [1, 4, 8])
def test_cuda_graphs_greedy_equals_eager(target, unrelated_draft, k):
    """compile=on on CUDA (inductor with CUDA graphs), batch 1 and ragged, against eager on CUDA."""
    import copy

    t, d = copy.deepcopy(target), copy.deepcopy(unrelated_draft)
    for prompts in (RAGGED_PROMPTS[:1], RAGGED_PROMPTS):
        eager = _generate(_engine(t, d, "off", device="cuda"), k, prompts)
        compiled = _generate(_engine(t, d, "on", backend="inductor", device="cuda"), k, prompts)
        assert compiled.output_ids == eager.output_ids
