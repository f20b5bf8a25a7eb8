"""95% intervals: the bootstrap against cases with a known answer, the marks where they belong, and a
`repeats=3` run on the tiny target whose summary.json, table.csv, table and `compare` output (markdown
and LaTeX) carry intervals and counts."""

from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from specdec.study import compare, experiment, intervals
from specdec.study.report import MARK, format_comparison, format_table, interval_cell, summarize
from specdec.study.results import MethodSummary, PromptResult

CONF = Path(__file__).resolve().parents[2] / "conf"
TINY = ["~experiment", "target=tiny_random", "draft=tiny_random", "logger=none", "plots=false", "warmup=false",
        "dtype=float32"]


def _row(method, prompt_id, tokens, wall, steps, emitted=None, proposed=0, accepted=0, category="qa", repeat=0):
    return PromptResult.from_dict({
        "prompt_id": prompt_id, "category": category, "method": method, "repeat": repeat, "new_tokens": tokens,
        "wall_s": wall, "steps": steps, "emitted": tokens - 1 if emitted is None else emitted,
        "proposed": proposed, "accepted": accepted, "output_token_ids": [1, 2], "verifier": "greedy"})


# ---------------------------------------------------------------- the bootstrap


def test_identical_prompts_give_a_zero_width_interval():
    rows = [_row("ngram", f"p{i}", 41, 0.5, 20, proposed=60, accepted=20) for i in range(12)]
    base = [_row("autoregressive", f"p{i}", 41, 1.0, 40) for i in range(12)]
    m = MethodSummary.measure(rows, base, greedy=True)
    assert m.speedup == pytest.approx(2.0)
    for name in ("speedup", "mean_accepted_length", "acceptance_rate", "tokens_per_s"):
        low, high = m.interval(name)
        assert low == pytest.approx(getattr(m, name)) and high == pytest.approx(getattr(m, name)), name


def test_a_normal_samples_percentile_interval_is_the_analytic_one():
    rng = np.random.default_rng(7)
    n = 400
    x = rng.normal(5.0, 1.0, n)
    weights = intervals.resample_weights([0] * n)
    low, high = intervals.ratio_interval(weights, x, np.ones(n))  # the mean, as a ratio of sums
    half = 1.959964 * x.std(ddof=1) / math.sqrt(n)
    assert low == pytest.approx(x.mean() - half, abs=0.1 * half)
    assert high == pytest.approx(x.mean() + half, abs=0.1 * half)


def test_resampling_is_seeded_and_keeps_the_unit_count():
    groups = [0] * 5 + [1] * 3
    w = intervals.resample_weights(groups)
    assert np.array_equal(w, intervals.resample_weights(groups))  # fixed seed
    assert not np.array_equal(w, intervals.resample_weights(groups, seed=1))
    assert w.shape == (intervals.RESAMPLES, 8) and set(w.sum(axis=1)) <= {6.0, 8.0, 10.0}  # 2 repeats drawn


def test_repeats_are_resampled_before_prompts():
    # two repeats of the same prompts: in one the method was 2x, in the other 1x. Drawing whole repeats
    # puts about a quarter of the resamples at each end: the interval spans both, not their mean alone.
    rows, base = [], []
    for repeat, wall in ((0, 0.5), (1, 1.0)):
        rows += [_row("ngram", f"p{i}", 41, wall, 20, repeat=repeat) for i in range(30)]
        base += [_row("autoregressive", f"p{i}", 41, 1.0, 40, repeat=repeat) for i in range(30)]
    m = MethodSummary.measure(rows, base, greedy=True)
    assert m.num_repeats == 2 and m.num_prompts == 30
    assert m.speedup_ci_low == pytest.approx(1.0) and m.speedup_ci_high == pytest.approx(2.0)


def test_speedup_pairs_each_prompt_with_the_baseline_in_its_repeat():
    # each prompt's own speed varies 10-fold, the method is always exactly 1.5x on it: paired by prompt,
    # every resample is 1.5x; drawing the method's and the baseline's prompts apart would spread it
    speeds = [random.Random(i).uniform(1, 10) for i in range(20)]
    rows = [_row("ngram", f"p{i}", 31, 1.0 / (1.5 * s), 10) for i, s in enumerate(speeds)]
    base = [_row("autoregressive", f"p{i}", 31, 1.0 / s, 30) for i, s in enumerate(speeds)][::-1]  # any order
    low, high = MethodSummary.measure(rows, base, greedy=True).interval("speedup")
    assert low == pytest.approx(1.5) and high == pytest.approx(1.5)


def test_one_prompt_has_no_interval():
    m = MethodSummary.measure([_row("ngram", "p", 41, 0.5, 20)], [_row("autoregressive", "p", 41, 1.0, 40)], True)
    assert math.isnan(m.speedup_ci_low) and math.isnan(m.speedup_ci_high)


# ---------------------------------------------------------------- the marks


def test_marks_fall_where_the_interval_holds_one_or_steps_are_few():
    assert interval_cell(1.36, 1.21, 1.50, 400, ".2f", "x", null=1.0) == "1.36x [1.21, 1.50]"
    assert interval_cell(1.26, 0.95, 1.60, 400, ".2f", "x", null=1.0) == f"1.26x [0.95, 1.60]{MARK}"
    assert interval_cell(1.36, 1.21, 1.50, intervals.MIN_STEPS - 1, ".2f", "x", null=1.0).endswith(MARK)
    assert interval_cell(1.02, 1.01, 1.03, 400, ".2f") == "1.02 [1.01, 1.03]"  # tau: no null to include
    assert interval_cell(1.36, float("nan"), float("nan"), 400, ".2f", "x", null=1.0) == f"1.36x{MARK}"
    # steps summed over 3 repeats: 120 are 40 a repeat, too few
    assert interval_cell(1.36, 1.21, 1.50, 120, ".2f", "x", null=1.0, repeats=3).endswith(MARK)
    assert interval_cell(1.36, 1.21, 1.50, 120, ".2f", "x", null=1.0, with_interval=False) == "1.36x"


def test_table_marks_noise_and_explains_it():
    # qa: a clear 2x on many steps; rag: 1.26x on two prompts that disagree (0.9x and 1.8x), few steps
    rows = []
    for i in range(10):
        rows += [_row("ngram", f"q{i}", 61, 0.5, 30, proposed=90, accepted=30),
                 _row("autoregressive", f"q{i}", 61, 1.0, 60)]
    for i, wall in enumerate((1.1, 0.55)):
        rows += [_row("ngram", f"r{i}", 11, wall, 9, emitted=10, proposed=18, accepted=1, category="rag"),
                 _row("autoregressive", f"r{i}", 11, 1.0, 10, category="rag")]
    summary = summarize(rows, "ngram", {"num_speculative_tokens": 2}, greedy=True)
    lines = format_table(summary).splitlines()
    qa, rag = (next(line for line in lines if line.startswith(f"| {c} ")) for c in ("qa", "rag"))
    assert "2.00x [2.00, 2.00] |" in qa and MARK not in qa
    assert " | 10 | 300 | " in qa  # prompts, steps
    assert f"]{MARK} |" in rag and " | 2 | 18 | " in rag
    assert any(line.startswith("[low, high]: 95% interval") and f"{MARK}:" in line for line in lines)
    assert "| ngram | " in format_comparison(summary) and "[low, high]" in format_comparison(summary)


def test_summaries_from_before_intervals_show_plain_values():
    rows = [_row("ngram", f"p{i}", 41, 0.5, 20) for i in range(3)] + \
        [_row("autoregressive", f"p{i}", 41, 1.0, 40) for i in range(3)]
    summary = summarize(rows, "ngram", {}, greedy=True)
    for block in summary["methods"].values():  # what an older summary.json held: no intervals, no repeats
        for group in [block["overall"], *block["categories"].values()]:
            for key in [k for k in group if "_ci_" in k] + ["num_repeats"]:
                del group[key]
    table = format_table(summary)
    assert "[" not in table.split("\n\n")[1] and MARK not in table and "[low, high]" not in table


# ---------------------------------------------------------------- a run with repeats


@pytest.fixture(scope="module")
def repeated_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("repeats") / "run"
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*TINY, "method=ngram", "data.limit=2", "data.categories=[qa,rag]",
                                           "generation.max_new_tokens=8", "repeats=3"])
    return experiment.run(cfg, out)


def test_repeats_run_every_prompt_n_times_and_rotate_the_order(batch_calls, repeated_run, tmp_path):
    rows = [json.loads(line) for line in (repeated_run.out_dir / "results.jsonl").read_text().splitlines()]
    units = {(r["method"], r["repeat"], r["prompt_id"]) for r in rows}
    assert len(units) == len(rows) == 3 * 4 * len({r["method"] for r in rows})
    # the same prompt, the same seed: greedy tokens equal from repeat to repeat
    by = {(r["method"], r["repeat"], r["prompt_id"]): r["output_token_ids"] for r in rows}
    assert all(by[(m, k, p)] == by[(m, 0, p)] for m, k, p in units)

    calls = batch_calls
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*TINY, "method=ngram", "data.limit=1", "data.categories=[qa]",
                                           "generation.max_new_tokens=4", "repeats=2", "engine.exact_greedy=false"])
    experiment.run(cfg, tmp_path / "order")
    assert [role for _, role in calls] == ["ngram", "autoregressive", "autoregressive", "ngram"]


def test_repeats_summary_csv_and_table_carry_intervals_and_counts(repeated_run):
    s = repeated_run.summary
    assert s["repeats"] == 3 and s["num_prompts"] == 4 and s["num_repeats"] == 3
    assert s["intervals"]["resampled"] == "repeats, then prompts within them"
    assert s["speedup_ci_low"] <= s["speedup"] <= s["speedup_ci_high"]
    assert s["mean_accepted_length_ci_low"] <= s["mean_accepted_length"] <= s["mean_accepted_length_ci_high"]
    assert s["steps"] > 0 and s["per_category"]["qa"]["num_prompts"] == 2
    on_disk = json.loads((repeated_run.out_dir / "summary.json").read_text())
    qa = on_disk["methods"]["ngram"]["categories"]["qa"]
    assert qa["speedup_ci_low"] <= qa["speedup"] <= qa["speedup_ci_high"] and qa["num_repeats"] == 3

    with open(repeated_run.out_dir / "table.csv", newline="", encoding="utf-8") as f:
        table = list(csv.DictReader(f))
    overall = next(r for r in table if r["method"] == "ngram" and r["category"] == "overall")
    assert float(overall["speedup_ci_low"]) == pytest.approx(s["speedup_ci_low"])
    assert float(overall["acceptance_rate_ci_high"]) == pytest.approx(s["acceptance_rate_ci_high"])
    assert overall["num_prompts"] == "4" and overall["num_repeats"] == "3" and int(overall["steps"]) == s["steps"]

    printed = repeated_run.table
    assert "4 prompts x 3 repeats" in printed
    line = next(x for x in printed.splitlines() if x.startswith("| **overall**"))
    assert f"{s['speedup']:.2f}x [{s['speedup_ci_low']:.2f}, {s['speedup_ci_high']:.2f}]" in line
    assert f" | 4 | {s['steps']} | " in line
    assert "a bootstrap over 3 repeats, then prompts within them" in printed
    assert (repeated_run.out_dir / "table.md").read_text() == printed + "\n"


def test_compare_table_csv_and_latex_carry_intervals(repeated_run, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert compare.main([str(repeated_run.out_dir), "--out", str(out), "--latex", str(tmp_path / "t.tex")]) == 0
    printed = capsys.readouterr().out
    s = repeated_run.summary
    row = next(x for x in printed.splitlines() if x.startswith("| run | ngram |"))
    assert f"| {s['speedup']:.2f}x [{s['speedup_ci_low']:.2f}, {s['speedup_ci_high']:.2f}]" in row
    assert f"| 4 | {s['steps']} |" in row  # prompts, steps
    qa = s["methods"]["ngram"]["categories"]["qa"]
    assert f"{qa['speedup']:.2f}x [{qa['speedup_ci_low']:.2f}, {qa['speedup_ci_high']:.2f}]" in row
    assert "[low, high]: 95% interval" in printed

    with open(out / "compare.csv", newline="", encoding="utf-8") as f:
        first = next(csv.DictReader(f))
    assert float(first["qa/speedup_ci_high"]) == pytest.approx(qa["speedup_ci_high"])
    assert first["qa/num_prompts"] == "2" and first["num_repeats"] == "3"

    tex = (tmp_path / "t.tex").read_text()
    assert "\\toprule" in tex and "\\midrule" in tex and "\\bottomrule" in tex
    assert "\\multicolumn{2}{c}{qa}" in tex and "\\multicolumn{2}{c}{overall}" in tex
    body = next(x for x in tex.splitlines() if x.startswith("ngram &"))
    assert body.startswith("ngram & \\checkmark & ")
    assert f"{s['speedup']:.2f}$\\times$ {{\\scriptsize [{s['speedup_ci_low']:.2f}, {s['speedup_ci_high']:.2f}]}}" in body
    assert f"& {s['mean_accepted_length']:.2f} \\\\" in body  # tau, overall, last
    # a tiny run's categories rest on a few steps each: marked, and the caption says why
    assert "$^\\dagger$" in body and "fewer than 50 steps" in tex
    assert not (out / "compare.tex").exists()  # --latex put it elsewhere


def test_compare_latex_escapes_names_and_marks_lossy_methods():
    rows = [{"method": "hf_prompt_lookup", "label": "hf_prompt_lookup", "lossless": False, "speedup": 1.2,
             "mean_accepted_length": 1.5, "num_repeats": 1, "steps": 500, "speedup_ci_low": 1.1,
             "speedup_ci_high": 1.3, "qa/speedup": 1.2}]
    tex = compare.latex_table(rows, ["qa"])
    assert "hf\\_prompt\\_lookup & $\\times$ & " in tex
    assert "1.20$\\times$ {\\scriptsize [1.10, 1.30]} & 1.50" in tex
