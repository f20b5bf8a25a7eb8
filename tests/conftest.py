"""Shared fixtures: tiny random Llama models built in-process (no download)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from specdec.core.engine import Engine
from specdec.models import tiny_random_model

# Tiny models gain nothing from a second thread, and OpenMP threads that spin-wait for a busy core
# make a loaded machine dozens of times slower: one thread keeps the suite's time predictable.
torch.set_num_threads(1)

RAGGED_PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="session")
def target():
    return tiny_random_model(seed=0, eos_token_id=None)


@pytest.fixture(scope="session")
def unrelated_draft():
    return tiny_random_model(seed=1, num_layers=1, eos_token_id=None)


@pytest.fixture
def engine_factory(target):
    """Engine(target, draft): draft "self" is the target itself."""

    def make(draft=None):
        return Engine(target, target if draft == "self" else draft, dtype="float32")

    return make


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

