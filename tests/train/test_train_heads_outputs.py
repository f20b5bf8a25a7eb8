"""Where the training scripts write, and what they refuse before loading a target: heads written over
the target's own files (its weights, or a config.json taken by the report) are refused even with
overwrite=true, as a draft folder that holds the target is; the decoding check's EAGLE tree and
vocabulary are checked before training, not after; and what the scripts write is readable by
the group as the umask allows (safetensors alone writes 0600)."""

import json
import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from specdec.core.errors import InvalidInput
from specdec.models import tiny_random_model, tiny_random_tokenizer
from specdec.train.training import save_draft
from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[2]


def _cfg(name: str, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(name, overrides=list(overrides))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A tiny target saved as a model folder: config.json, model.safetensors, the tokenizer's files."""
    folder = tmp_path_factory.mktemp("target")
    tiny_random_model().save_pretrained(folder)
    tiny_random_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def no_loading(monkeypatch):
    """The train_heads script, whose `load_model` fails the test: a refusal must come before it."""
    script = load_script("train_heads")

    def load_model(spec):
        raise AssertionError("the target loaded before the config was refused")

    monkeypatch.setattr(script, "load_model", load_model)
    return script


def test_heads_written_over_the_targets_weights_are_refused(target_dir, no_loading):
    weights = target_dir / "model.safetensors"
    before = weights.read_bytes()
    cfg = _cfg("train_heads", f"target.path={target_dir}", f"out={weights}", "overwrite=true")
    with pytest.raises(InvalidInput, match=r"model\.safetensors is a file of the target's own folder .*choose another out"):
        no_loading.run(cfg)
    assert weights.read_bytes() == before


def test_a_report_that_would_replace_the_targets_config_is_refused(target_dir, no_loading):
    """out=<target>/config.safetensors writes its report to <target>/config.json."""
    cfg = _cfg("train_heads", f"target.path={target_dir}", f"out={target_dir / 'config.safetensors'}", "overwrite=true")
    with pytest.raises(InvalidInput, match=r"config\.json is a file of the target's own folder"):
        no_loading.check_config(cfg)


def test_heads_beside_the_target_may_be_written_and_replaced(target_dir, no_loading):
    """A new file in the target's folder, or heads trained there before, are the run's own to write."""
    heads = target_dir / "heads.safetensors"
    no_loading.check_config(_cfg("train_heads", f"target.path={target_dir}", f"out={heads}"))
    from specdec.proposers.heads import save_checkpoint

    save_checkpoint(heads, "medusa", {"blocks.0.bias": torch.zeros(4)}, {})
    heads.with_suffix(".json").write_text("{}")  # its report
    try:
        no_loading.check_config(_cfg("train_heads", f"target.path={target_dir}", f"out={heads}", "overwrite=true"))
    finally:
        heads.unlink()
        heads.with_suffix(".json").unlink()


@pytest.mark.parametrize("overrides, message", [
    (["kind=eagle", "eagle.budget=0"], "eagle.budget=0: must be >= 1"),
    (["kind=eagle", "eagle.depth=0"], "eagle.depth=0: must be >= 1"),
    (["kind=eagle", "heads.vocab=8", "eagle.topk=9"], "eagle.topk=9: the drafter proposes from its heads.vocab=8 tokens"),
    (["kind=medusa", "heads.vocab=1"], "heads.vocab=1: Medusa's default tree takes each head's 2 likeliest tokens"),
])
def test_the_decoding_checks_tree_is_refused_before_the_target_loads(tmp_path, no_loading, overrides, message):
    cfg = _cfg("train_heads", "target.path=tiny_random", f"out={tmp_path / 'heads.safetensors'}", *overrides)
    with pytest.raises(InvalidInput, match=message):
        no_loading.run(cfg)


def test_a_draft_folder_that_holds_the_target_is_refused(tmp_path):
    """overwrite=true replaces the whole `out` folder: one that holds the target would delete it."""
    target = tmp_path / "models" / "target"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    cfg = _cfg("train_draft", f"target.path={target}", f"out={tmp_path / 'models'}", "overwrite=true")
    with pytest.raises(InvalidInput, match=r"holds the target .* would delete the target"):
        load_script("train_draft").check_config(cfg)
    assert (target / "config.json").is_file()


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_trained_heads_are_readable_as_the_umask_allows(tmp_path, umask_022):
    from specdec.proposers.heads import save_checkpoint

    path = save_checkpoint(tmp_path / "heads.safetensors", "medusa", {"blocks.0.bias": torch.zeros(4)}, {})
    assert path.stat().st_mode & 0o777 == 0o644


def test_a_trained_draft_is_readable_as_the_umask_allows(tmp_path, umask_022):
    save_draft(tiny_random_model(num_layers=1), tiny_random_tokenizer(), tmp_path / "draft")
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "draft").iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes
    assert (tmp_path / "draft").stat().st_mode & 0o777 == 0o755


def test_kind_corpus_writes_the_targets_answers_as_a_datastore(tmp_path):
    """kind=corpus trains nothing: each prompt and the target's greedy answer, one JSON line each, which
    suffix decoding reads back (and which refuses those prompts)."""
    from specdec.core.decoding import SpeculativeDecoder
    from specdec.core.engine import Engine
    from specdec.proposers.suffix import SuffixProposer

    out = tmp_path / "corpus.jsonl"
    cfg = _cfg("train_heads", "kind=corpus", "target.path=tiny_random", "dtype=float32", "prompts.count=6",
               "prompts.target_written=0", "prompts.held_out=2", "generation.max_new_tokens=8",
               "generation.cache=false", f"out={out}", "progress=false")
    report = load_script("train_heads").run(cfg)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert report["sequences"] == len(rows) == 6 and report["tokens"] == sum(len(r["output_token_ids"]) for r in rows)
    engine = Engine(tiny_random_model(), dtype="float32")
    plain = SpeculativeDecoder(engine).generate([rows[0]["prompt_token_ids"]], max_new_tokens=8)
    assert plain.output_ids[0] == rows[0]["output_token_ids"]  # the target's own greedy answer
    corpus = SuffixProposer(engine, corpus=str(out)).corpus
    assert corpus.sequences == 6 and corpus.prompts == {tuple(r["prompt_token_ids"]) for r in rows}
    with pytest.raises(InvalidInput, match=r"out=.*corpus\.json: must end in \.jsonl"):
        load_script("train_heads").check_config(_cfg("train_heads", "kind=corpus", f"out={tmp_path / 'corpus.json'}"))
