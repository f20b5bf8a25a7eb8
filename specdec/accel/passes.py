"""`Accelerated`: the passes object an `Engine` takes to run its models fast.

The core engine runs every pass eagerly; this is what it is handed (`Engine(..., passes=Accelerated())`)
to run the same passes compiled at static shapes (`specdec.accel.compiled`), with CUDA graphs
(`specdec.accel.cuda_graphs`), with linear layers packed for oneDNN (`specdec.accel.packed_linear`), and
a draft model's steps pipelined (`specdec.accel.pipeline`). It implements the core's `Passes`
protocol (`specdec.core.types`), so the core never imports from here.

compile:       `off`, `on` (passes of up to 16 tokens through `torch.compile` at bucketed static shapes),
               `autotune` (on, with inductor's GEMM autotuning), `frozen` (on, weights frozen into
               the graphs on CUDA too) or `auto` (on for CUDA, off on a CPU). Why `auto` keeps a CPU
               eager: experiments/gpu/LOG.md, "Runs 11-14".
cuda_graphs:   under compile on CUDA: `trees` (inductor's CUDA graphs), `explicit` (captured per call
               shape by specdec) or `static`.
cpp_wrapper:   under compile, each graph calls its kernels from C++ (inductor's `cpp_wrapper`).
packed_linear: `auto` (on where passes run eagerly on a CPU in float32, or bfloat16 with bfloat16
               units), `on` or `off`.
"""

from __future__ import annotations

import contextlib

import torch

from specdec.accel.compiled import (
    COMPILE_MODES,
    CompiledCall,
    CompiledForward,
    CompiledModule,
    autotunes,
    frozen_weights,
    resolve_compile,
)
from specdec.accel.cuda_graphs import check_cuda_graphs
from specdec.accel.overlap import OverlappedSteps
from specdec.accel.packed_linear import PACKED_LINEAR_MODES, PackedLinears, resolve_packed_linear
from specdec.accel.pipeline import PipelinedSteps, pipeline_blocked

__all__ = ["Accelerated"]


class Accelerated:
    """The `Passes` of an engine that compiles, captures CUDA graphs and packs linear layers as asked.
    Values are checked here, before any model moves; what they resolve to on the engine's device
    and dtype is settled by `attach` (one engine per object)."""

    def __init__(self, compile: str | bool = "off", cuda_graphs: str = "trees", packed_linear: str | bool = "auto",
                 cpp_wrapper: bool = False):
        if compile not in (*COMPILE_MODES, True, False):
            raise ValueError(f"compile={compile!r} is not one of: {', '.join(COMPILE_MODES)}")
        if packed_linear not in (*PACKED_LINEAR_MODES, True, False):
            raise ValueError(f"packed_linear={packed_linear!r} is not one of: {', '.join(PACKED_LINEAR_MODES)}")
        check_cuda_graphs(cuda_graphs)
        self.mode, self.cuda_graphs, self.packed_mode, self.cpp_wrapper = compile, cuda_graphs, packed_linear, cpp_wrapper
        self.engine = None
        self.compile = self.autotune = self.packed_linear = False
        self.freezing = frozen_weights(compile)

    def settle(self, device: torch.device, dtype: torch.dtype) -> None:
        """What the modes come to on `device` in `dtype`; raises (before any model moves) where one
        cannot apply there (`packed_linear=on` in bfloat16, say)."""
        if self.engine is not None:
            raise ValueError("an Accelerated passes object serves one Engine; make one per Engine")
        self.compile = resolve_compile(self.mode, device)
        self.autotune = self.compile and autotunes(self.mode)
        self.packed_linear = resolve_packed_linear(self.packed_mode, device, dtype, self.compile)

    def attach(self, engine) -> None:
        """Give `engine`'s target and draft compiled passes where compile is on."""
        self.engine = engine
        if self.compile:
            for m in (engine.target, engine.draft):
                if m is not None:
                    m.compiled = CompiledForward(m, cuda_graphs=self.cuda_graphs, autotune=self.autotune,
                                                 freezing=self.freezing, cpp_wrapper=self.cpp_wrapper)

    def compiled(self, what, kind: str, like):
        """`what` compiled with the options of `like`'s compiled passes (a `CachedModel` whose passes
        compile): kind `model` (a CachedModel), `module` (a drafter over its own RowCache, called
        `module(*inputs, positions, mask, cache)`), `call` (a cache-free module, compiled whole)."""
        options = like.compiled.options()
        if kind == "model":
            return CompiledForward(what, **options)
        if kind == "module":
            return CompiledModule(what, like.model, **options)
        if kind == "call":
            return CompiledCall(what, like.model, **options)
        raise ValueError(f"kind={kind!r} is not one of: model, module, call")

    def hold(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """What a generation holds on `model` for its whole run: its linear layers packed, where on."""
        return PackedLinears(model) if self.packed_linear else contextlib.nullcontext()

    def runner_blocked(self, decoder, sampling, verifier) -> str | None:
        """Why `decoder`'s steps cannot run ahead of their reads at `sampling` with `verifier` (None:
        they can). Plain decoding always can (`OverlappedSteps`); speculative steps where
        `specdec.accel.pipeline.pipeline_blocked` allows (`PipelinedSteps`)."""
        return pipeline_blocked(decoder, sampling, verifier) if decoder.speculative else None

    def step_runner(self, decoder, state, verifier, stats, start: float, on_tokens, draft_t, verify_t):
        """The step runner of one generation: `OverlappedSteps` for plain decoding, `PipelinedSteps`
        for a draft model's; each commits through the decoder's public commit and the serial loop
        finishes what it leaves."""
        runner = PipelinedSteps if decoder.speculative else OverlappedSteps
        return runner(decoder, state, verifier, stats, start, on_tokens, draft_t, verify_t)

    def describe(self) -> dict:
        """What the modes resolved to, for a run's records."""
        compile = ("autotune" if self.autotune else "frozen" if self.freezing else "on") if self.compile else "off"
        return {"compile": compile, "packed_linear": "on" if self.packed_linear else "off"}
