"""The model tests' shared fixture: a stand-in GGUF whose conversion takes milliseconds."""

import os

import pytest

from specdec import models
from specdec.models import tiny_random_model, tiny_random_tokenizer


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A GGUF whose 'conversion' builds a tiny random model, so the cache logic runs in milliseconds;
    `calls` counts conversions. The cache lives in tmp_path/cache and files are made under umask 022."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "Tiny-Model.Q8_0.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    calls = []

    def convert(path):
        calls.append(path)
        return tiny_random_model(seed=5), tiny_random_tokenizer(256)

    monkeypatch.setattr(models, "_load_gguf", convert)
    old_mask = os.umask(0o022)
    yield gguf, calls
    os.umask(old_mask)
