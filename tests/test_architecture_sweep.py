"""experiments/architectures/sweep.py's check of one model type, in-process on three types: Llama is
decoded token-identically, BLOOM (ALiBi) and BERT without `is_decoder` are refused, and BERT with the
`bert:is_decoder=true` override is decoded token-identically."""

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "experiments" / "architectures" / "sweep.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("architecture_sweep", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("spec, cls, why", [
    ("llama", "MATCH", None),
    ("bloom", "REFUSED", "ALiBi"),
    ("bert", "REFUSED", "is_decoder=True"),
    ("bert:is_decoder=true", "MATCH", None),
])
def test_check_type_classes(sweep, spec, cls, why):
    res = sweep.check_type(spec)
    assert res["cls"] == cls, res
    if cls == "MATCH":
        assert set(res["runs"]) == {"plain/b1", "plain/ragged", "self/b1", "self/ragged"}
        assert len(res["ref"]) == len(sweep.PROMPTS) and all(len(r) == sweep.NEW_TOKENS for r in res["ref"])
    else:
        assert res["why"].startswith("UnsupportedModelError") and why in sweep.reason(res)


def test_type_overrides_parse(sweep):
    assert sweep.parse_type("bert") == ("bert", {})
    assert sweep.parse_type("moshi:sliding_window=256,is_decoder=true") == (
        "moshi", {"sliding_window": 256, "is_decoder": True})
