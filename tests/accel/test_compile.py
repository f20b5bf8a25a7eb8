"""compile=on: greedy outputs token-identical to the eager path (float32, tiny models, batch 1 and a
ragged batch, k in 1, 4, 8; token trees of EAGLE, Medusa and suffix decoding, whose passes also keep
the target's hidden states), a bounded number of compiled graphs when k or the tree's size changes
every step, and `compile=off` leaves the eager path alone.

The fast tests compile with dynamo's `eager` backend: the same graph capture, guards, shapes and
recompilations as `compile=on`, without generating kernels (inductor takes minutes on a busy CPU).
The inductor run itself is a slow test, and CUDA graphs a CUDA-only one.
"""

import contextlib
import json
from pathlib import Path

import pytest
import torch

from specdec.accel.compiled import (
    MIN_KV,
    CompiledForward,
    bucket,
    concatenates,
    freezes,
    narrowest_width,
    resolve_compile,
    width_bucket,
)
from specdec.accel.passes import Accelerated
from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.core.schedules import HeuristicSchedule
from specdec.models import tiny_random_model
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.eagle import EagleDrafter, EagleProposer
from specdec.proposers.heads import save_checkpoint
from specdec.proposers.layer_skip import LayerSkipProposer
from specdec.proposers.medusa import MedusaProposer
from specdec.proposers.suffix import SuffixTreeProposer
from tests.conftest import RAGGED_PROMPTS, load_script, make_engine

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def _generate(engine, k, prompts, max_new_tokens=24, schedule=None, exact_greedy=True):
    proposer = DraftModelProposer(engine) if k else None
    decoder = SpeculativeDecoder(engine, proposer, num_speculative_tokens=k or 1, schedule=schedule)
    decoder.exact_greedy = exact_greedy
    return decoder.generate(prompts, max_new_tokens=max_new_tokens)


@pytest.mark.parametrize("k", [0, 1, 4, 8])
@pytest.mark.parametrize("batch", ["single", "ragged"])
def test_compiled_greedy_equals_eager(target, unrelated_draft, k, batch):
    prompts = RAGGED_PROMPTS[:1] if batch == "single" else RAGGED_PROMPTS
    eager = _generate(make_engine(target, unrelated_draft, compile="off"), k, prompts)
    compiled_engine = make_engine(target, unrelated_draft, compile="on")
    compiled = _generate(compiled_engine, k, prompts)
    assert compiled.output_ids == eager.output_ids
    report = compiled_engine.compile_report()
    assert report["target"]["compiled_calls"] == compiled.stats.steps  # every step compiled, the prefill eager
    assert report["target"]["eager_calls"] == 1
    assert compiled.reports["compile"] == report
    if k > 1:  # the draft's greedy step ran as one compiled call: catch-up pass and k - 1 passes
        draft = report["draft"]
        # the first step: the draft's prefill (eager) and its k - 1 passes as one call; then one a step
        # that drafts (the last steps draft fewer, to each row's room: shorter chains, or none)
        assert draft["eager_calls"] == 1 and draft["compiled_calls"] == _drafting_steps(compiled)
        assert {"chain", f"catch-up and chain of {k - 1}"} <= {kind for kind, *_ in compiled_engine.draft.compiled.shapes} \
            <= {"chain", "pass", *(f"catch-up and chain of {j}" for j in range(1, k))}


def _drafting_steps(out) -> int:
    """Steps that drafted: all but the last ones where no row had room for a draft."""
    return sum(1 for n in out.stats.draft_lengths if n)


@pytest.mark.parametrize("batch", ["single", "ragged"])
def test_compiled_layer_skip_drafts_compiled_and_equals_eager(target, batch):
    """Layer skipping drafts with a view of the target's first layers, a model of its own: under
    compile=on its passes compile too (the greedy chain included) and are reported, and the tokens
    are the eager path's."""
    prompts = RAGGED_PROMPTS[:1] if batch == "single" else RAGGED_PROMPTS

    def run(compile):
        engine = make_engine(target, None, compile=compile)
        decoder = SpeculativeDecoder(engine, LayerSkipProposer(engine, exit_layer=1), num_speculative_tokens=4)
        return engine, decoder.generate(prompts, max_new_tokens=24)

    _, eager = run("off")
    engine, compiled = run("on")
    assert compiled.output_ids == eager.output_ids
    draft = engine.compile_report()["draft(layers 0..0)"]
    # the first step: the view's prefill (eager) and the chain; then a step is one call
    assert draft["compiled_calls"] == _drafting_steps(compiled)
    assert draft["eager_calls"] == 1
    assert {"chain", "catch-up and chain of 3"} <= {kind for kind, *_ in engine.compiled_modules["draft(layers 0..0)"].shapes} \
        <= {"chain", "pass", "catch-up and chain of 1", "catch-up and chain of 2", "catch-up and chain of 3"}


@pytest.mark.parametrize("k", [0, 4])
def test_passes_padded_to_the_narrowest_width_equal_eager(target, unrelated_draft, k):
    """In bfloat16 on a CPU, passes of 1-3 tokens run 4 wide (`NARROWEST`). Forced in float32: no
    token changes (plain decoding's one-token passes, the draft's catch-up and the target's
    scoring), and no pass but the draft's chained single tokens runs narrower than 4."""
    eager = _generate(make_engine(target, unrelated_draft, compile="off"), k, RAGGED_PROMPTS, exact_greedy=False)
    engine = make_engine(target, unrelated_draft, compile="on")
    assert engine.target.compiled.narrowest == 1  # float32: one token is the cheapest there
    for model in (engine.target, engine.draft):
        model.compiled.narrowest = 4
    out = _generate(engine, k, RAGGED_PROMPTS, exact_greedy=False)
    assert out.output_ids == eager.output_ids
    widths = {w for m in (engine.target, engine.draft) for kind, _, w, _ in m.compiled.shapes if kind != "chain"}
    assert min(widths) == 4


def test_narrowest_width_only_where_the_cpu_has_bfloat16_units(monkeypatch):
    """Padding one-token passes to 4 pays only with bfloat16 matrix units; where bfloat16 is
    emulated (AVX2) a 4-wide pass costs 3.4x a 1-wide one, and float32 is never padded."""
    cpu = torch.device("cpu")
    for units, expected in ((True, 4), (False, 1)):
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda units=units: units)
        assert narrowest_width(cpu, torch.bfloat16) == expected
        assert narrowest_width(cpu, torch.float32) == 1
        assert Engine(tiny_random_model(), dtype="bfloat16", passes=Accelerated(compile="on")).target.compiled.narrowest == expected


def test_frozen_freezes_on_every_device_and_reaches_every_compiled_caller(target):
    """compile=frozen: inductor's weight freezing for the engine's compiled callers and those a
    proposer adds from the target's options (layer skipping's draft), where `on` freezes on a CPU
    only; compiled through functions of their own (a frozen graph never stands in for another)."""
    from specdec.accel.compiled import _compiled, _forward, freezes
    from specdec.proposers.layer_skip import LayerSkipProposer

    assert resolve_compile("frozen", torch.device("cpu")) is True
    engine = Engine(target, dtype="float32", passes=Accelerated(compile="frozen"))
    assert engine.compile and engine.passes.freezing and not engine.passes.autotune
    proposer = LayerSkipProposer(engine, exit_layer=1)
    for caller in (engine.target.compiled, proposer.draft.compiled):
        assert caller.freezing is True and caller.options()["freezing"] is True
    on = Engine(target, dtype="float32", passes=Accelerated(compile="on"))
    assert on.passes.freezing is None and on.target.compiled.freezing == freezes(on.device, "inductor")
    assert not freezes(torch.device("cuda"), "inductor")  # `on` leaves a GPU's weights unfrozen
    assert _compiled(_forward, engine.device, "eager", freezing=True) is not _compiled(_forward, engine.device, "eager")


def test_autotune_compiles_apart_and_reaches_every_compiled_caller(target, monkeypatch):
    """compile=autotune: every compiled caller of the engine (target, draft, and those a proposer adds
    from the target's options) compiles with inductor's max_autotune, through a compiled function of
    its own (an autotuned graph and a plain one of the same shape never stand in for each other),
    and passes of one token are not padded (the padding serves oneDNN's kernels)."""
    from specdec.accel.compiled import _compiled

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert resolve_compile("autotune", torch.device("cpu")) is True
    engine = Engine(tiny_random_model(), tiny_random_model(seed=1), dtype="bfloat16", passes=Accelerated(compile="autotune"))
    assert engine.passes.autotune and engine.compile
    for caller in (engine.target.compiled, engine.draft.compiled):
        assert caller.autotune and caller.narrowest == 1 and caller.options()["autotune"]
    assert Engine(tiny_random_model(), dtype="bfloat16", passes=Accelerated(compile="on")).target.compiled.narrowest == 4
    assert not Engine(tiny_random_model(), dtype="bfloat16", passes=Accelerated(compile="off")).passes.autotune

    # While a graph compiles under autotune, inductor prints no table of timings per matrix product
    # (a screenful for every graph of a real model); the setting is the process's again afterwards.
    import torch._inductor.config as inductor_config

    from specdec.accel.compiled import QUIET_AUTOTUNE, _compiling

    def settings():  # absent from older torch: None
        return {key: getattr(inductor_config, key, None) for key in QUIET_AUTOTUNE}

    shown = settings()
    assert shown["max_autotune_report_choices_stats"] in (True, None)  # else the check below proves nothing
    with _compiling(freezing=True, autotune=True):
        assert inductor_config.freezing
        assert all(value in (QUIET_AUTOTUNE[key], None) for key, value in settings().items()), settings()
    with _compiling(freezing=False, autotune=False):
        assert settings() == shown
    assert settings() == shown and not inductor_config.freezing

    modes = []
    # inductor is given its mode as the mode's options (`_compiled`: options compare, modes do not)
    options = {repr(torch._inductor.list_mode_options(mode, dynamic=False)): mode
               for mode in ("max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead")}
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: modes.append(
        kw["mode"] if "mode" in kw else options.get(repr(kw["options"]))) or object())
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    fn = lambda x: x  # noqa: E731 (a fresh code object: nothing compiled before)
    plain, tuned = _compiled(fn, cpu, "inductor"), _compiled(fn, cpu, "inductor", autotune=True)
    assert plain is not tuned and _compiled(fn, cpu, "inductor", autotune=True) is tuned
    _compiled(fn, cuda, "inductor", "trees", True), _compiled(fn, cuda, "inductor", "explicit", True)
    _compiled(fn, cpu, "eager", autotune=True)  # the eager backend generates no kernels to tune
    assert modes == [None, "max-autotune-no-cudagraphs", "max-autotune", "max-autotune-no-cudagraphs", None]


def test_autotuned_narrow_graphs_tune_among_the_cpp_gemms_only(monkeypatch):
    """Under compile=autotune in bfloat16 on a CPU with bfloat16 units, a graph whose products take
    at most CPP_GEMM_ROWS rows (batch x width) autotunes among inductor's C++ GEMM templates alone
    (where oneDNN's kernels, chosen by autotuning, cost more inside the graph); wider graphs, other
    dtypes, CPUs and modes keep inductor's default choices."""
    import torch._inductor.config as inductor_config

    from specdec.accel import compiled
    from specdec.accel.compiled import CPP_GEMM_ROWS, _compiling, gemm_backends

    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert gemm_backends(cpu, torch.bfloat16, True, CPP_GEMM_ROWS) == "CPP"
    assert gemm_backends(cpu, torch.bfloat16, True, CPP_GEMM_ROWS + 1) is None
    assert gemm_backends(cpu, torch.bfloat16, True, None) is None  # rows unknown (a CompiledCall)
    assert gemm_backends(cpu, torch.bfloat16, False, 1) is None
    assert gemm_backends(cpu, torch.float32, True, 1) is None
    assert gemm_backends(torch.device("cuda"), torch.bfloat16, True, 1) is None
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert gemm_backends(cpu, torch.bfloat16, True, 1) is None
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)

    default = inductor_config.max_autotune_gemm_backends
    with _compiling(freezing=True, autotune=True, backends="CPP"):
        assert inductor_config.max_autotune_gemm_backends == "CPP"
    assert inductor_config.max_autotune_gemm_backends == default

    # What each pass asks for: rows = batch x the width it runs at (1-token passes are not padded
    # under autotune); the eager backend traces the same calls without generating kernels.
    asked = []
    real = compiled._compiling
    monkeypatch.setattr(compiled, "_compiling", lambda f, a, backends=None: asked.append((a, backends)) or real(f, a, backends))
    engine = Engine(tiny_random_model(), tiny_random_model(seed=1), dtype="bfloat16", passes=Accelerated(compile="autotune"))
    for model in (engine.target, engine.draft):
        model.compiled = CompiledForward(model, backend="eager", autotune=True)
    decoder = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=4)
    decoder.exact_greedy = False
    widths = []
    for model in (engine.target, engine.draft):
        run = model.compiled._run
        model.compiled._run = lambda *a, run=run, **kw: widths.append(kw.get("rows")) or run(*a, **kw)
    decoder.generate([[5, 6, 7]], max_new_tokens=6)
    assert widths and set(widths) >= {1, 6}  # the draft's one-token passes, the target's 5 tokens at width 6
    # a call that may compile asks for the rule's kernels; one whose graph is known asks for nothing
    assert len(asked) == len(widths)
    assert [b for a, b in asked] == [gemm_backends(cpu, torch.bfloat16, True, r) if a else None
                                     for r, (a, _) in zip(widths, asked)]
    tuned = {b for a, b in asked if a}
    assert tuned == {"CPP", None} and not all(a for a, _ in asked)  # both kinds of graph; known ones ran
    SpeculativeDecoder(engine).generate([[5, 6, 7], [8, 9]], max_new_tokens=3)
    assert widths[-1] == 2 and ("CPP" in {b for a, b in asked[-3:] if a})  # two rows of one token


def test_compiled_speculative_equals_compiled_plain_without_fixed_width(target):
    """Widths vary with k (exact greedy off): padding to a width bucket must not change any token."""
    engine = make_engine(target, target, compile="on")
    plain = _generate(engine, 0, RAGGED_PROMPTS, exact_greedy=False)
    spec = _generate(engine, 3, RAGGED_PROMPTS, exact_greedy=False)
    assert spec.output_ids == plain.output_ids
    assert spec.stats.per_position_acceptance == [1.0] * 3  # the draft is the target: all accepted


def test_adaptive_k_compiles_a_bounded_number_of_graphs(target):
    """40 steps whose k changes (heuristic schedule from 1 up to 8: the draft is the target, so every
    draft is accepted) and whose width follows it: the target runs at most 6 width buckets (1 to 10) x
    2 key buckets, the draft at most 2 x 2, instead of a graph a step."""
    torch._dynamo.reset()
    engine = make_engine(target, target, compile="on")
    out = _generate(engine, 8, RAGGED_PROMPTS, max_new_tokens=40, schedule=HeuristicSchedule(8, start=1),
                    exact_greedy=False)
    report = engine.compile_report()
    assert len(set(out.stats.draft_lengths)) >= 4
    assert 1 <= report["target"]["graphs"] <= report["target"]["shapes"] <= 12
    assert 1 <= report["draft"]["graphs"] <= report["draft"]["shapes"] <= 4
    again = _generate(engine, 8, RAGGED_PROMPTS, max_new_tokens=40, schedule=HeuristicSchedule(8, start=1),
                      exact_greedy=False)
    assert again.output_ids == out.output_ids
    assert engine.compile_report()["target"]["graphs"] == report["target"]["graphs"]  # all reused


def test_prompts_of_other_lengths_reuse_graphs(target):
    """Generations with prompts of other lengths share the pooled cache buffers: one graph per
    (batch, width, key bucket), never one per prompt length."""
    torch._dynamo.reset()
    engine = make_engine(target, None, compile="on")
    for n in (5, 70, 20, 40):
        _generate(engine, 0, [list(range(1, n + 1))], max_new_tokens=40)
    report = engine.compile_report()["target"]
    assert report["shapes"] == 2 and report["graphs"] == 2  # key buckets 64 and 128, width 8


def _tree_proposer(method: str, engine: Engine, tmp_path: Path):
    """The tree methods on the tiny target: the trained tiny EAGLE drafter and Medusa heads (drafts
    that are often accepted), an EAGLE drafter as initialised from the target, and suffix trees."""
    if method == "eagle":
        return EagleProposer(engine, str(ASSETS / "tiny_random_eagle.safetensors"), budget=10, topk=3, width=3, depth=4)
    if method == "eagle_init":
        path = tmp_path / "init.safetensors"
        if not path.exists():
            save_checkpoint(path, "eagle", EagleDrafter(engine.target.model).state_dict(),
                            {"hidden_size": 64, "vocab_size": 256})
        return EagleProposer(engine, str(path), budget=6, topk=2, width=2, depth=3)
    if method == "medusa":
        return MedusaProposer(engine, str(ASSETS / "tiny_random_medusa.safetensors"),
                              tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    return SuffixTreeProposer(max_spec_factor=2.0, budget=8)


def _refuse_first_known_call(monkeypatch, asked: list | None = None) -> list[int]:
    """Make the first call to a known entry (one that skips dynamo's guards) fail as dynamo fails when
    no graph fits under the skipping stance. Returns the list the refusal is recorded in: one item,
    `len(asked)` at the time (the `_compiling` calls recorded before it), once it has happened."""
    import specdec.accel.compiled as compiled_module

    real_compiled, real_unguarded = compiled_module._compiled, compiled_module._unguarded
    skipping, refused = [False], []

    @contextlib.contextmanager
    def unguarded(known):
        skipping[0] = known
        with real_unguarded(known):
            yield
        skipping[0] = False

    def compiled(*args, **kwargs):
        fn = real_compiled(*args, **kwargs)

        def call(*a):
            if skipping[0] and not refused:  # the first known call finds no graph that fits
                refused.append(len(asked or ()))
                raise RuntimeError("Recompilation triggered with skip_guard_eval_unsafe stance. This usually means ...")
            return fn(*a)
        return call

    monkeypatch.setattr(compiled_module, "_unguarded", unguarded)
    monkeypatch.setattr(compiled_module, "_compiled", compiled)
    return refused


def test_a_known_graph_that_no_longer_fits_recompiles_instead_of_failing(target, monkeypatch):
    """Known entries skip dynamo's guards (`_unguarded`). A Python value the traced code reads, which
    the host's key cannot see, may still change (a timer wrapped around a drafter's forward, say);
    dynamo then finds no graph that fits and refuses to compile under the skipping stance. That call
    must run again with its guards (dynamo recompiles), and so must that entry from then on."""
    refused = _refuse_first_known_call(monkeypatch)
    prompts = [RAGGED_PROMPTS[0], list(range(1, 71))]  # key buckets 64 and 128: two entries
    eager = [_generate(make_engine(target, None, compile="off"), 0, [p], max_new_tokens=12).output_ids for p in prompts]
    engine = make_engine(target, None, compile="on")
    assert [_generate(engine, 0, [p], max_new_tokens=12).output_ids for p in prompts] == eager
    caller = engine.target.compiled
    assert len(refused) == 1 and len(caller._guarded) == 1 and len(caller._entries) == 2
    assert caller.unguarded_calls > 0  # the other entry still skips its guards


def test_a_refused_known_call_recompiles_with_the_autotune_rule(monkeypatch):
    """The call that runs again with its guards after a refusal may compile, so under autotune it
    asks for the GEMM-kernel rule's choice (`gemm_backends`) like any call that may compile, not for
    the nothing a known call asks for."""
    from specdec.accel import compiled
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    asked = []
    real = compiled._compiling
    monkeypatch.setattr(compiled, "_compiling", lambda f, a, backends=None: asked.append((a, backends)) or real(f, a, backends))
    refused = _refuse_first_known_call(monkeypatch, asked)
    engine = Engine(tiny_random_model(), dtype="bfloat16", passes=Accelerated(compile="autotune"))
    engine.target.compiled = CompiledForward(engine.target, backend="eager", autotune=True)
    SpeculativeDecoder(engine).generate([[5, 6, 7]], max_new_tokens=6)  # one-token passes: 1 row, "CPP"
    assert len(refused) == 1
    at = refused[0]
    assert asked[at - 1] == (False, None)  # the known call: nothing may compile
    assert asked[at] == (True, "CPP")  # its retry may compile, with the rule's kernels


@pytest.mark.parametrize("method", ["eagle", "eagle_init", "medusa", "suffix_tree"])
@pytest.mark.parametrize("batch", ["single", "ragged"])
def test_compiled_tree_greedy_equals_eager(target, tmp_path, method, batch):
    """Tree passes (and, for EAGLE and Medusa, the hidden states they keep, and their drafters) run
    compiled: the same tokens, the same accepted lengths step by step (a drafter fed wrong features
    drafts other trees), the same hidden states in the cache, and no pass but the prefill eager."""
    prompts = [[2] * 9] if batch == "single" else [[2] * 9, [3, 4], [2] * 5 + [7, 8]]
    runs = {}
    for mode in ("off", "on"):
        engine = make_engine(target, None, compile=mode)
        decoder = SpeculativeDecoder(engine, _tree_proposer(method, engine, tmp_path), num_speculative_tokens=4)
        # Two requests: suffix trees draft from the first one's output too.
        outs = [decoder.generate([p + [turn + 20] for p in prompts], max_new_tokens=24) for turn in range(2)]
        runs[mode] = (outs, engine)
    (eager_outs, eager_engine), (compiled_outs, engine) = runs["off"], runs["on"]
    for eager, compiled in zip(eager_outs, compiled_outs):
        assert compiled.output_ids == eager.output_ids and compiled.lossless
        assert [r.accepted for r in compiled.stats.rows] == [r.accepted for r in eager.stats.rows]
        assert compiled.stats.steps == eager.stats.steps
    assert sum(r.accepted for out in eager_outs for r in out.stats.rows) > 0
    report = engine.compile_report()["target"]
    assert report["compiled_calls"] == sum(out.stats.steps for out in compiled_outs)  # every step's tree
    assert report["eager_calls"] == len(compiled_outs)  # the prefills
    if method.startswith("eagle"):  # the drafter's passes compile too: all but its first of a generation
        drafter = engine.compile_report()["eagle drafter"]
        assert drafter["eager_calls"] == len(compiled_outs)
        assert drafter["compiled_calls"] >= sum(_drafting_steps(out) for out in compiled_outs) - len(compiled_outs)
        assert drafter["graphs"] <= drafter["shapes"] <= 4  # widths 1-8 at one key bucket: no graph per step
    if method == "medusa":  # the heads' guesses compile too: every step's, one shape, one graph
        heads = engine.compile_report()["medusa heads"]
        assert heads["compiled_calls"] == sum(_drafting_steps(out) for out in compiled_outs) and heads["eager_calls"] == 0
        assert heads["graphs"] == heads["shapes"] <= 4  # one per tree depth: the last steps cut it to the room
    if method != "suffix_tree":
        for b, n in enumerate(engine.target.lengths):
            assert n == eager_engine.target.lengths[b]
            torch.testing.assert_close(engine.target.cache.hidden[b, :n], eager_engine.target.cache.hidden[b, :n],
                                       rtol=1e-5, atol=1e-5)


def test_tree_passes_of_every_size_share_the_width_buckets(target):
    """Suffix trees change size from step to step (1 to 8 nodes): a tree pass runs at its size's
    width bucket, so the target compiles at most one graph per bucket up to the budget's (9 -> 10)
    and key bucket, never one per tree size, and a second identical generation compiles nothing."""
    torch._dynamo.reset()
    engine = make_engine(target, None, compile="on")
    sizes = []

    class Recording(SuffixTreeProposer):
        def propose(self, state, k):
            proposal = super().propose(state, k)
            sizes.append(proposal.tokens.shape[1])
            return proposal

    decoder = SpeculativeDecoder(engine, Recording(max_spec_factor=2.0, budget=8), num_speculative_tokens=6)
    prompts = [p + [20] for p in RAGGED_PROMPTS]
    first = decoder.generate(prompts, max_new_tokens=30)
    second = decoder.generate(prompts, max_new_tokens=30)  # drafts from the first's outputs: other trees
    report = engine.compile_report()["target"]
    assert len(set(sizes) - {0}) >= 3  # trees of several sizes were scored
    widths = {w for _, _, w, _ in engine.target.compiled.shapes}
    assert widths == {width_bucket(n + 1) for n in sizes}  # n drafted nodes and the root (1: no tree)
    assert len(widths) >= 3 and widths <= {1, 2, 4, 6, 8, 10}
    key_buckets = {kv for _, _, _, kv in engine.target.compiled.shapes}
    assert key_buckets == {MIN_KV} and report["graphs"] == len(widths)
    third = decoder.generate(prompts, max_new_tokens=30)
    assert engine.compile_report()["target"]["graphs"] == report["graphs"]
    assert third.output_ids == second.output_ids == first.output_ids


def test_known_calls_skip_the_guards(target, monkeypatch):
    """A call whose inputs match one this caller has run (same model, shapes, key bucket, buffers)
    skips dynamo's full guard evaluation; any new entry (the first call of a shape, a longer cache)
    evaluates every guard; with SKIP_KNOWN_GUARDS off, every call does."""
    import specdec.accel.compiled as compiled

    torch._dynamo.reset()
    engine = make_engine(target, None, compile="on")
    first = _generate(engine, 0, [[5, 6, 7]], max_new_tokens=40)  # key buckets 64 only
    report = engine.compile_report()["target"]
    assert report["compiled_calls"] - report["unguarded_calls"] == report["shapes"] == 1
    again = _generate(engine, 0, [[5, 6, 7]], max_new_tokens=40)
    assert again.output_ids == first.output_ids
    after = engine.compile_report()["target"]
    assert after["unguarded_calls"] - report["unguarded_calls"] == again.stats.steps  # every step known
    longer = _generate(engine, 0, [[5, 6, 7]], max_new_tokens=80)  # reaches the 128-key bucket: a new entry
    assert longer.output_ids[0][:40] == first.output_ids[0]
    final = engine.compile_report()["target"]
    assert final["compiled_calls"] - final["unguarded_calls"] == 2 and final["shapes"] == 2
    monkeypatch.setattr(compiled, "SKIP_KNOWN_GUARDS", False)
    _generate(engine, 0, [[5, 6, 7]], max_new_tokens=40)
    assert engine.compile_report()["target"]["unguarded_calls"] == final["unguarded_calls"]


def test_compiled_falcon_equals_generate():
    """Falcon's attention picks SDPA by the implementation's name and runs its own attention code
    otherwise: under specdec's grouped-SDPA swap it took that branch and added SDPA's boolean masks
    to its scores as numbers (no causal masking) in every pass whose mask it builds itself, the eager
    prefill of a compiled generation among them, so compile=on gave other tokens. It keeps plain SDPA."""
    import transformers as tf

    config = tf.FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                             max_position_embeddings=256, initializer_range=0.1, bos_token_id=None,
                             eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().requires_grad_(False)
    model.get_output_embeddings().weight.normal_(0.0, 3.0 / 64**0.5)
    engine = make_engine(model, None, compile="on")
    steps = 0
    for prompt in ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [3, 4], [20, 21, 22, 23, 24, 25, 26]):
        ids = torch.tensor([prompt])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                                  min_new_tokens=12, pad_token_id=0)[0, len(prompt):].tolist()
        out = _generate(engine, 0, [prompt], max_new_tokens=12)
        assert out.output_ids == [expected], prompt
        steps += out.stats.steps
    assert engine.compile_report()["target"]["compiled_calls"] == steps


def test_compiled_gemma3n_runs_its_passes_compiled_past_its_shared_cache_layers():
    """Gemma-3n's last layers read the keys and values of an earlier layer and never write their own
    cache layer, whose buffers so stay unallocated: every pass ran eagerly while the compiled path
    waited for all of them. After the prefill such a layer is one the model never writes; the passes
    after it run compiled, ragged too, with transformers' greedy tokens."""
    import transformers as tf

    config = tf.Gemma3nTextConfig(
        vocab_size=128, vocab_size_per_layer_input=128, hidden_size=64, hidden_size_per_layer_input=8,
        intermediate_size=128, num_hidden_layers=4, num_kv_shared_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, max_position_embeddings=256, laurel_rank=4,
        layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.0] * 4,
        pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().requires_grad_(False)
    assert [layer.self_attn.is_kv_shared_layer for layer in model.model.layers] == [False, False, True, True]
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [3, 4], [20, 21, 22, 23, 24, 25, 26]]
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        expected.append(model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                                       min_new_tokens=12, pad_token_id=0)[0, len(prompt):].tolist())
    engine = make_engine(model, None, compile="on")
    out = _generate(engine, 0, prompts, max_new_tokens=12)
    assert out.output_ids == expected
    report = engine.compile_report()["target"]
    assert report["compiled_calls"] == out.stats.steps and report["eager_calls"] == 1  # the prefill


def test_compiled_pass_shows_the_models_its_cache_buffers():
    """A model may read a cache layer's buffers: Mllama's text model asks each layer whether it holds
    cached cross-attention states (`keys.numel() > 0`) before running it. The compiled pass's view of
    the cache hands it the row cache's buffers (it had none: an AttributeError on `None.numel`)."""
    import transformers as tf

    config = tf.MllamaTextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[8],
                                 max_position_embeddings=256, pad_token_id=0)
    torch.manual_seed(0)
    model = tf.MllamaForCausalLM(config).eval().requires_grad_(False)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    ids = torch.tensor([prompt])
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                              min_new_tokens=8, pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    engine = make_engine(model, None, compile="on")
    out = _generate(engine, 0, [prompt], max_new_tokens=8)
    assert out.output_ids == [expected]
    assert engine.compile_report()["target"]["compiled_calls"] == out.stats.steps


def test_compile_off_is_the_eager_path(target):
    engine = Engine(target, dtype="float32")
    assert not engine.compile and engine.target.compiled is None and engine.compile_report() is None


def test_resolve_compile():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_compile("auto", cpu) is False and resolve_compile("auto", cuda) is True
    assert resolve_compile("on", cpu) and not resolve_compile("off", cuda)
    with pytest.raises(ValueError, match="compile='yes' is not one of: off, on, autotune, frozen, auto"):
        resolve_compile("yes", cpu)


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert bucket(10, least=64) == 64 and bucket(65, least=64) == 128
    assert [width_bucket(t) for t in range(1, 18)] == [1, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 16, 16, 16, 16, 17]
    assert [width_bucket(t, least=4) for t in (1, 2, 3, 5)] == [4, 4, 4, 6]


@pytest.mark.slow
def test_inductor_autotuned_greedy_equals_eager(target, unrelated_draft):
    """compile=autotune's kernels (inductor's autotuned GEMMs), ragged batch, k = 4, float32."""
    eager = _generate(make_engine(target, unrelated_draft, compile="off"), 4, RAGGED_PROMPTS, max_new_tokens=12)
    engine = Engine(target, unrelated_draft, dtype="float32", passes=Accelerated(compile="autotune"))
    tuned = _generate(engine, 4, RAGGED_PROMPTS, max_new_tokens=12)
    assert tuned.output_ids == eager.output_ids
    assert engine.compile_report()["target"]["graphs"] > 0


@pytest.mark.slow
def test_inductor_greedy_equals_eager(target, unrelated_draft):
    """What compile=on runs on a CPU: inductor's kernels, ragged batch, k = 4."""
    eager = _generate(make_engine(target, unrelated_draft, compile="off"), 4, RAGGED_PROMPTS)
    compiled = _generate(make_engine(target, unrelated_draft, compile="on", backend="inductor"), 4, RAGGED_PROMPTS)
    assert compiled.output_ids == eager.output_ids


@pytest.mark.slow
def test_inductor_cpp_wrapper_greedy_equals_eager(target):
    """`cpp_wrapper=True` (engine.compile_options.cpp_wrapper): the graphs call their kernels from C++,
    plain decoding and k = 4 of a draft over the target itself, ragged batch, float32."""
    engine = Engine(target, target, dtype="float32", passes=Accelerated(compile="on", cpp_wrapper=True))
    assert engine.target.compiled.cpp_wrapper
    for k in (0, 4):
        eager = _generate(make_engine(target, "self", compile="off"), k, RAGGED_PROMPTS, max_new_tokens=12)
        wrapped = _generate(engine, k, RAGGED_PROMPTS, max_new_tokens=12)
        assert wrapped.output_ids == eager.output_ids, f"k={k}"
    assert engine.compile_report()["target"]["graphs"] > 0


@pytest.mark.slow
def test_inductor_freezing_keeps_each_models_weights(target):
    """On a CPU the weights are frozen into the graph: a second model of the same shape with other
    weights must get graphs of its own (dynamo guards on the weights' identity), not the first
    model's constants."""
    assert freezes(torch.device("cpu"), "inductor") and not freezes(torch.device("cpu"), "eager")
    other = tiny_random_model(seed=5, eos_token_id=None)
    assert [p.shape for p in other.parameters()] == [p.shape for p in target.parameters()]
    outputs, engines = {}, {}
    for name, model in (("target", target), ("other", other)):
        outputs[name] = _generate(make_engine(model, None, compile="off"), 0, RAGGED_PROMPTS).output_ids
        engines[name] = make_engine(model, None, compile="on", backend="inductor")
    assert outputs["target"] != outputs["other"]  # else the checks below could not tell the models apart
    # Alternating, so that the second rounds skip the guards that do not tell the graphs apart
    # (`SKIP_KNOWN_GUARDS`): the weights' identity does, and must still pick each model's graphs.
    for name in ("target", "other", "target", "other"):
        assert _generate(engines[name], 0, RAGGED_PROMPTS).output_ids == outputs[name], name
    for engine in engines.values():
        report = engine.compile_report()["target"]
        assert 0 < report["unguarded_calls"] and report["graphs"] <= report["shapes"]


def test_concatenated_linear_layers_are_the_default_for_bfloat16_with_its_units(monkeypatch):
    """`concatenates`: a CPU's frozen graphs concatenate q/k/v and gate/up in bfloat16 where the CPU
    has bfloat16 units (measured to pay there), nowhere else unless asked."""
    cpu, cuda, bf16, f32 = torch.device("cpu"), torch.device("cuda"), torch.bfloat16, torch.float32
    for units in (True, False):
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda units=units: units)
        assert concatenates(cpu, bf16, freezing=True) is (units and torch.backends.mkldnn.is_available())
        assert not concatenates(cpu, f32, freezing=True)
        assert not concatenates(cpu, bf16, freezing=False)
        assert not concatenates(cuda, bf16, freezing=True)  # inductor concatenates under CUDA freezing itself
        engine = Engine(tiny_random_model(seed=1, eos_token_id=None), dtype="bfloat16", passes=Accelerated(compile="on"))
        assert engine.target.compiled.concat_linear is concatenates(cpu, bf16, freezing=True)
        assert engine.target.compiled.options()["concat_linear"] is engine.target.compiled.concat_linear
        assert CompiledForward(engine.target, concat_linear=False).concat_linear is False  # asked: kept


@pytest.mark.slow
def test_inductor_frozen_concatenated_linear_layers_equal_eager(unrelated_draft):
    """What freezing does on CUDA (the benchmark's `frozen` stage), run on a CPU: inductor concatenates
    the linear layers that read one input (q/k/v, gate/up; on a CPU only with
    `cpp.enable_concat_linear`), and greedy tokens stay the eager path's in float32, k = 0 and 4.
    Then a caller that does not freeze, over the same model, compiles graphs of its own: freezing is
    read only while compiling and dynamo's guards do not see it, so a frozen graph must not stand in
    for an unfrozen one (or the benchmark would compare a graph with itself)."""
    import torch._inductor.config as inductor_config

    model = tiny_random_model(seed=7, eos_token_id=None)  # weights no other test compiled graphs for
    for k in (0, 4):
        eager = _generate(make_engine(model, unrelated_draft, compile="off"), k, RAGGED_PROMPTS)
        for freezing in (True, False):
            with inductor_config.patch({"cpp.enable_concat_linear": True}):
                engine = Engine(model, unrelated_draft, dtype="float32", passes=Accelerated(compile="on"))
                for m in (engine.target, engine.draft):
                    m.compiled = CompiledForward(m, backend="inductor", freezing=freezing)
                compiled = _generate(engine, k, RAGGED_PROMPTS)
            assert compiled.output_ids == eager.output_ids, f"k={k}, freezing={freezing}"
            assert engine.compile_report()["target"]["graphs"] >= 1, f"freezing={freezing} ran another's graphs"


@pytest.mark.slow
def test_inductor_tree_greedy_equals_eager(target, tmp_path):
    """What compile=on runs on a CPU for token trees that keep hidden states: inductor's kernels,
    the EAGLE drafter, ragged batch."""
    prompts = [[2] * 9, [3, 4], [2] * 5 + [7, 8]]
    outs = []
    for mode, backend in (("off", "eager"), ("on", "inductor")):
        engine = make_engine(target, None, compile=mode, backend=backend)
        decoder = SpeculativeDecoder(engine, _tree_proposer("eagle", engine, tmp_path), num_speculative_tokens=4)
        outs.append(decoder.generate(prompts, max_new_tokens=24))
    assert outs[1].output_ids == outs[0].output_ids
    assert [r.accepted for r in outs[1].stats.rows] == [r.accepted for r in outs[0].stats.rows]


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [1, 4, 8])
def test_cuda_graphs_greedy_equals_eager(target, unrelated_draft, k):
    """compile=on on CUDA (inductor with CUDA graphs), batch 1 and ragged, against eager on CUDA."""
    import copy

    t, d = copy.deepcopy(target), copy.deepcopy(unrelated_draft)
    for prompts in (RAGGED_PROMPTS[:1], RAGGED_PROMPTS):
        eager = _generate(make_engine(t, d, compile="off", device="cuda"), k, prompts)
        compiled = _generate(make_engine(t, d, compile="on", backend="inductor", device="cuda"), k, prompts)
        assert compiled.output_ids == eager.output_ids


def _study_script():
    """experiments/gpu/cpu_compile.py as a module (experiments are not a package)."""
    return load_script("cpu_compile", "experiments/gpu")


def test_cpu_compile_study_runs_every_method_in_both_modes(tmp_path):
    """experiments/gpu/cpu_compile.py on the tiny target (dynamo's eager backend, the tiny EAGLE
    drafter): every (method, compile) pair is timed on every prompt, twice, in a rotating order, each method
    gets a speedup over plain decoding per mode and a compiled/eager ratio, and the warm-up compiled
    every graph the timed runs needed. No timing is asserted."""
    script = _study_script()
    out = tmp_path / "r.json"
    result = script.main(["--model", "tiny_random", "--heads-path", str(ASSETS / "tiny_random_eagle.safetensors"),
                          "--medusa-path", str(ASSETS / "tiny_random_medusa.safetensors"), "--exit-layer", "1",
                          "--backend", "eager", "--dtype", "float32", "--prompts", "2", "--max-new-tokens", "6",
                          "--repeats", "2", "--out", str(out)])
    pairs = {f"{m}/{mode}" for m in script.METHODS for mode in ("off", "on")}
    assert [[set(order) for order in r["order"]] for r in result["rows"]] == [[pairs, pairs], [pairs, pairs]]
    firsts = [order[0] for r in result["rows"] for order in r["order"]]
    assert firsts[0] != firsts[1] and firsts[0] != firsts[2]  # rotated from repeat to repeat and prompt to prompt
    summary = result["summary"]
    for method in script.METHODS[1:]:
        assert {"speedup_off_cpu", "speedup_on_cpu", "speedup_off_wall", "speedup_on_wall"} <= set(summary[method])
    assert "speedup_on_cpu" not in summary["autoregressive"]
    # a step's CPU time over a plain step's (6 tokens a call): for two prompts the median is the mean
    ratios = [(6 / r["ngram/on"]["cpu"] / r["ngram/on"]["steps"])
              / (6 / r["autoregressive/on"]["cpu"] / r["autoregressive/on"]["steps"]) for r in result["rows"]]
    assert summary["ngram"]["step_cost_on"]["median"] == pytest.approx(sum(ratios) / 2)
    assert all(summary[m]["on_over_off_cpu"]["median"] > 0 for m in summary)
    # float32: compiled and eager decode the same tokens
    assert all(summary[m]["same_tokens_on_off"] == 2 for m in summary)
    assert result["graphs_compiled_while_timed"] == dict.fromkeys(script.METHODS, 0)
    assert result["compile_report"]["eagle"]["target"]["compiled_calls"] > 0
    assert result["compile_report"]["medusa"]["target"]["compiled_calls"] > 0
    assert result["compile_report"]["medusa"]["medusa heads"]["compiled_calls"] > 0
    assert result["compile_report"]["layer_skip"]["draft(layers 0..0)"]["compiled_calls"] > 0
    assert json.loads(out.read_text())["summary"]["eagle"]["keeps_speedup_on"].keys() == {"wall", "cpu", "decode"}
    assert all(cell["decode"] > 0 for r in result["rows"] for key, cell in r.items() if "/" in key)


def test_cpu_compile_study_takes_spec_bench_categories_in_turn():
    """--source spec_bench: the first prompts cover Spec-Bench's six categories (MT-bench's eight as one)."""
    from specdec.study.data import load_prompts

    script = _study_script()
    mapping = script.spec_bench_categories()
    prompts = script.round_robin(load_prompts("spec_bench", limit=2), mapping)
    firsts = [mapping.get(p.category, p.category) for p in prompts[:6]]
    assert sorted(firsts) == sorted(["multi_turn", "translation", "summarization", "qa", "math_reasoning", "rag"])
    assert [mapping.get(p.category, p.category) for p in prompts[6:12]] == firsts


def test_cpu_compile_study_measures_autotune_beside_on(tmp_path):
    """--modes off,on,autotune: three decoders per method, each compiled mode timed against off in
    the same rotation, its own compile report and graphs counted apart."""
    script = _study_script()
    result = script.main(["--model", "tiny_random", "--methods", "autoregressive,ngram", "--backend", "eager",
                          "--dtype", "float32", "--prompts", "2", "--max-new-tokens", "4",
                          "--modes", "off,on,autotune"])
    assert {k for k in result["rows"][0] if "/" in k} == {f"{m}/{mode}" for m in ("autoregressive", "ngram")
                                                         for mode in ("off", "on", "autotune")}
    summary = result["summary"]
    assert summary["ngram"]["autotune_over_off_cpu"]["median"] > 0 and summary["ngram"]["same_tokens_autotune_off"] == 2
    assert summary["ngram"]["keeps_speedup_autotune"].keys() == {"wall", "cpu", "decode"}
    assert result["compile_report"]["ngram/autotune"]["target"]["compiled_calls"] > 0
    assert result["graphs_compiled_while_timed"] == {"autoregressive": 0, "ngram": 0, "autoregressive/autotune": 0,
                                                     "ngram/autotune": 0}
    for bad in ("on,off", "off", "off,fast", "off,on,on"):
        with pytest.raises(SystemExit):
            script.parse_args(["--modes", bad])


def test_cpu_compile_study_gives_the_speculative_methods_the_schedule_asked_for():
    from specdec.models import tiny_random_tokenizer

    script = _study_script()
    args = script.parse_args(["--model", "tiny_random", "--methods", "autoregressive,ngram", "--backend", "eager",
                              "--dtype", "float32", "--schedule", "cost_aware"])
    decoders = script.build_decoders(tiny_random_model(), tiny_random_tokenizer(256), args)
    assert {mode: decoders["ngram", mode].schedule.name for mode in ("off", "on")} == {"off": "cost_aware",
                                                                                        "on": "cost_aware"}
    assert decoders["autoregressive", "on"].schedule.name == "constant"  # plain decoding: no k to choose


def test_cpu_compile_study_needs_its_baseline():
    """Every method's speedup is over plain decoding in the same mode: a run without it is refused."""
    script = _study_script()
    with pytest.raises(SystemExit):
        script.parse_args(["--methods", "ngram,eagle"])


def test_cuda_graph_captures_are_counted_once_installed():
    """The counter behind the report's `cuda_graph_captures` (a GPU's CUDA-graph trees capture through
    `torch.cuda.CUDAGraph.capture_begin`): installed once, it counts each call and then runs the
    class's own method (which, without CUDA, fails as it would have)."""
    import specdec.accel.compiled as compiled

    compiled.count_cuda_graph_captures()
    wrapper = torch.cuda.CUDAGraph.capture_begin
    compiled.count_cuda_graph_captures()  # a second install changes nothing
    assert torch.cuda.CUDAGraph.capture_begin is wrapper and wrapper.specdec_counts
    before = compiled._GRAPH_CAPTURES[0]
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, TypeError, AttributeError)):
            wrapper(object())
        assert compiled._GRAPH_CAPTURES[0] == before + 1
    report = CompiledForward(Engine(tiny_random_model(seed=0), dtype="float32").target).report()
    # A report counts from its own start, not the process's (the failed capture above counted there).
    assert report["cuda_graph_captures"] == report["cuda_graph_skips"] == 0
