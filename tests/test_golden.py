"""Golden outputs: every method's greedy tokens, acceptance counts and cache state, pinned.

Each method config of conf/method/ is composed and built as an experiment builds it, then decodes a
fixed ragged batch greedily in float32. What comes out (tokens, per-row drafted / accepted / emitted
counts per step, the target cache's row lengths and a checksum of its valid keys and values) must
equal `assets/golden.json`, recorded from the code before a refactor: a change of layout that claims
to preserve behaviour proves it here. Rewrite the file only for a change that means to alter tokens:
`SPECDEC_WRITE_GOLDEN=1 pytest tests/test_golden.py` (then read the diff).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
GOLDEN = Path(__file__).parent / "assets" / "golden.json"
WRITE = os.environ.get("SPECDEC_WRITE_GOLDEN") == "1"

# Methods that need no trained heads run on the tiny random target; the trained heads (EAGLE,
# Medusa) fit only the embedded target, so they run there too, with the cheap methods beside them.
# A method's name, with what it needs on that target beyond its own config.
TINY_METHODS = {"autoregressive": [], "draft": [], "draft_typical": [], "ngram": [], "suffix": [], "suffix_tree": [],
                "layer_skip": ["method.proposer.exit_layer=1"], "hybrid": ["~method.proposer.parts.eagle"]}
EMBEDDED_METHODS = {"draft": [], "ngram": [], "suffix": [], "suffix_tree": [], "layer_skip": [], "eagle": [],
                    "medusa": [], "hybrid": []}
TINY_PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [3, 4], [10, 11, 12, 13, 14, 15, 16, 17, 18, 12, 13]]
EMBEDDED_PROMPTS = ["def add(a, b):\n    return", "Once upon a time, there was a little"]


def _cfg(target: str, method: str, extra: list[str]) -> object:
    overrides = [*extra, "~experiment", f"target={target}", "logger=none", "data.limit=1", "plots=false", "warmup=false",
                 "dtype=float32", f"method={method}", "draft=self" if target != "tiny_random" else "draft=tiny_random"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides)


def _record(decoder, prompts, max_new_tokens: int) -> dict:
    """What a greedy generation leaves behind, as plain numbers (the checksum rounded to 1e-3)."""
    out = decoder.generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0)
    cache = decoder.engine.target.cache
    kv = 0.0
    for row in range(cache.batch_size):
        keys, values = cache.valid_kv(0, row)
        kv += float(keys.double().abs().sum() + values.double().abs().sum())
    return {
        "tokens": out.output_ids,
        "steps": out.stats.steps,
        "rows": [[r.steps, r.proposed, r.accepted, r.emitted, r.draft_lengths, r.accepted_lengths]
                 for r in out.stats.rows],
        "cache_lengths": list(cache.lengths),
        "kv_checksum": round(kv, 3),
    }


def _run(target: str, methods: dict[str, list[str]], prompts, max_new_tokens: int, target_time) -> dict:
    """Each method's record; time passes only in target passes (`target_time`), so that the hybrid's
    and the schedules' cost-driven choices are the same on every machine."""
    from specdec.study.experiment import build

    torch.set_num_threads(1)
    got = {}
    for method, extra in methods.items():
        setup = build(_cfg(target, method, extra))
        decoder = setup.baseline if method == "autoregressive" else next(iter(setup.methods.values()))
        target_time(setup.engine)
        got[method] = _record(decoder, prompts, max_new_tokens)
    return got


def _check(name: str, got: dict) -> None:
    golden: dict[str, dict] = {}
    if GOLDEN.exists():
        for key, record in json.loads(GOLDEN.read_text()).items():
            target, method = key.split("/")
            golden.setdefault(target, {})[method] = record
    if WRITE:
        golden[name] = got
        lines = [f"  {json.dumps(f'{t}/{m}')}: {json.dumps(r, sort_keys=True)}"
                 for t in sorted(golden) for m, r in sorted(golden[t].items())]
        GOLDEN.write_text("{\n" + ",\n".join(lines) + "\n}\n")
        return
    want = golden[name]
    assert sorted(got) == sorted(want)
    for method in want:
        assert got[method] == want[method], method


def test_every_method_keeps_its_golden_outputs_on_the_tiny_target(target_time):
    _check("tiny", _run("tiny_random", TINY_METHODS, TINY_PROMPTS, 16, target_time))


@pytest.mark.slow
def test_every_method_keeps_its_golden_outputs_on_the_embedded_target(target_time):
    _check("embedded", _run("smollm2_135m", EMBEDDED_METHODS, EMBEDDED_PROMPTS, 24, target_time))
