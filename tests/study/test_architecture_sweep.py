"""experiments/architectures/sweep.py's check of one model type, in-process on three types: Llama is
decoded token-identically, BLOOM (ALiBi) and BERT without `is_decoder` are refused, and BERT with the
`bert:is_decoder=true` override is decoded token-identically; with `--paths`, Llama also under
compile=on, with Medusa and EAGLE, eager, compiled and trained, and in bfloat16 (exact greedy), and
GPT-2's EAGLE refused."""

import json

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def sweep():
    return load_script("sweep", "experiments/architectures")


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


def test_every_path_on_llama_and_the_tree_methods_refused_on_gpt2(sweep, tmp_path):
    """`--paths`: compile=on (dynamo's eager backend, its passes run compiled), Medusa and EAGLE, eager
    and under compile=on, give Llama's reference tokens; on GPT-2 EAGLE is refused as the drafter is
    built. Each path's class is recorded, the eager path's fields stay where they were, and the table
    has a column per path."""
    paths = sweep.parse_paths("eager,compiled,medusa,eagle,medusa_compiled,eagle_compiled")
    llama = sweep.check_type("llama", paths=paths)
    assert llama["cls"] == "MATCH" and set(llama["runs"]) == {"plain/b1", "plain/ragged", "self/b1", "self/ragged"}
    assert llama["classes"] == dict.fromkeys(paths, "MATCH"), llama["paths"]
    assert set(llama["paths"]["compiled"]["runs"]) == set(llama["runs"])  # and no run found its passes eager
    for method in ("medusa", "eagle"):  # the compiled trees ran compiled: no "<method>/compiled" entry
        assert set(llama["paths"][f"{method}_compiled"]["runs"]) == {f"{method}/ragged"}
    gpt2 = sweep.check_type("gpt2", paths=("medusa", "eagle"))
    assert gpt2["classes"] == {"medusa": "MATCH", "eagle": "REFUSED"}, gpt2["paths"]
    assert "method=eagle needs a Llama-like target" in sweep.path_reasons(gpt2)
    table = tmp_path / "table.md"
    sweep.write_table([llama, {"type": "x", "cls": "SKIP", "why": "not built"}], str(table), paths)
    lines = table.read_text().splitlines()
    assert lines[0] == "| class | eager | compiled | medusa | eagle | medusa_compiled | eagle_compiled |"
    assert "| `x` | SKIP | SKIP | SKIP | SKIP | SKIP | SKIP | not built |" in lines


def test_trained_paths_train_on_the_targets_text_and_decode_losslessly(sweep, monkeypatch):
    """`medusa_trained`, `eagle_trained`: on GPT-NeoX (a decoder not called `model`) heads and drafter
    are trained on the target's own text, their loss falls, and they decode the reference tokens; a
    run whose loss did not fall is a CRASH, however it decoded."""
    paths = ("medusa_trained", "eagle_trained")
    neox = sweep.check_type("gpt_neox", paths=paths)
    assert neox["classes"] == dict.fromkeys(paths, "MATCH"), neox["paths"]
    for method in ("medusa", "eagle"):
        assert neox["paths"][f"{method}_trained"]["runs"] == {f"{method}/training": "ok", f"{method}/ragged": "ok"}
    monkeypatch.setattr(sweep, "train_briefly", lambda engine, module, method: [1.0, 1.5])
    stuck = sweep.check_type("llama", paths=("medusa_trained",))
    assert stuck["classes"] == {"medusa_trained": "CRASH"}
    assert "the loss did not fall" in sweep.path_reasons(stuck)


def test_first_layer_paths_cut_the_target_or_refuse(sweep):
    """`layer_skip`, `cut_draft`: GPT-NeoX-Japanese's first layer drafts losslessly as a view of the
    target, but a one-layer model of its class is refused as train_draft's starting draft (its last
    layer, the only one there, has an attention bias the target's first layer lacks)."""
    res = sweep.check_type("gpt_neox_japanese", paths=("layer_skip", "cut_draft"))
    assert res["classes"] == {"layer_skip": "MATCH", "cut_draft": "REFUSED"}, res["paths"]
    assert "is not the target's first 1 layer (" in res["paths"]["cut_draft"]["why"]


def test_paths_parse(sweep):
    assert sweep.parse_paths("compiled, eagle,compiled") == ("compiled", "eagle")
    with pytest.raises(Exception, match="--paths: trees; choose from eager, compiled, medusa, eagle, medusa_compiled"):
        sweep.parse_paths("eager,trees")


def test_update_replaces_the_records_of_the_types_checked_again(sweep, tmp_path):
    """`--update`: the results file keeps its other records in their order, the type checked again
    replaces its stale record in place, and the table covers the whole file."""
    out, table = tmp_path / "results.jsonl", tmp_path / "table.md"
    stale = {"type": "bloom", "cls": "CRASH", "why": "stale", "runs": {}}
    other = {"type": "x", "cls": "SKIP", "why": "not built"}
    out.write_text("".join(json.dumps(r) + "\n" for r in (stale, other)))
    sweep.main(["bloom", "--out", str(out), "--table", str(table), "--update", "--timeout-s", "120"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["type"] for r in rows] == ["bloom", "x"] and rows[1] == other
    assert rows[0]["cls"] == "REFUSED" and "ALiBi" in sweep.reason(rows[0])
    assert "| `x` | SKIP |" in table.read_text() and "| REFUSED | 1 |" in table.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl", "table.md"]  # no side files left
    with pytest.raises(SystemExit):
        sweep.main(["--out", str(out), "--update"])  # which types to check again must be named


def test_the_bf16_path_holds_with_exact_greedy_and_fails_without_it(sweep, monkeypatch):
    """`--paths bf16`: on Llama built wide, in bfloat16, self-drafting gives plain decoding's tokens with
    exact greedy on; with it off (`--exact-greedy off`: each pass scored at its own width) the same
    check finds other tokens, so it can fail."""
    assert sweep.check_type("llama", paths=("bf16",))["classes"] == {"bf16": "MATCH"}
    monkeypatch.setattr(sweep, "BF16_EXACT_GREEDY", False)  # --exact-greedy off
    assert sweep.check_type("llama", paths=("bf16",))["classes"] == {"bf16": "MISMATCH"}
