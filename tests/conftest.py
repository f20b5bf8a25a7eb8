"""Shared fixtures: tiny random Llama models built in-process (no download), and the one way the
tests build an `Engine` on them (`make_engine`, `engine_factory`)."""

import functools
import importlib.util
from pathlib import Path

import pytest
import torch

from specdec.accel.compiled import CompiledForward
from specdec.accel.passes import Accelerated
from specdec.core.engine import Engine
from specdec.models import tiny_random_model

# Tiny models gain nothing from a second thread, and OpenMP threads that spin-wait for a busy core
# make a loaded machine dozens of times slower: one thread keeps the suite's time predictable.
torch.set_num_threads(1)

RAGGED_PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="session")
def tiny_target():
    """The tiny random Llama (256-token vocabulary, 2 layers, no EOS) that most tests decode with."""
    return tiny_random_model(seed=0, eos_token_id=None)


@pytest.fixture(scope="session")
def target(tiny_target):
    """The target of a test: `tiny_target`, unless a module overrides it (the sampling tests' 8-token one)."""
    return tiny_target


@pytest.fixture(scope="session")
def unrelated_draft():
    return tiny_random_model(seed=1, num_layers=1, eos_token_id=None)


def make_engine(target: torch.nn.Module, draft: torch.nn.Module | str | None = None, *, dtype: str = "float32",
                compile: str | None = None, backend: str = "eager", device: str = "cpu", **compiled) -> Engine:
    """An `Engine` on `target` in `dtype` (float32: greedy outputs comparable token for token), drafting
    with `draft`: a model, None (no draft model), or "self" (the target drafts for itself).

    compile=None gives the core's eager engine (no passes object). A compile mode gives it
    `Accelerated(compile=mode)`: "off" is then eager with the accelerated engine's other defaults
    (packed linear layers on a CPU in float32), and "on" compiles each model's passes through dynamo's
    `backend`. The default `eager` backend traces, guards and buckets shapes as inductor does but
    generates no code, so a compiled test takes seconds rather than minutes. `compiled` goes to
    `CompiledForward`, e.g. cuda_graphs="explicit" with a stand-in graph_class (tests/taped_graph.py)."""
    passes = None if compile is None else Accelerated(compile=compile)
    engine = Engine(target, target if draft == "self" else draft, device=device, dtype=dtype, passes=passes)
    if engine.compile:
        for model in (engine.target, engine.draft):
            if model is not None:
                model.compiled = CompiledForward(model, backend=backend, **compiled)
    return engine


@pytest.fixture
def engine_factory(tiny_target):
    """`engine_factory(draft, **options)`: `make_engine` on `tiny_target`, also in a module whose own
    `target` is another model."""
    return functools.partial(make_engine, tiny_target)


class TargetTime:
    """A clock on which time passes only in the target's passes: 1 per pass plus `width` per extra
    token scored per row; drafting is free. The cost-aware policies learn their costs from clocks, so
    on a shared machine one stalled step can make drafting look unprofitable for the rest of a short
    run, and a test that asserts they drafted fails by chance; on this clock their decisions are the
    same on every machine, and drafting pays wherever anything is accepted."""

    def __init__(self, monkeypatch, engine: Engine, width: float = 0.01):
        import specdec.adaptive.hybrid
        import specdec.adaptive.policy
        import specdec.core.decoding
        import specdec.core.engine

        self.now = 0.0
        for module in (specdec.core.decoding, specdec.core.engine, specdec.adaptive.policy, specdec.adaptive.hybrid):
            monkeypatch.setattr(module, "time", self)
        forward = engine.target.forward

        def timed(tokens: torch.Tensor, *args, **kwargs):  # tokens: [B, T]
            self.now += 1.0 + width * (tokens.shape[1] - 1)
            return forward(tokens, *args, **kwargs)

        monkeypatch.setattr(engine.target, "forward", timed)

    def perf_counter(self) -> float:
        return self.now

    process_time = perf_counter


@pytest.fixture
def target_time(monkeypatch):
    """`target_time(engine)`: from then on, until the test ends, the policies' clocks are
    `TargetTime` on that engine's target."""
    return lambda engine, width=0.01: TargetTime(monkeypatch, engine, width)


def tiny_of(config_class, attention: str = "sdpa", **extra) -> torch.nn.Module:
    """A tiny random causal LM of another family (`config_class`, e.g. GPTNeoXConfig) on the tiny
    tokenizer's vocabulary (256), 2 layers of width 64, `attention`, seed 0, eval mode."""
    import transformers

    config = config_class(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=512, initializer_range=0.1,
                          bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()


def load_script(name: str, folder: str = "scripts"):
    """<folder>/<name>.py of the repository as a module (scripts and experiments are not packages),
    so tests call its functions."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

