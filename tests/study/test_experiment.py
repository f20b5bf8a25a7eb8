"""One experiment, end to end on tiny random models: every preset and every method runs; the results
files hold what the issue lists; the method and the baseline alternate; multi-turn prompts reuse the
conversation's cache; batching changes no greedy output; W&B sees what summary.json holds, and a
failing W&B loses no local result. Plus the summary arithmetic on hand-made rows."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specdec.core.decoding import Generation
from specdec.core.errors import NoSpace
from specdec.core.metrics import GenerationStats, RowStats, expected_tokens_per_step
from specdec.study import experiment
from specdec.study.data import Prompt, build_turn_input
from specdec.study.report import format_comparison, format_table, summarize
from specdec.study.results import MethodSummary, PromptResult, Totals
from specdec.study.tracking import Terminated, _jsonable, flatten, inspect_offline_run, read_offline_summary

CONF = Path(__file__).resolve().parents[2] / "conf"
TINY = ["target=tiny_random", "draft=tiny_random", "logger=none", "data.limit=1",
        "generation.max_new_tokens=4", "plots=false", "warmup=false", "dtype=float32"]
FAST = ["~experiment", *TINY]  # `method` alone, without the default preset's other methods
# Beside the one-token-wide baseline, exact greedy's plain decoding at the draft's width (k = 4)
REFERENCE = "autoregressive[exact greedy, width 5]"
ROW_FIELDS = ["prompt_id", "category", "method", "prompt_token_ids", "output_token_ids", "output_text",
              "new_tokens", "wall_s", "ttft_s", "steps", "proposed", "accepted", "accepted_per_position",
              "reached_per_position", "lossless", "verifier"]
GROUP_FIELDS = ["tokens_per_s", "speedup", "acceptance_rate", "mean_accepted_length",
                "per_position_acceptance", "ttft_s", "c", "predicted_speedup"]


def _cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _run(tmp_path: Path, *overrides: str, name: str = "run"):
    return experiment.run(_cfg(*FAST, *overrides), tmp_path / name)


def _rows(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "results.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_every_preset_runs_on_tiny_models(preset, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(CONF.parent)
    method = _cfg(f"experiment={preset}", *TINY).method.name  # trained heads: the tiny target's own
    cfg = _cfg(f"experiment={preset}", *TINY, "plots=true", *METHOD_OVERRIDES.get(method, []))
    result = experiment.run(cfg, tmp_path)
    rows = _rows(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    n = summary["num_prompts"]
    methods = {method, "autoregressive", *cfg.compare}  # presets may compare more methods in one run
    if "exact_greedy_reference" in summary:  # plain decoding at the methods' width, beside the one-wide baseline
        methods.add(summary["exact_greedy_reference"])
    # limit 1 per category; prompts longer than the tiny model's 512 positions are skipped and listed
    assert len(rows) == len(methods) * n and n + len(summary["skipped_prompts"]) >= len(summary["categories"])
    assert {r["method"] for r in rows} == methods == set(summary["methods"])
    for row in rows:
        assert all(key in row for key in ROW_FIELDS), set(ROW_FIELDS) - set(row)
        assert 1 <= row["new_tokens"] <= 4 * row["turns"]
    for name in methods:
        block = summary["methods"][name]
        assert all(key in block["overall"] for key in GROUP_FIELDS)
        assert set(block["categories"]) == set(summary["categories"])
    assert ("matches_baseline" in summary) == (cfg.generation.temperature == 0)
    assert summary["complete"] is True and summary["lossless"] is True
    assert (tmp_path / "acceptance_per_position.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "categories.png").read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "| category | speedup | tau | alpha |" in out and "**overall**" in out
    assert result.table in out
    if cfg.compare:
        assert "| method | tok/s | speedup |" in out
    if any(name.startswith("hf_") for name in cfg.compare):
        assert "| specdec / anchor (tokens/s) |" in out
    if cfg.data.source == "spec_bench":
        assert "multi_turn" in summary["categories"]  # the MT-bench categories, reported as one


METHOD_OVERRIDES = {"layer_skip": ["method.proposer.exit_layer=1"],  # the tiny target has 2 layers
                    "medusa": [f"method.heads_path={CONF.parent / 'tests/assets/tiny_random_medusa.safetensors'}"],
                    "eagle": [f"method.heads_path={CONF.parent / 'tests/assets/tiny_random_eagle.safetensors'}"],
                    # its trained part, with heads for the tiny target
                    "hybrid": [f"method.heads_path={CONF.parent / 'tests/assets/tiny_random_eagle.safetensors'}"]}


@pytest.mark.parametrize("method", sorted(p.stem for p in (CONF / "method").glob("*.yaml")))
def test_every_method_runs_on_tiny_models(method, tmp_path):
    if method == "eagle3":  # no EAGLE-3 drafter ships: the run is refused before any model loads, naming the key
        from specdec.study.config import ConfigError

        with pytest.raises(ConfigError, match=r"^method.heads_path: method=eagle3 needs a drafter"):
            _run(tmp_path, f"method={method}")
        return
    if method.startswith("vllm"):  # vLLM's own environment and a target folder: tests/study/test_peers.py
        from specdec.study.config import ConfigError

        with pytest.raises(ConfigError, match=r"^method.decoder: .*(SPECDEC_VLLM_PYTHON|from a folder)"):
            _run(tmp_path, f"method={method}")
        return
    if method == "mtp":  # the tiny targets are built in process, with no MTP weights: refused before any model loads
        from specdec.study.config import ConfigError

        with pytest.raises(ConfigError, match=r"^target.path: method=mtp reads the MTP weights from the target's folder"):
            _run(tmp_path, f"method={method}")
        return
    result = _run(tmp_path, f"method={method}", *METHOD_OVERRIDES.get(method, []))
    s = result.summary
    assert s["method"] == method and s["num_prompts"] == 6
    if method == "autoregressive":  # the baseline alone
        assert {r.method for r in result.rows} == {"autoregressive"} and s["speedup"] == 1.0
        assert s["mean_accepted_length"] == 1.0
    else:  # the method, the baseline, and exact greedy's plain decoding where the method scores wider
        assert len(result.rows) == 12 + 6 * ("exact_greedy_reference" in s)
    if s["lossless"]:
        assert s["matches_baseline"] == 1.0  # greedy and lossless: the baseline's tokens exactly


def test_perfect_draft_accepts_everything_and_matches_the_baseline(tmp_path):
    # a draft with the target's own seed and depth is the target: every draft is accepted
    result = _run(tmp_path, "draft.seed=0", "draft.num_layers=2", "generation.max_new_tokens=12",
                  "method.num_speculative_tokens=3", "target.vocab_size=256")
    s = result.summary
    assert s["acceptance_rate"] == 1.0 and s["matches_baseline"] == 1.0
    assert s["methods"]["draft"]["overall"]["per_position_acceptance"] == [1.0, 1.0, 1.0]
    # 4 per step where all 3 drafts fit; the last step drafts only what can still be emitted less one
    assert 3.0 < s["methods"]["draft"]["overall"]["expected_tokens_per_step"] <= 4.0
    assert 1.0 < s["mean_accepted_length"] <= 4.0  # 4 per step, less where EOS/max_new_tokens cut
    for row in result.rows:
        if row.method == "draft":
            assert row.accepted == row.proposed and 3 * (row.steps - 1) <= row.proposed <= 3 * row.steps
        else:
            assert row.proposed == 0


def test_unrelated_draft_still_matches_the_baseline(tmp_path):
    s = _run(tmp_path, "generation.max_new_tokens=12").summary
    assert s["acceptance_rate"] < 0.2 and s["matches_baseline"] == 1.0


def test_method_and_baseline_alternate_which_goes_first(batch_calls, tmp_path):
    calls = batch_calls
    _run(tmp_path, "data.limit=2", "data.categories=[qa]")
    assert [role for _, role in calls] == ["draft", "autoregressive", REFERENCE, "autoregressive", REFERENCE, "draft"]
    assert calls[0][0] == calls[1][0] == calls[2][0] != calls[3][0] == calls[4][0] == calls[5][0]


def test_multi_turn_continues_the_cache_and_equals_a_fresh_prefill(tmp_path):
    cfg = _cfg(*FAST, "data.categories=[conversation]", "generation.max_new_tokens=6")
    result = experiment.run(cfg, tmp_path)
    setup = experiment.build(cfg)
    assert len(result.rows) == 3  # one conversation, decoded by the method, the baseline and the reference
    for row in result.rows:
        first, second = row.turn_outputs
        assert row.turns == 2 and first.reused_cache_tokens == 0
        assert 0 < second.reused_cache_tokens < second.input_tokens
        assert row.output_token_ids == first.output_token_ids + second.output_token_ids
        # turn 2 decoded from scratch gives the same tokens as turn 2 continued from the cache
        prompt = next(p for p in experiment.load_data(cfg) if p.prompt_id == row.prompt_id)
        ids = build_turn_input(setup.tokenizer, [(prompt.turns[0], first.output_text)], prompt.turns[1])
        assert len(ids) == second.input_tokens
        fresh = setup.baseline.generate([ids], max_new_tokens=6)
        assert fresh.output_ids[0] == second.output_token_ids


def test_batches_give_the_same_greedy_tokens(tmp_path):
    single = _run(tmp_path, "data.limit=2", "generation.max_new_tokens=8", name="b1")
    batched = _run(tmp_path, "data.limit=2", "generation.max_new_tokens=8", "generation.batch_size=3",
                   name="b3")

    def tokens(result):
        return {(r.prompt_id, r.method): r.output_token_ids for r in result.rows}

    assert tokens(single) == tokens(batched)
    wall = sum(r.wall_s for r in batched.rows if r.method == "draft")
    assert math.isclose(batched.summary["methods"]["draft"]["overall"]["wall_s"], wall)


def test_make_batches_keeps_turn_counts_apart():
    prompts = experiment.load_data(_cfg(*FAST, "data.limit=3"))
    batches = experiment.make_batches(prompts, 4)
    assert [p for b in batches for p in b] == prompts
    assert all(len(b) <= 4 and len({len(p.turns) for p in b}) == 1 for b in batches)


def test_partial_results_survive_a_crash(tmp_path, monkeypatch):
    real, calls = experiment.run_batch, []

    def crash_on_fourth(*args):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("boom")
        return real(*args)

    monkeypatch.setattr(experiment, "run_batch", crash_on_fourth)
    with pytest.raises(RuntimeError, match="boom"):
        _run(tmp_path)
    assert len(_rows(tmp_path / "run")) == 3  # the first prompt: the method, the baseline, the reference
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["complete"] is False and summary["error"] == "RuntimeError: boom"
    assert summary["num_prompts"] == 1


def test_a_full_disk_mid_run_keeps_consistent_files_and_says_what_is_kept(tmp_path, monkeypatch):
    real_write, batches = Path.write_text, []

    def disk_full_at_third_batch(self, text, *args, **kwargs):
        if self.name == "results.jsonl.tmp":
            batches.append(1)
        if self.name == "results.jsonl.tmp" and len(batches) >= 3:  # the summary alone still fits
            real_write(self, text[:100], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", disk_full_at_third_batch)
    with pytest.raises(NoSpace, match=r"no space left writing .*run .*up to prompt 2; free some space") as raised:
        _run(tmp_path)
    assert isinstance(raised.value, OSError)
    out = tmp_path / "run"
    summary = json.loads((out / "summary.json").read_text())
    assert len(_rows(out)) == 6 and summary["num_prompts"] == 2  # the two files agree
    assert summary["complete"] is False and summary["error"].startswith("NoSpace: no space left")
    assert not list(out.glob("*.tmp"))


# ---------------------------------------------------------------- what each number means


class FixedTimes:
    """A decoder whose generations report set times, so that what run_batch records can be checked by
    hand. Turn t of a batch of n rows: TTFT ttfts[t], wall 1.0 * (t + 1), row j finished at (j + 1) / n
    of it; two new tokens per row."""

    def __init__(self, ttfts: list[float]):
        self.ttfts, self.turn = ttfts, 0

    def positions_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        return prompt_len + max_new_tokens

    def generate(self, prompts, max_new_tokens, past=None, **sampling):
        n, wall = len(prompts), 1.0 * (self.turn + 1)
        rows = [RowStats(new_tokens=2, steps=1, emitted=1, wall_s=wall * (j + 1) / n) for j in range(n)]
        stats = GenerationStats(rows=rows, ttft_s=self.ttfts[self.turn], wall_s=wall, verify_s=wall / 2)
        self.turn += 1
        return Generation([[7, 8]] * n, [list(p) for p in prompts], stats, state=None, texts=["x y"] * n)


def test_ttft_is_a_latency_each_row_of_a_batch_shares(tmp_path):
    cfg = _cfg(*FAST)
    tokenizer = experiment.build(cfg).tokenizer
    batch = [Prompt(str(i), "qa", ("a question",)) for i in range(3)]
    rows = experiment.run_batch(FixedTimes([0.3]), "baseline", batch, cfg, 0, tokenizer)
    # every row's first token came at the end of the batch's prefill, 0.3 s in
    assert [r.ttft_s for r in rows] == [0.3, 0.3, 0.3]
    assert Totals.of(rows).ttft_s == pytest.approx(0.3)
    # wall time is a share of the batch (the three add up to its 1.0 s); latency is each row's own
    assert [r.wall_s for r in rows] == pytest.approx([1 / 3] * 3)
    assert [r.latency_s for r in rows] == pytest.approx([1 / 3, 2 / 3, 1.0])
    # two turns: TTFT 0.2 s then 0.4 s; a prompt's TTFT is the mean over its turns
    chats = [Prompt(str(i), "conversation", ("first", "second")) for i in range(2)]
    rows = experiment.run_batch(FixedTimes([0.2, 0.4]), "baseline", chats, cfg, 0, tokenizer)
    assert [r.ttft_s for r in rows] == pytest.approx([0.3, 0.3])
    assert [r.wall_s for r in rows] == pytest.approx([(1.0 + 2.0) / 2] * 2)


@pytest.mark.parametrize(("method", "k"), [("hf_assisted", 3), ("hf_prompt_lookup", 5), ("draft", 2),
                                           ("hf_generate", 0), ("autoregressive", 0)])
def test_summary_records_the_k_of_every_drafting_method(method, k):
    cfg = _cfg(f"method={method}", *([f"method.num_speculative_tokens={k}"] if k else []))
    info = experiment.run_info(cfg)
    assert info["num_speculative_tokens"] == k
    rows = [_row("autoregressive"), _row(method)]
    table = format_table(summarize(rows, method, info, greedy=True))
    assert (f", k={k}," in table) == (method != "autoregressive")


def _turns_reused(rows: list[dict], method: str) -> list[int]:
    return [o.reused_cache_tokens for r in rows if r.method == method for o in r.turn_outputs]


def test_anchors_and_specdec_share_one_cache_policy(tmp_path):
    conversation = ["data.categories=[conversation]", "generation.max_new_tokens=6"]
    # hf_generate can continue a conversation's cache: every method does
    reuse = _run(tmp_path, *conversation, "+method@compare.hf_generate=hf_generate", name="reuse")
    assert reuse.summary["cache_reuse"] == "across_turns"
    for method in ("draft", "autoregressive", "hf_generate"):
        first, second = _turns_reused(reuse.rows, method)
        assert first == 0 and second > 0, method
        block = reuse.summary["methods"][method]
        assert block["overall"]["reused_cache_tokens"] == second and block["overall"]["matches_baseline"] == 1.0
    assert "Cache reuse: every method continues" in reuse.table
    # prompt lookup cannot (transformers' assisted decoding): then no method does
    fresh = _run(tmp_path, *conversation, "+method@compare.hf_prompt_lookup=hf_prompt_lookup", name="fresh")
    s = fresh.summary
    assert s["cache_reuse"] == "none" and s["cache_reuse_blocked_by"] == ["hf_prompt_lookup"]
    assert all(n == 0 for m in ("draft", "autoregressive", "hf_prompt_lookup") for n in _turns_reused(fresh.rows, m))
    assert s["methods"]["draft"]["overall"]["matches_baseline"] == 1.0
    assert "Cache reuse: none; every method prefills each turn's whole conversation, since hf_prompt_lookup" \
        in fresh.table
    assert json.loads((tmp_path / "fresh" / "summary.json").read_text())["cache_reuse"] == "none"


# ---------------------------------------------------------------- W&B


@pytest.fixture
def wandb_env(monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")


def test_wandb_offline_run_holds_summary_json(tmp_path, wandb_env):
    result = _run(tmp_path, "logger=wandb", "plots=true")
    assert result.wandb_run_dir is not None and result.wandb_run_dir.is_relative_to(tmp_path)
    logged = read_offline_summary(result.wandb_run_dir)
    local = flatten(json.loads((tmp_path / "run" / "summary.json").read_text()))
    assert local["speedup"] == pytest.approx(logged["speedup"])
    for key, value in local.items():
        assert key in logged, key
        assert logged[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    assert "results" in logged and "plots/categories" in logged  # the table and the plots


@pytest.mark.parametrize("where", ["init", "log"])
def test_failing_wandb_loses_no_local_result(tmp_path, wandb_env, monkeypatch, caplog, where):
    import wandb

    def broken(*args, **kwargs):
        raise RuntimeError("wandb is down")

    if where == "init":
        monkeypatch.setattr(wandb, "init", broken)
    else:
        monkeypatch.setattr(wandb.Run, "log", broken)
    with caplog.at_level(logging.WARNING, logger="specdec"):
        result = _run(tmp_path, "logger=wandb")
    assert "W&B failed" in caplog.text and "wandb is down" in caplog.text
    assert len(_rows(tmp_path / "run")) == 18
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["speedup"] == result.summary["speedup"]


def test_sigterm_mid_run_saves_the_results_and_fails_the_wandb_run(tmp_path, wandb_env, monkeypatch):
    real, calls = experiment.run_batch, []

    def sigterm_on_fourth(*args):
        calls.append(1)
        if len(calls) == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args)

    monkeypatch.setattr(experiment, "run_batch", sigterm_on_fourth)
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated) as raised:
        _run(tmp_path, "logger=wandb")
    assert raised.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is previous  # the handler is the run's only
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["complete"] is False and summary["error"] == "Terminated: received SIGTERM"
    assert len(_rows(tmp_path / "run")) == 3  # the first prompt, every decoder; the fourth batch never ended
    run = inspect_offline_run(next((tmp_path / "run" / "wandb").glob("offline-run-*")))
    assert run["state"] == "failed" and run["exit_code"] == 128 + signal.SIGTERM
    assert run["summary"]["error"] == summary["error"] and run["summary"]["num_prompts"] == 1


@pytest.mark.slow
def test_sigterm_from_outside_ends_the_process_as_killed(tmp_path, wandb_env):
    # what Slurm and `timeout` send: the job stops at once, as a failure, with what it had measured
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(CONF.parent), "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    args = [*FAST, "logger=wandb", "data.limit=null", "generation.max_new_tokens=128", "threads=1",
            f"hydra.run.dir={out}"]
    proc = subprocess.Popen([sys.executable, "-m", "specdec", *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (out / "results.jsonl").exists():  # the first batch is measured: 36 prompts to go
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] is False and summary["error"] == "Terminated: received SIGTERM"
    rows = _rows(out)
    assert 2 <= len(rows) < 72 and summary["num_prompts"] == len(rows) // 2
    run = inspect_offline_run(next((out / "wandb").glob("offline-run-*")))
    assert run["state"] == "failed" and run["exit_code"] == 128 + signal.SIGTERM
    assert run["summary"]["error"] == summary["error"] and run["summary"]["complete"] is False


# ---------------------------------------------------------------- summary arithmetic


def _row(method, prompt_id="p", category="qa", steps=10, proposed=0, accepted=0, emitted=10, wall=1.0,
         draft=0.0, verify=0.5, acc_at=(), reached_at=(), out=(1, 2, 3), lossless=True, **fields) -> PromptResult:
    """A result as an older version wrote it to results.jsonl (no per-step lists): it still reads.
    `fields`: other keys of the line (per-step lists, turns, ttft_s), or ones that replace these."""
    return PromptResult.from_dict({"prompt_id": prompt_id, "category": category, "method": method, "new_tokens": emitted + 1,
            "wall_s": wall, "ttft_s": 0.1, "steps": steps, "proposed": proposed, "accepted": accepted,
            "emitted": emitted, "draft_s": draft, "verify_s": verify, "accepted_per_position": list(acc_at),
            "reached_per_position": list(reached_at), "output_token_ids": list(out), "lossless": lossless,
            "verifier": "greedy" if lossless else "typical", **fields})


def test_expected_tokens_per_step():
    assert expected_tokens_per_step([1.0, 1.0, 1.0, 1.0]) == 5.0
    assert expected_tokens_per_step([0.5, 0.5]) == 1 + 0.5 + 0.25
    # a proposer that drafts at only half of the steps (n-gram lookup with no match elsewhere)
    assert expected_tokens_per_step([1.0, 1.0], drafted=[0.5, 0.5]) == 2.0
    assert expected_tokens_per_step([]) == 1.0
    assert expected_tokens_per_step([0.8, float("nan")]) == 1.8


def test_cost_model_and_predicted_speedup():
    # baseline: 20 steps of 1 token, 0.05 s each. method: 5 steps of k=2 drafts, per-position (1.0, 0.5)
    base = _row("autoregressive", steps=20, emitted=20, wall=1.2, verify=1.0)
    method = _row("draft", steps=5, proposed=10, accepted=7, emitted=12, wall=0.6, draft=0.1, verify=0.4,
                  acc_at=(5, 2), reached_at=(5, 4))
    m = MethodSummary.measure([method], [base], greedy=True)
    t_base = 1.0 / 20
    assert m.per_position_acceptance == [1.0, 0.5]
    assert m.acceptance_rate == 0.7 and m.mean_accepted_length == 12 / 5
    assert m.c == pytest.approx((0.1 / 10) / t_base)  # one draft token costs 0.2 target steps
    assert m.verify_cost == pytest.approx((0.4 / 5) / t_base)
    expected = 1 + 1.0 + 0.5
    assert m.predicted_speedup == pytest.approx(expected * t_base / (0.1 / 5 + 0.4 / 5))
    # the same through the Leviathan form E / (c k + verify_cost)
    assert m.predicted_speedup == pytest.approx(expected / (m.c * 2 + m.verify_cost))
    assert m.speedup == pytest.approx((13 / 0.6) / (21 / 1.2))
    assert m.matches_baseline == 1.0
    assert m.measured_over_predicted == pytest.approx(m.speedup / m.predicted_speedup)
    written = _jsonable(m.to_dict())  # as summary.json holds it (NaN as null): it reads back
    assert _jsonable(MethodSummary.from_dict(json.loads(json.dumps(written))).to_dict()) == written


def test_summary_marks_lossy_methods_and_counts_mismatches():
    rows = [_row("autoregressive", "a"), _row("autoregressive", "b", category="rag"),
            _row("typical", "a", proposed=4, accepted=2, acc_at=(2,), reached_at=(4,), lossless=False),
            _row("typical", "b", category="rag", proposed=4, accepted=2, acc_at=(2,), reached_at=(4,),
                 out=(9,), lossless=False)]
    s = summarize(rows, "typical", {"num_speculative_tokens": 1}, greedy=True)
    assert s["lossless"] is False and s["verifier"] == "typical"
    assert s["matches_baseline"] == 0.5
    assert s["methods"]["typical"]["categories"]["rag"]["matches_baseline"] == 0.0
    table = format_table(s)
    assert "typical (lossy)" in table and "| rag |" in table and "| qa |" in table


def test_a_line_without_per_step_lists_leaves_vllms_per_step_metrics_unknown():
    """An older results.jsonl line has the counts but not the per-step lists: alpha, tau and the
    per-position acceptance still follow from the counts; vLLM's metrics over steps that drafted
    cannot, and read as unknown, not as 'nothing drafted' (1.0, an empty histogram)."""
    old = _row("draft", steps=5, proposed=10, accepted=7, emitted=12, acc_at=(5, 2), reached_at=(5, 4))
    assert old.acceptance_rate == 0.7 and old.mean_accepted_length == 12 / 5
    assert math.isnan(old.mean_acceptance_length) and old.acceptance_histogram == []
    m = MethodSummary.measure([old], [_row("autoregressive", steps=20, emitted=20)], greedy=True)
    assert m.num_spec_steps is None and math.isnan(m.mean_acceptance_length)
    assert len(m.per_position_acceptance_rate) == 2 and all(math.isnan(x) for x in m.per_position_acceptance_rate)
    assert m.per_position_acceptance == [1.0, 0.5] and m.acceptance_histogram_by_draft_length == {}
    # nothing drafted is known without the lists: plain decoding keeps vLLM's 1.0
    plain = _row("autoregressive")
    assert plain.mean_acceptance_length == 1.0 and plain.counts.num_spec_steps == 0
    listed = _row("draft", steps=2, proposed=4, accepted=3, emitted=5, acc_at=(2, 1), reached_at=(2, 2),
                  draft_lengths=[2, 2], accepted_lengths=[2, 1])
    assert listed.mean_acceptance_length == 2.5 and listed.acceptance_histogram == [0, 1, 1]


def test_per_prompt_speedup_spread_is_the_median_min_and_max_over_prompts():
    # baseline 20 tokens/s on each prompt; the method 20, 40 and 80: per-prompt speedups 1, 2 and 4
    # (mean 2.33), while the pooled speedup is 60 tokens in 1.75 s against 60 in 3 s
    rows = [_row("autoregressive", p, steps=19, emitted=19, wall=1.0) for p in "abc"]
    rows += [_row("draft", p, steps=19, emitted=19, wall=w) for p, w in zip("abc", (1.0, 0.5, 0.25))]
    m = MethodSummary.measure(rows[3:], rows[:3], greedy=True)
    assert (m.speedup_median, m.speedup_min, m.speedup_max) == (2.0, 1.0, 4.0)
    assert m.speedup == pytest.approx((60 / 1.75) / 20)
    table = format_comparison(summarize(rows, ["draft"], {}, greedy=True))
    draft = next(line for line in table.splitlines() if line.startswith("| draft |"))
    # its interval (three prompts: from all of a to all of c) holds 1.0: marked
    assert "| 1.71x [1.00, 4.00]~ | 2.00 (1.00-4.00) |" in draft


def test_ttft_is_the_mean_over_prompts():
    rows = [_row("draft", p, ttft_s=t) for p, t in zip("abc", (0.1, 0.2, 0.6))]
    assert Totals.of(rows).ttft_s == pytest.approx(0.3)  # the median would be 0.2
    assert MethodSummary.measure(rows, rows, greedy=True).ttft_s == pytest.approx(0.3)


def test_each_category_is_measured_against_the_baseline_on_its_own_prompts():
    # baseline: qa at 20 tokens/s, rag at 80; the method: qa at 40, rag at 80. Against the pooled
    # baseline (40 tokens in 1.25 s) qa would read 1.25x and rag 2.5x.
    rows = [_row("autoregressive", "a", "qa", steps=19, emitted=19, wall=1.0),
            _row("autoregressive", "b", "rag", steps=19, emitted=19, wall=0.25),
            # qa: 5 steps, 3 of which drafted 2 (all accepted) and 2 nothing: tau = 8 / 5, vLLM's 1 + 6 / 3
            _row("draft", "a", "qa", steps=5, proposed=6, accepted=6, emitted=8, wall=0.5, acc_at=(3, 3),
                 reached_at=(3, 3), new_tokens=20, draft_lengths=[2, 0, 2, 0, 2], accepted_lengths=[2, 0, 2, 0, 2]),
            _row("draft", "b", "rag", steps=19, emitted=19, wall=0.25)]
    s = summarize(rows, "draft", {}, greedy=True)
    assert s["per_category"]["qa"]["speedup"] == pytest.approx(2.0)
    assert s["per_category"]["rag"]["speedup"] == pytest.approx(1.0)
    assert s["methods"]["draft"]["categories"]["qa"]["speedup"] == pytest.approx(2.0)
    assert s["speedup"] == pytest.approx((40 / 0.75) / (40 / 1.25))
    assert s["per_category"]["qa"]["mean_accepted_length"] == pytest.approx(8 / 5)  # tau, not vLLM's 3.0
    assert s["methods"]["draft"]["categories"]["qa"]["mean_acceptance_length"] == pytest.approx(3.0)


def test_predicted_speedup_with_prefill_counts_every_turns_prefill():
    # one conversation of two turns, TTFT 0.1 s each (ttft_s is their mean): 0.2 s of prefill for the
    # 2 tokens the prefills give; the other 19 at E = 1 + 1 + 0.5 per 0.1 s step (0.1 + 0.4 s over 5)
    base = _row("autoregressive", steps=19, emitted=19, new_tokens=21, wall=1.05, verify=0.95, turns=2)
    method = _row("draft", steps=5, proposed=10, accepted=7, emitted=19, new_tokens=21, wall=0.9, draft=0.1,
                  verify=0.4, acc_at=(5, 2), reached_at=(5, 4), turns=2)
    m = MethodSummary.measure([method], [base], greedy=True)
    seconds = 0.2 + 19 / 2.5 * 0.1
    assert m.predicted_speedup_with_prefill == pytest.approx((21 / seconds) / (21 / 1.05))


def test_plain_decoding_predicts_no_speedup():
    base = [_row("autoregressive", p) for p in "ab"]
    m = MethodSummary.measure(base, base, greedy=True)
    assert m.speedup == 1.0 and m.predicted_speedup == 1.0 and m.predicted_speedup_with_prefill == 1.0
    assert math.isnan(m.c) and math.isnan(m.measured_over_predicted)  # nothing drafted: no draft cost
    assert math.isnan(MethodSummary.measure([], base, greedy=True).predicted_speedup)  # nothing ran


def test_table_columns_hold_their_numbers():
    # the case of test_cost_model_and_predicted_speedup: the method 13 tokens in 0.6 s, the baseline 21 in 1.2 s
    rows = [_row("autoregressive", steps=20, emitted=20, wall=1.2, verify=1.0),
            _row("draft", steps=5, proposed=10, accepted=7, emitted=12, wall=0.6, draft=0.1, verify=0.4,
                 acc_at=(5, 2), reached_at=(5, 4))]
    table = format_table(summarize(rows, "draft", {"num_speculative_tokens": 2}, greedy=True))
    lines = table.splitlines()
    assert lines[2] == ("| category | speedup | tau | alpha | predicted | c | tok/s | base tok/s | prompts | steps "
                        "| = baseline |")
    # speedup (13 / 0.6) / 17.5, tau 12 / 5, alpha 7 / 10, predicted 2.5 * 0.05 / 0.1, c 0.01 / 0.05; one
    # prompt of 5 steps: no interval, marked (tests/study/test_intervals.py)
    assert lines[-3] == "| **overall** | 1.24x~ | 2.40~ | 0.70~ | 1.25x | 0.20 | 21.7 | 17.5 | 1 | 5 | 100% |"
    assert lines[-1].startswith("[low, high]: 95% interval")


def test_a_prompt_result_takes_its_share_of_the_batch_times():
    # three rows decoded together: each row's wall, draft, verify and CPU seconds are a third of the batch's
    rows = [RowStats(new_tokens=2, steps=1, emitted=1, wall_s=0.4 * (j + 1)) for j in range(3)]
    stats = GenerationStats(rows=rows, ttft_s=0.1, draft_s=0.3, verify_s=0.6, wall_s=1.2, cpu_s=0.9)
    gen = Generation([[7, 8]] * 3, [[1, 2]] * 3, stats, state=None, texts=["x y"] * 3)
    r = PromptResult.from_generations("p", "qa", "draft", 0, [gen], row=1)
    assert (r.wall_s, r.draft_s, r.verify_s, r.cpu_s) == pytest.approx((0.4, 0.1, 0.2, 0.3))
    assert r.latency_s == pytest.approx(0.8) and r.ttft_s == 0.1  # latencies are the row's own, not shares


def test_hf_source_with_a_local_file(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": q, "topic": t}) + "\n"
                            for q, t in [("t5 t6 t7", "a"), ("t9 t9", "b"), (["t3 t4", "t8"], "b")]))
    result = _run(tmp_path, "data=hf", f"data.path={data}", "data.text_field=question",
                  "data.category_field=topic", "data.limit=null")
    assert result.summary["categories"] == ["a", "b"] and result.summary["num_prompts"] == 3
    assert sorted({r.prompt_id for r in result.rows}) == ["0", "1", "2"]  # no id_field: the row index
    assert sorted(r.turns for r in result.rows) == [1, 1, 1, 1, 1, 1, 2, 2, 2]  # three decoders
