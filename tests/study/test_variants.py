"""How runs compare methods: every method of a run has a name of its own (a second method of the same
name is named by what differs), a grid of method settings expands into variants of one interleaved
run with one baseline, and with exact greedy the baseline that speedups are over is plain decoding
one token wide, with plain decoding at the methods' width beside it as the tokens to match and as the
cost of exact greedy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specdec.core.engine import CachedModel
from specdec.study import experiment
from specdec.study.config import ConfigError, method_configs, validate
from specdec.study.variants import expand

CONF = Path(__file__).resolve().parents[2] / "conf"
FAST = ["experiment=tiny_smoke", "data.limit=1", "data.categories=[qa,rag]", "generation.max_new_tokens=6",
        "plots=false", "warmup=false"]
REFERENCE = "autoregressive[exact greedy, width 9]"


def _cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*FAST, *overrides])


def _names(cfg) -> list[str]:
    return [m.name for _, m in method_configs(cfg)]


# ---------------------------------------------------------------- names


def test_a_second_method_of_the_same_name_is_named_by_what_differs():
    cfg = expand(_cfg("method=ngram", "+method@compare.eight=ngram", "compare.eight.num_speculative_tokens=8",
                      "+method@compare.ema=ngram", "compare.ema.schedule=heuristic",
                      "+method@compare.short=ngram", "compare.short.proposer.max_ngram=2",
                      "+method@compare.again=ngram"))
    assert _names(cfg) == ["ngram", "ngram[num_speculative_tokens=8]", "ngram[schedule=heuristic]",
                           "ngram[max_ngram=2]", "ngram[2]"]
    validate(cfg)


def test_a_derived_name_that_is_taken_is_refused_with_how_to_name_it():
    cfg = _cfg("method=ngram", "+method@compare.a=ngram", "compare.a.num_speculative_tokens=8",
               "compare.a.name='ngram[num_speculative_tokens=8]'", "+method@compare.b=ngram",
               "compare.b.num_speculative_tokens=8")
    with pytest.raises(ConfigError, match=r"compare\.b\.name: .*compare\.b\.name=<name>"):
        expand(cfg)


def test_a_drafting_method_may_not_take_the_baselines_name():
    with pytest.raises(ConfigError, match="compare.x.name: `autoregressive` names the plain-decoding baseline"):
        expand(_cfg("method=ngram", "+method@compare.x=suffix", "compare.x.name=autoregressive"))


def test_two_methods_of_one_name_are_two_rows_of_the_run(tmp_path):
    s = experiment.run(_cfg("method=ngram", "+method@compare.eight=ngram", "compare.eight.num_speculative_tokens=8"),
                       tmp_path).summary
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert list(s["methods"]) == ["ngram", "ngram[num_speculative_tokens=8]", "autoregressive", REFERENCE]
    assert {r["method"] for r in rows} == set(s["methods"]) and len(rows) == 4 * s["num_prompts"]
    assert s["method_configs"]["ngram[num_speculative_tokens=8]"]["num_speculative_tokens"] == 8
    assert s["method_configs"]["ngram"]["num_speculative_tokens"] == 4
    assert "| ngram[num_speculative_tokens=8] |" in (tmp_path / "table.md").read_text()


# ---------------------------------------------------------------- grids


def test_a_grid_expands_into_named_variants_of_one_run():
    cfg = expand(_cfg("method=ngram", "grid.methods=[ngram,suffix]", "grid.method.num_speculative_tokens=[2,8]",
                      "grid.method.schedule=[constant,heuristic]"))
    names = _names(cfg)
    assert names[0] == "ngram[num_speculative_tokens=2,schedule=constant]"
    assert names == [f"{m}[num_speculative_tokens={k},schedule={s}]" for m in ("ngram", "suffix") for k in (2, 8)
                     for s in ("constant", "heuristic")]
    by_name = {m.name: m for _, m in method_configs(cfg)}
    assert by_name["suffix[num_speculative_tokens=8,schedule=heuristic]"].schedule == "heuristic"
    assert by_name["suffix[num_speculative_tokens=8,schedule=heuristic]"].proposer._target_.endswith("SuffixProposer")
    assert by_name["ngram[num_speculative_tokens=2,schedule=constant]"].num_speculative_tokens == 2
    assert not cfg.grid
    validate(cfg)


def test_a_grid_keeps_the_methods_own_settings_and_the_compared_methods():
    cfg = expand(_cfg("method=ngram", "method.proposer.max_ngram=2", "grid.method.num_speculative_tokens=[3,5]",
                      "+method@compare.suffix=suffix"))
    assert _names(cfg) == ["ngram[num_speculative_tokens=3]", "ngram[num_speculative_tokens=5]", "suffix"]
    assert [m.proposer.max_ngram for _, m in method_configs(cfg)[:2]] == [2, 2]


@pytest.mark.parametrize("override, message", [
    ("grid.dtype=[float32,bfloat16]", "grid.dtype: a grid varies the method within one run"),
    ("grid.method.k=[2,4]", "grid.method.k: not a setting of a method"),
    ("grid.method.num_speculative_tokens=4", "grid.method.num_speculative_tokens: a list of the values"),
    ("grid.methods=[ngram,nosuch]", "grid.methods: no method 'nosuch'; choose from: "),
])
def test_a_grid_that_cannot_work_is_refused_before_any_model_loads(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        expand(_cfg("method=ngram", override))


def test_every_variant_is_validated_before_any_model_loads(tmp_path, monkeypatch):
    def no_models(*args, **kwargs):
        raise AssertionError("a model loaded before the grid was checked")

    monkeypatch.setattr(experiment, "load_model", no_models)
    with pytest.raises(ConfigError, match=r"num_speculative_tokens: k must be >= 1, got 0"):
        experiment.run(_cfg("method=ngram", "grid.method.num_speculative_tokens=[2,0]"), tmp_path / "run")


def test_a_grid_runs_every_variant_beside_one_baseline_prompt_by_prompt(batch_calls, tmp_path):
    calls = batch_calls
    s = experiment.run(_cfg("method=ngram", "grid.methods=[ngram,suffix]", "grid.method.num_speculative_tokens=[2,8]"),
                       tmp_path).summary
    variants = [f"{m}[num_speculative_tokens={k}]" for m in ("ngram", "suffix") for k in (2, 8)]
    roles = [*variants, "autoregressive", REFERENCE]
    assert list(s["methods"]) == roles and s["method"] == variants[0]
    prompts = list(dict.fromkeys(p for p, _ in calls))
    assert len(prompts) == s["num_prompts"] == 2
    # every prompt is decoded by every variant and by one baseline, the order rotating prompt by prompt
    for i, prompt in enumerate(prompts):
        assert [role for p, role in calls if p == prompt] == roles[i:] + roles[:i]
    assert all(s["methods"][v]["overall"]["matches_baseline"] == 1.0 for v in variants)


# ---------------------------------------------------------------- the baseline of a speedup


def test_speedups_are_over_one_wide_plain_decoding_and_exact_greedy_costs_a_row(tmp_path, monkeypatch):
    widths: dict[str, list[int]] = {}
    role = [None]
    real_batch, real_forward = experiment.run_batch, CachedModel.forward

    def spy(decoder, name, *args):
        role[0] = name
        return real_batch(decoder, name, *args)

    def forward(self, tokens, *args, **kwargs):  # tokens: [B, T]
        if self.name == "target":
            widths.setdefault(role[0], []).append(tokens.shape[1])
        return real_forward(self, tokens, *args, **kwargs)

    monkeypatch.setattr(experiment, "run_batch", spy)
    monkeypatch.setattr(CachedModel, "forward", forward)
    s = experiment.run(_cfg("method=suffix", "+method@compare.ngram=ngram", "generation.max_new_tokens=12"),
                       tmp_path).summary
    assert s["score_width"] == 9 and s["exact_greedy"] is True  # suffix drafts up to k = 8
    assert s["exact_greedy_reference"] == REFERENCE == s["tokens_checked_against"]
    # plain decoding one token wide: every pass after the prefill scores one token; the reference, nine
    base, ref = s["methods"]["autoregressive"]["overall"], s["methods"][REFERENCE]["overall"]
    assert widths["autoregressive"].count(1) >= base["new_tokens"] - s["num_prompts"] > 0
    assert 1 not in widths[REFERENCE] and widths[REFERENCE].count(9) >= ref["new_tokens"] - s["num_prompts"]
    assert s["baseline_tokens_per_s"] == base["tokens_per_s"]
    for name in ("suffix", "ngram"):
        m = s["methods"][name]["overall"]
        assert m["speedup"] == pytest.approx(m["tokens_per_s"] / base["tokens_per_s"])
        assert m["matches_baseline"] == 1.0  # the exact-greedy plain decoding's tokens, prompt for prompt
    assert s["speedup"] == s["methods"]["suffix"]["overall"]["speedup"]
    assert ref["speedup"] == pytest.approx(ref["tokens_per_s"] / base["tokens_per_s"])
    assert s["exact_greedy_cost"] == pytest.approx(base["tokens_per_s"] / ref["tokens_per_s"])
    assert s["methods"]["autoregressive"]["exact_greedy"] == "off"
    assert s["methods"][REFERENCE]["exact_greedy"] == "on" and s["methods"]["suffix"]["exact_greedy"] == "on"
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {r["exact_greedy"] for r in rows if r["method"] == "autoregressive"} == {False}
    assert {r["exact_greedy"] for r in rows if r["method"] == REFERENCE} == {True}
    assert f"| {REFERENCE} |" in (tmp_path / "table.md").read_text()


def test_without_exact_greedy_or_when_sampling_there_is_no_reference(tmp_path):
    off = experiment.run(_cfg("method=ngram", "engine.exact_greedy=false"), tmp_path / "off").summary
    sampled = experiment.run(_cfg("method=ngram", "generation.temperature=0.7"), tmp_path / "sampled").summary
    for s in (off, sampled):
        assert list(s["methods"]) == ["ngram", "autoregressive"] and "exact_greedy_cost" not in s
        assert s["score_width"] == 1
    assert off["tokens_checked_against"] == "autoregressive" and "tokens_checked_against" not in sampled
