"""The embedded SmolLM2-135M through the real command line (slow). The self-draft check
(`experiment=self_draft`): the target drafting for itself accepts (nearly) everything, the table is
printed, results are written, and the second turn of a conversation continues the first turn's cache.
The default run (no overrides): plain decoding, n-gram lookup and the shipped EAGLE-style drafter, in one run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *overrides: str) -> tuple[Path, subprocess.CompletedProcess]:
    """`python -m specdec <overrides>` from a temporary folder (W&B offline); its run folder and process."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "specdec", *overrides, "threads=1", f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, text=True, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def test_self_draft_run_on_the_embedded_model(tmp_path):
    out, proc = _run(tmp_path, "experiment=self_draft", "data.limit=1", "data.categories=[conversation,qa]",
                     "generation.max_new_tokens=16")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["target"] == "SmolLM2-135M-Instruct.Q4_1.gguf (llama, 30 layers)"  # what was loaded
    assert summary["method"] == "draft" and summary["draft"] == "self"
    assert summary["num_prompts"] == 2 and summary["complete"] is True
    # The target is its own draft: acceptance is 1 up to bfloat16 rounding between 1- and k+1-token
    # passes, which flips near-ties: 0.87-0.89 over 8 Spec-Bench prompts x 32 tokens, 0.80 on these
    # 44 drafts (a broken draft cache accepts almost nothing).
    assert summary["acceptance_rate"] > 0.7 and summary["mean_accepted_length"] > 3.0
    assert "matches_baseline" in summary and summary["lossless"] is True
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    # the method, the one-token-wide baseline and exact greedy's plain decoding at the method's width
    reference = summary["exact_greedy_reference"]
    assert {r["method"] for r in rows} == {"draft", "autoregressive", reference}
    assert len(rows) == 6 and all(r["new_tokens"] > 1 for r in rows)
    conversation = [r for r in rows if r["category"] == "conversation"]
    assert all(r["turn_outputs"][1]["reused_cache_tokens"] > 0 for r in conversation)
    assert "| **overall** |" in proc.stdout and "draft, k=4" in proc.stdout
    assert list((out / "wandb").glob("offline-run-*"))  # the default logger: W&B, offline


def test_default_run_compares_plain_ngram_and_the_trained_drafter(tmp_path):
    out, _ = _run(tmp_path, "data.limit=1", "data.categories=[qa]", "generation.max_new_tokens=16", "logger=none")
    summary = json.loads((out / "summary.json").read_text())
    reference = summary["exact_greedy_reference"]  # plain decoding at ngram's width (eagle's trees score their own)
    assert summary["method"] == "eagle" and set(summary["methods"]) == {"eagle", "ngram", "autoregressive", reference}
    assert summary["lossless"] is True and summary["complete"] is True
    eagle = summary["methods"]["eagle"]["overall"]
    assert eagle["mean_accepted_length"] > 1.0  # the shipped drafter gets drafts accepted
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["method"] for r in rows) == sorted(["autoregressive", "eagle", "ngram", reference])
