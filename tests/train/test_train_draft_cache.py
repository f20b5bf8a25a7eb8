"""The draft-training script's continuation cache is data, never code: a cache file is read with
`torch.load(weights_only=True)` whatever the installed torch defaults to, and a file that is not plain
data is regenerated with a warning instead of being unpickled."""

import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from specdec.models import tiny_random_model
from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[2]


def _script():
    return load_script("train_draft")


class _Payload:
    """Unpickling this calls os.mkdir(path): what a crafted cache file could do with full unpickling."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


def test_a_crafted_cache_file_is_not_unpickled(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    # torch < 2.6 unpickled anything by default; this variable brings that default back in torch 2.6+.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train_draft", overrides=["target.path=tiny_random", "generation.max_new_tokens=4",
                                                "generation.batch_size=2", "progress=false"])
    script = _script()
    writer = tiny_random_model(seed=0)
    prompts = [[5, 6, 7], [8, 9]]
    first = script.cached_continuations(cfg, writer, prompts, eos=None)
    (cached,) = (tmp_path / "cache" / "train_draft").glob("continuations-*.pt")

    marker = tmp_path / "code_ran"
    torch.save([_Payload(marker)], cached)
    again = script.cached_continuations(cfg, writer, prompts, eos=None)
    assert not marker.exists(), "loading the cache ran code from the file"
    assert "not plain data" in caplog.text and str(cached) in caplog.text
    assert [(e.tokens.tolist(), e.start) for e in again] == [(e.tokens.tolist(), e.start) for e in first]
    # The regenerated file loads: generating again would fail here.
    monkeypatch.setattr(script, "generate_continuations", lambda *a, **k: pytest.fail("regenerated"))
    reread = script.cached_continuations(cfg, writer, prompts, eos=None)
    assert [e.tokens.tolist() for e in reread] == [e.tokens.tolist() for e in first]


def test_a_cache_file_cut_short_is_generated_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train_draft", overrides=["target.path=tiny_random", "generation.max_new_tokens=4",
                                                "generation.batch_size=2", "progress=false"])
    script = _script()
    writer = tiny_random_model(seed=0)
    first = script.cached_continuations(cfg, writer, [[5, 6, 7], [8, 9]], eos=None)
    (cached,) = (tmp_path / "cache" / "train_draft").glob("continuations-*.pt")
    cached.write_bytes(cached.read_bytes()[:100])  # an interrupted write of an older version
    again = script.cached_continuations(cfg, writer, [[5, 6, 7], [8, 9]], eos=None)
    assert "cannot be read" in caplog.text and str(cached) in caplog.text
    assert [e.tokens.tolist() for e in again] == [e.tokens.tolist() for e in first]
    assert [p.name for p in cached.parent.iterdir()] == [cached.name]  # no temporary file left
