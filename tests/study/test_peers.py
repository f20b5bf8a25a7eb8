"""vLLM as an anchor (`specdec.study.peers`, `scripts/vllm_worker.py`).

The worker runs in a separate interpreter that finds `vllm`. Here that package is a stand-in written
by the test (transformers' greedy generate behind vLLM's `LLM`, `SamplingParams` and `get_metrics`
names, with speculative counters that follow a rule the test knows), so the real worker script and
the real host side run end to end, through the experiment harness too. The same checks against the
real vLLM run where `SPECDEC_VLLM_PYTHON` points at its environment (`test_real_vllm_...`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.errors import InvalidInput, MissingInput
from specdec.models import tiny_random_model, tiny_random_tokenizer
from specdec.study import experiment
from specdec.study.peers import VLLMAnchor, pinned_cpus, speculative_config
from tests.conftest import RAGGED_PROMPTS, make_engine

CONF = Path(__file__).resolve().parents[2] / "conf"

STAND_IN = '''
"""A stand-in for vLLM: transformers' greedy generate, vLLM's names, counters that follow a rule."""
import types

import torch
from transformers import AutoModelForCausalLM

__version__ = "0.0-stand-in"


class SamplingParams:
    def __init__(self, max_tokens, temperature=0.0, top_k=-1, top_p=1.0, seed=None, stop_token_ids=None,
                 ignore_eos=False):
        self.max_tokens, self.temperature, self.stop_token_ids = max_tokens, temperature, stop_token_ids


class _Metric:
    def __init__(self, name, value=0, values=None):
        self.name, self.value, self.values = name, value, values


class LLM:
    def __init__(self, model, dtype="auto", seed=0, disable_log_stats=True, max_model_len=None,
                 speculative_config=None, **engine_args):
        if engine_args.get("fail"):
            raise ValueError("the stand-in was told to fail")
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.k = (speculative_config or {}).get("num_speculative_tokens", 0)
        self.drafts = self.draft_tokens = self.accepted = 0
        self.per_pos = [0] * self.k

    def generate(self, prompts, params, use_tqdm=False):
        ids = torch.tensor([prompts[0]["prompt_token_ids"]])
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_tokens,
                                      do_sample=False, eos_token_id=params.stop_token_ids, pad_token_id=0)
        new = out[0, ids.shape[1]:].tolist()
        if self.k:  # the rule: one draft of k per two new tokens, its first token accepted
            drafts = len(new) // 2
            self.drafts += drafts
            self.draft_tokens += drafts * self.k
            self.accepted += drafts
            self.per_pos[0] += drafts
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=new)])]

    def get_metrics(self):
        if not self.k:
            return []
        return [_Metric("vllm:spec_decode_num_drafts", self.drafts),
                _Metric("vllm:spec_decode_num_draft_tokens", self.draft_tokens),
                _Metric("vllm:spec_decode_num_accepted_tokens", self.accepted),
                _Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=list(self.per_pos))]
'''


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny target saved as a folder, as vLLM loads a model."""
    path = tmp_path_factory.mktemp("tiny_target")
    tiny_random_model(seed=0, eos_token_id=None).save_pretrained(path)
    tiny_random_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """An interpreter whose `vllm` is the stand-in (this python with the stand-in on its path)."""
    package = tmp_path / "stand_in" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN)
    repo = str(Path(__file__).resolve().parents[2])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(package.parent), repo, os.environ.get("PYTHONPATH", "")]))
    return sys.executable


def test_plain_decoding_equals_specdecs_greedy_tokens(folder, stand_in):
    model = tiny_random_model(seed=0, eos_token_id=None)
    engine = make_engine(model)
    ours = SpeculativeDecoder(engine).generate(RAGGED_PROMPTS, max_new_tokens=12)
    anchor = VLLMAnchor(engine, python=stand_in, model_path=str(folder))
    try:
        theirs = anchor.generate(RAGGED_PROMPTS, max_new_tokens=12)
    finally:
        anchor.close()
    assert theirs.output_ids == ours.output_ids
    assert [r.steps for r in theirs.stats.rows] == [11, 11, 11]  # one pass per token after the prefill
    assert theirs.reports["vllm"]["version"] == "0.0-stand-in" and theirs.reports["vllm"]["startup_s"] > 0
    assert theirs.stats.cpu_s > 0 and all(r.wall_s > 0 for r in theirs.stats.rows)
    assert theirs.reports["vllm"]["cpus"] == pinned_cpus(1) == sorted(os.sched_getaffinity(0))[:1]  # one core


def test_an_unpinned_worker_runs_on_every_core(folder, stand_in):
    """`pin=False` leaves vLLM's worker free to spread over the cores this process may use."""
    anchor = VLLMAnchor(make_engine(tiny_random_model(seed=0, eos_token_id=None)), python=stand_in,
                        model_path=str(folder), pin=False)
    try:
        theirs = anchor.generate(RAGGED_PROMPTS[:1], max_new_tokens=4)
    finally:
        anchor.close()
    assert theirs.reports["vllm"]["cpus"] == sorted(os.sched_getaffinity(0))


def test_speculative_counters_become_specdecs(folder, stand_in):
    """The stand-in's rule for 12 new tokens: 6 drafts of k = 3, one accepted each. Emitted 11 (the
    prefill's token is no step's), accepted 6, so 5 passes; tau = 11 / 5."""
    engine = make_engine(tiny_random_model(seed=0, eos_token_id=None))
    anchor = VLLMAnchor(engine, num_speculative_tokens=3, python=stand_in, speculative="ngram",
                        model_path=str(folder))
    try:
        out = anchor.generate(RAGGED_PROMPTS[:2], max_new_tokens=12)
        again = anchor.generate(RAGGED_PROMPTS[:1], max_new_tokens=12)  # counters are per row, not cumulative
    finally:
        anchor.close()
    for row in [*out.stats.rows, *again.stats.rows]:
        assert (row.steps, row.proposed, row.accepted, row.emitted) == (5, 18, 6, 11)
        assert row.accepted_at == [6, 0, 0] and row.proposed_at == [6, 6, 6] and row.reached_at == [6, 6, 0]
    assert out.stats.total.mean_accepted_length == pytest.approx(11 / 5)
    assert anchor.name == "vllm_ngram" and out.reports["vllm"]["speculative"]["prompt_lookup_max"] == 4


def test_the_anchor_runs_in_the_harness_beside_specdecs_methods(folder, stand_in, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_VLLM_PYTHON", stand_in)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[
            "~experiment", f"target.path={folder}", "logger=none", "data.limit=1", "generation.max_new_tokens=6",
            "plots=false", "warmup=false", "dtype=float32", "method=ngram", "+method@compare.vllm_ngram=vllm_ngram",
            "+method@compare.vllm=vllm"])
    experiment.run(cfg, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    methods = summary["methods"]
    assert {"ngram", "vllm", "vllm_ngram"} <= set(methods)
    for name in ("vllm", "vllm_ngram"):
        assert methods[name]["overall"]["matches_baseline"] == 1.0  # greedy: the baseline's tokens on every prompt
    assert methods["vllm_ngram"]["overall"]["proposed"] > 0


def test_bad_set_ups_are_refused_before_anything_starts(folder, stand_in, monkeypatch):
    engine = make_engine(tiny_random_model(seed=0, eos_token_id=None))
    monkeypatch.delenv("SPECDEC_VLLM_PYTHON", raising=False)
    with pytest.raises(MissingInput, match="SPECDEC_VLLM_PYTHON"):
        VLLMAnchor(engine, model_path=str(folder))
    with pytest.raises(MissingInput, match="cannot run"):
        VLLMAnchor(engine, python="/no/such/python", model_path=str(folder))
    with pytest.raises(MissingInput, match="target as a folder"):
        VLLMAnchor(engine, python=stand_in)  # a model built in memory has no folder
    # vLLM's suffix decoding needs arctic-inference in its environment, which the stand-in's lacks
    with pytest.raises(MissingInput, match="suffix method needs arctic-inference"):
        VLLMAnchor(engine, num_speculative_tokens=4, python=stand_in, speculative="suffix", model_path=str(folder))
    arctic = Path(os.environ["PYTHONPATH"].split(os.pathsep)[0]) / "arctic_inference"
    arctic.mkdir()
    (arctic / "__init__.py").write_text("")
    assert VLLMAnchor(engine, num_speculative_tokens=4, python=stand_in, speculative="suffix",
                      model_path=str(folder)).speculative  # found: accepted
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))  # this python, no stand-in
    with pytest.raises(MissingInput, match="has no vllm installed"):
        VLLMAnchor(engine, python=sys.executable, model_path=str(folder))
    with pytest.raises(MissingInput, match="drafter"):
        speculative_config("eagle3", 4)
    with pytest.raises(InvalidInput, match="vLLM's methods here"):
        speculative_config("medusa", 4)
    with pytest.raises(InvalidInput, match=">= 1"):
        speculative_config("ngram", 0)


def test_speculative_args_reach_vllms_config_and_clashes_are_refused():
    off = {"suffix_decoding_max_cached_requests": 0}
    assert speculative_config("suffix", 8, extra=off) == {"method": "suffix", "num_speculative_tokens": 8, **off}
    with pytest.raises(InvalidInput, match="sets method, num_speculative_tokens"):
        speculative_config("suffix", 8, extra={"num_speculative_tokens": 16, "method": "ngram"})
    with pytest.raises(InvalidInput, match="plain decoding has no speculative config"):
        speculative_config(None, 0, extra=off)


def test_vllms_prefix_cache_is_off_unless_asked_for(folder, stand_in):
    """With it on, vLLM would skip the prefills of prompts it saw before (a run's second repeat, a
    conversation's earlier turns), which specdec's methods beside it pay in full."""
    engine = make_engine(tiny_random_model(seed=0, eos_token_id=None))
    assert VLLMAnchor(engine, python=stand_in, model_path=str(folder)).setup["engine_args"] == {
        "enable_prefix_caching": False}
    asked = VLLMAnchor(engine, python=stand_in, model_path=str(folder),
                       engine_args={"enable_prefix_caching": True, "block_size": 32})
    assert asked.setup["engine_args"] == {"enable_prefix_caching": True, "block_size": 32}


def test_a_failing_worker_says_why(folder, stand_in):
    engine = make_engine(tiny_random_model(seed=0, eos_token_id=None))
    anchor = VLLMAnchor(engine, python=stand_in, model_path=str(folder), engine_args={"fail": True})
    with pytest.raises(RuntimeError, match="the stand-in was told to fail"):
        anchor.generate(RAGGED_PROMPTS[:1], max_new_tokens=4)
    assert anchor.worker is None


@pytest.mark.skipif(not os.environ.get("SPECDEC_VLLM_PYTHON"), reason="SPECDEC_VLLM_PYTHON does not name vLLM's "
                    "environment (docs/peers.md says how to make one)")
@pytest.mark.slow
@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_real_vllm_greedy_tokens_equal_specdecs(tmp_path, speculative):
    """vLLM itself, plain and with n-gram speculation: specdec's greedy tokens, and counters that add
    up. The model has 64-wide heads: vLLM's CPU attention has no kernel for the tiny model's 16."""
    model = tiny_random_model(seed=0, eos_token_id=None, hidden_size=128, num_heads=2, num_kv_heads=1)
    model.save_pretrained(tmp_path)
    tiny_random_tokenizer().save_pretrained(tmp_path)
    engine = make_engine(model)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [3, 4]]
    ours = SpeculativeDecoder(engine).generate(prompts, max_new_tokens=16)
    anchor = VLLMAnchor(engine, num_speculative_tokens=3 if speculative else 0, speculative=speculative,
                        model_path=str(tmp_path), dtype="float32")
    try:
        theirs = anchor.generate(prompts, max_new_tokens=16)
    finally:
        anchor.close()
    assert theirs.output_ids == ours.output_ids
    for row in theirs.stats.rows:
        assert row.steps + row.accepted == row.emitted == 15 and row.accepted <= row.proposed


def test_validation_refuses_a_target_vllm_cannot_load_before_any_model_loads(stand_in, monkeypatch):
    from specdec.study.config import ConfigError, validate

    monkeypatch.setenv("SPECDEC_VLLM_PYTHON", stand_in)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["~experiment", "target=tiny_random", "method=vllm_ngram"])
    with pytest.raises(ConfigError, match=r"^method.decoder: vLLM loads the target from a folder; "
                                          r"target.path=tiny_random is none"):
        validate(cfg)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["~experiment", "method=vllm", "method.decoder.speculative=eagle3"])
    with pytest.raises(ConfigError, match=r"^method.decoder: .*needs the drafter's folder"):
        validate(cfg)


def test_speedups_are_also_over_the_fastest_plain_decoding_in_the_run():
    """A run whose vLLM decodes faster than specdec's baseline: the summary names it and puts every
    method's tokens/s over it; the comparison says so under its table."""
    from specdec.study.report import _over_fastest_plain, format_comparison
    from specdec.study.results import MethodResults, MethodSummary

    def block(tokens_per_s: float, proposed: int) -> MethodResults:
        return MethodResults(overall=MethodSummary(tokens_per_s=tokens_per_s, proposed=proposed, steps=10))

    blocks = {"ngram": block(30.0, 8), "autoregressive": block(20.0, 0), "vllm": block(40.0, 0),
              "vllm_ngram": block(50.0, 9)}  # the fastest of all drafts: not plain decoding
    over = _over_fastest_plain(blocks)
    assert over["fastest_plain"] == "vllm" and over["fastest_plain_tokens_per_s"] == 40.0
    assert over["speedup_over_fastest_plain"] == {"ngram": 0.75, "autoregressive": 0.5, "vllm": 1.0,
                                                  "vllm_ngram": 1.25}
    summary = {"methods": {n: b.to_dict() for n, b in blocks.items()}, **over}
    assert "Fastest plain decoding in this run: vllm, 40.0 tok/s. Over it: ngram 0.75x" in format_comparison(summary)


@pytest.mark.skipif(not os.environ.get("SPECDEC_VLLM_PYTHON"), reason="SPECDEC_VLLM_PYTHON does not name vLLM's "
                    "environment (docs/peers.md says how to make one)")
@pytest.mark.slow
def test_real_vllm_serves_an_eagle3_folder_specdec_exported(tmp_path):
    """The folder specdec evaluates is the folder vLLM runs: an EAGLE-3 drafter exported in the
    `speculators` format drafts in vLLM (its counters move) and in specdec, and both give plain greedy's
    tokens. 8 layers, so that the default taps [2, 4, 5] are distinct; 64-wide heads for vLLM-CPU."""
    from specdec.proposers.eagle3 import Eagle3Proposer
    from specdec.proposers.export import export_speculators
    from tests.proposers.test_eagle3 import drafter_files

    model = tiny_random_model(seed=0, eos_token_id=None, hidden_size=128, num_heads=2, num_kv_heads=1, num_layers=8)
    model.save_pretrained(tmp_path / "target")
    tiny_random_tokenizer().save_pretrained(tmp_path / "target")
    folder = export_speculators(drafter_files(model), tmp_path / "drafter", str(tmp_path / "target"))
    engine = make_engine(model)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [3, 4]]
    plain = SpeculativeDecoder(engine).generate(prompts, max_new_tokens=16)
    ours = SpeculativeDecoder(engine, Eagle3Proposer(engine, str(folder), chain=True),
                              num_speculative_tokens=3).generate(prompts, max_new_tokens=16)
    anchor = VLLMAnchor(engine, num_speculative_tokens=3, speculative="eagle3", drafter=str(folder),
                        model_path=str(tmp_path / "target"), dtype="float32")
    try:
        theirs = anchor.generate(prompts, max_new_tokens=16)
    finally:
        anchor.close()
    assert ours.output_ids == plain.output_ids == theirs.output_ids
    assert all(r.proposed > 0 for r in theirs.stats.rows)  # vLLM drafted with the folder
