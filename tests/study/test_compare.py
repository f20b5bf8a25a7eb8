"""`python -m specdec.study.compare`: finds runs under run and sweep folders, tabulates every method with its
arguments, writes a CSV and a plot whose numbers are the summaries' own, marks unfinished runs, falls
back to Hydra's files for summaries without method arguments, and reproduces the benchmarks study's
tables from its run folder."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specdec.study import compare, experiment
from specdec.study.report import summarize
from specdec.study.results import PromptResult

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
FAST = ["experiment=tiny_smoke", "generation.max_new_tokens=6", "plots=false", "warmup=false",
        "data.categories=[qa,rag]"]


def _row(method, prompt_id, category, new_tokens, wall, steps, proposed=0, accepted=0, lossless=True):
    return PromptResult.from_dict({"prompt_id": prompt_id, "category": category, "method": method, "new_tokens": new_tokens,
            "wall_s": wall, "ttft_s": 0.01, "steps": steps, "proposed": proposed, "accepted": accepted,
            "emitted": new_tokens - 1, "draft_s": 0.1 * wall if proposed else 0.0, "verify_s": 0.8 * wall,
            "accepted_per_position": [accepted], "reached_per_position": [steps if proposed else 0],
            "output_token_ids": [1, 2], "lossless": lossless, "verifier": "greedy" if lossless else "typical"})


def _summary(method: str, method_wall: float, k: int, complete: bool = True, lossless: bool = True,
             configs: bool = True) -> dict:
    """A summary made by report.summarize from hand-made rows: baseline 20 tokens per second per prompt."""
    rows = []
    for pid, cat in (("a", "qa"), ("b", "rag")):
        rows.append(_row("autoregressive", pid, cat, 20, 1.0, 20))
        rows.append(_row(method, pid, cat, 20, method_wall if cat == "qa" else 2 * method_wall, 10,
                         proposed=10 * k, accepted=9, lossless=lossless))
    info = {"target": "tiny_random", "target_path": "tiny_random", "draft": "tiny_random",
            "draft_path": "tiny_random", "num_speculative_tokens": k, "schedule": "constant", "data": "builtin",
            "temperature": 0.0, "dtype": "float32"}
    if configs:
        info["method_configs"] = {method: {
            "name": method, "proposer": {"_target_": "specdec.proposers.ngram.NgramProposer", "max_ngram": 3},
            "decoder": None, "num_speculative_tokens": k, "schedule": "heuristic", "schedule_args": {},
            "verifier": "auto", "verifier_args": {}, "needs_draft": False}}
    s = summarize(rows, method, info, greedy=True)
    s["complete"] = complete
    return s


def _write(folder: Path, summary: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def _csv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_hand_made_sweep_table_csv_and_plot_hold_the_summaries_numbers(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    s0 = _summary("ngram", 0.5, k=2)
    s1 = _summary("ngram", 0.8, k=4, complete=False)
    s10 = _summary("typical", 0.4, k=3, lossless=False)
    _write(sweep / "0", s0)
    _write(sweep / "1", s1)
    _write(sweep / "10", s10)
    (sweep / "2" / ".hydra").mkdir(parents=True)  # a job that died before writing anything
    out = tmp_path / "out"
    assert compare.main([str(sweep), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| run | method | arguments | target | draft | dtype | T | speedup |")
    assert lines[0].rstrip(" |").endswith("| qa | rag")
    # job folders in numeric order; one row each (the baseline only with --baseline)
    assert [line.split(" | ")[0] for line in lines[1:]] == ["| 0", "| 1 (incomplete)", "| 10"]
    o0, o1 = (s["methods"]["ngram"]["overall"] for s in (s0, s1))
    assert f"| {s0['speedup']:.2f}x [{o0['speedup_ci_low']:.2f}, {o0['speedup_ci_high']:.2f}]" in lines[1]
    assert f"| {s1['speedup']:.2f}x [{o1['speedup_ci_low']:.2f}, {o1['speedup_ci_high']:.2f}]" in lines[2]
    assert "k=2 heuristic greedy max_ngram=3" in lines[1] and "typical (lossy)" in lines[3]
    qa = s0["methods"]["ngram"]["categories"]["qa"]  # one prompt of 10 steps: no interval, marked
    assert f"| {qa['speedup']:.2f}x~ ({qa['mean_accepted_length']:.2f}) |" in lines[1]
    assert re.search(r"no summary\.json \(failed or not started\): .*sweep/2", printed)

    rows = _csv(out / "compare.csv")
    assert [r["run"] for r in rows] == ["0", "1 (incomplete)", "10"]
    for row, s in zip(rows, (s0, s1, s10)):
        o = s["methods"][s["method"]]["overall"]
        for key in ("speedup", "tokens_per_s", "mean_accepted_length", "acceptance_rate", "predicted_speedup"):
            assert float(row[key]) == pytest.approx(o[key]), key
        for cat in ("qa", "rag"):
            assert float(row[f"{cat}/speedup"]) == pytest.approx(s["methods"][s["method"]]["categories"][cat]["speedup"])
        assert float(row["baseline_tokens_per_s"]) == pytest.approx(s["baseline_tokens_per_s"])
    assert [r["complete"] for r in rows] == ["True", "False", "True"]
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"


def test_baseline_rows_and_chosen_columns(tmp_path):
    run = _write(tmp_path / "run", _summary("ngram", 0.5, k=2))
    result = compare.compare([run], columns=["method", "base_tok/s", "=baseline", "c"], with_baseline=True)
    assert [r["method"] for r in result.rows] == ["ngram", "autoregressive"]
    assert result.rows[1]["speedup"] == 1.0 and result.rows[1]["args"] == "-"
    assert result.table.splitlines()[0] == "| method | base tok/s | = baseline | c | qa | rag |"
    assert "| ngram | 20.0 | 100% |" in result.table  # the baseline: 20 tokens in 1.0 s per prompt


def test_method_arguments_fall_back_to_hydra_files_for_older_summaries(tmp_path):
    old = _summary("ngram", 0.5, k=2, configs=False)
    composed = _write(tmp_path / "composed", old)
    (composed / ".hydra").mkdir()
    (composed / ".hydra" / "config.yaml").write_text(
        "method:\n  name: ngram\n  proposer:\n    _target_: specdec.proposers.ngram.NgramProposer\n"
        "    max_ngram: 5\n  decoder: null\n  num_speculative_tokens: 2\n  schedule: cost_aware\n"
        "  schedule_args: {}\n  verifier: auto\n  verifier_args: {}\n  needs_draft: false\n"
        "compare: {}\ndata:\n  path: ${oc.env:NOT_SET_ANYWHERE,x}\n")
    overridden = _write(tmp_path / "overridden", old)
    (overridden / ".hydra").mkdir()
    (overridden / ".hydra" / "overrides.yaml").write_text("- method=ngram\n- method.proposer.exit_layer=4\n")
    _write(tmp_path / "bare", old)
    rows = {r["run"]: r for r in compare.compare([tmp_path]).rows}
    assert rows["composed"]["args"] == "k=2 cost_aware greedy max_ngram=5"
    assert rows["overridden"]["args"] == "k=2 constant greedy exit_layer=4"  # summary's k and schedule
    assert rows["bare"]["args"] == "k=2 constant greedy"


@pytest.mark.parametrize("args, message", [
    (["{tmp}/nowhere"], "no such file or folder"),
    (["{tmp}/empty"], "no summary.json in it or below it"),
    (["{tmp}/run", "--columns", "speedup,sped"], "unknown column(s) ['sped']"),
    (["{tmp}/bad"], "not the summary of a specdec run"),
])
def test_bad_input_says_what_is_wrong(tmp_path, capsys, args, message):
    (tmp_path / "empty").mkdir()
    _write(tmp_path / "run", _summary("ngram", 0.5, k=2))
    _write(tmp_path / "bad", {"speedup": 1.0})
    assert compare.main([a.format(tmp=tmp_path) for a in args]) == 2
    assert message in capsys.readouterr().err


def _run(out: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*FAST, *overrides])
    return experiment.run(cfg, out)


def test_real_tiny_runs_of_different_launches(tmp_path, capsys):
    a = _run(tmp_path / "launch_a" / "ngram", "method=ngram", "method.num_speculative_tokens=2").summary
    b = _run(tmp_path / "launch_b" / "layer_skip", "method=layer_skip", "method.proposer.exit_layer=1",
             "method.schedule=heuristic").summary
    capsys.readouterr()
    # summary.json records each method's full config
    assert a["method_configs"]["ngram"]["proposer"] == {"_target_": "specdec.proposers.ngram.NgramProposer",
                                                        "max_ngram": 4, "min_ngram": 1}
    assert b["method_configs"]["layer_skip"]["schedule"] == "heuristic"
    assert compare.main([str(tmp_path / "launch_a"), str(tmp_path / "launch_b"), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "| launch_a/ngram | ngram | k=2 constant greedy max_ngram=4 min_ngram=1 | tiny_random seed 0 (llama, 2 layers) | none |" in printed
    assert "| launch_b/layer_skip | layer_skip | k=3 heuristic greedy exit_layer=1 | tiny_random seed 0 (llama, 2 layers) | none |" in printed
    rows = _csv(tmp_path / "compare.csv")
    assert [r["run"] for r in rows] == ["launch_a/ngram", "launch_b/layer_skip"]
    for row, s in zip(rows, (a, b)):
        assert row["method"] == s["method"]
        assert float(row["speedup"]) == pytest.approx(s["speedup"])
        assert float(row["tokens_per_s"]) == pytest.approx(s["tokens_per_s"])
        assert float(row["mean_accepted_length"]) == pytest.approx(s["mean_accepted_length"])
        assert float(row["rag/speedup"]) == pytest.approx(s["methods"][s["method"]]["categories"]["rag"]["speedup"])


def test_two_runs_of_one_method_are_kept_apart_labelled_by_run(tmp_path, capsys):
    a = _run(tmp_path / "k2", "method=ngram", "method.num_speculative_tokens=2").summary
    b = _run(tmp_path / "k4", "method=ngram", "method.num_speculative_tokens=4").summary
    capsys.readouterr()
    assert compare.main([str(tmp_path / "k2"), str(tmp_path / "k4"), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "| k2 | ngram @ k2 | k=2 constant" in printed and "| k4 | ngram @ k4 | k=4 constant" in printed
    rows = _csv(tmp_path / "compare.csv")
    assert [(r["method"], r["label"]) for r in rows] == [("ngram", "ngram @ k2"), ("ngram", "ngram @ k4")]
    assert [float(r["speedup"]) for r in rows] == pytest.approx([a["speedup"], b["speedup"]])
    alone = compare.compare([tmp_path / "k2"]).rows  # one run: its methods' own names
    assert [r["label"] for r in alone] == ["ngram"]


def _markdown_tables(text: str) -> list[list[list[str]]]:
    tables, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif current:
            tables.append(current)
            current = []
    return tables + ([current] if current else [])


def test_compare_reproduces_the_benchmarks_numbers():
    """Every cell of experiments/benchmarks/results.csv (the README's vs_hf table, each category's speedup
    too) comes out of `python -m specdec.study.compare` on that run's summary (kept in vs_hf/); the README's
    table is checked against results.csv in tests/study/test_study_tables.py."""
    study = ROOT / "experiments" / "benchmarks"
    with (study / "results.csv").open(newline="", encoding="utf-8") as f:
        kept = list(csv.DictReader(f))
    columns = ["method", "tok/s", "speedup", "spread", "tau", "alpha", "predicted", "measured/predicted", "lossless"]
    result = compare.compare([study / "vs_hf"], columns, with_baseline=True)
    header, _, *rows = _markdown_tables(result.table)[0]
    ours = {row[0]: dict(zip(header, row)) for row in rows}
    assert [r["method"] for r in kept] == list(ours)
    for row in kept:
        assert {k: v for k, v in row.items() if k != "command"} == ours[row["method"]], row["method"]
        assert row["lossless"] == "yes"
