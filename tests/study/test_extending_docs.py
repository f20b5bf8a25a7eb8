"""docs/extending.md runs as written: its files, copied into a folder outside the repository, and its
commands, run as a user runs them (`python -m specdec` with PYTHONPATH and hydra.searchpath pointing
at that folder), on tiny random models.

The page marks a file's block with `<!-- file: <path> -->` and a command's block with
`<!-- run: <name> -->`. Each command gets the flags of a run of seconds appended, unless it sets the
key itself; the checks then read what the run wrote."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec import Engine, SpeculativeDecoder, tiny_random_model

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "extending.md"
# A marker line, then a fenced block: the block's text is group 3.
BLOCK = re.compile(r"^<!-- (file|run): (\S+) -->\n```[a-z]*\n(.*?)^```$", re.M | re.S)
FAST = ("target=tiny_random", "draft=tiny_random", "logger=none", "data.limit=1", "generation.max_new_tokens=4",
        "plots=false", "warmup=false", "dtype=float32")


def blocks(kind: str) -> dict[str, str]:
    found = {name: text for k, name, text in BLOCK.findall(DOC.read_text(encoding="utf-8")) if k == kind}
    assert found, f"no `<!-- {kind}: ... -->` blocks in {DOC}"
    return found


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The page's files, written where the page says, in a folder outside the repository."""
    mine = tmp_path_factory.mktemp("my_specdec")
    assert not mine.resolve().is_relative_to(ROOT)
    for name, text in blocks("file").items():
        (mine / name).parent.mkdir(parents=True, exist_ok=True)
        (mine / name).write_text(text, encoding="utf-8")
    return mine


def _key(arg: str) -> str:
    return arg.lstrip("+~").split("=", 1)[0]


# One process runs every command: the app's own `main`, as `python -m specdec` calls it, with the
# command's arguments as bash splits them (quotes, $MY), and Hydra's global state cleared in between.
DRIVER = """
import json, sys
from hydra.core.global_hydra import GlobalHydra
from specdec.__main__ import main

for name, argv in json.load(open(sys.argv[1])):
    print("running", name, argv, file=sys.stderr, flush=True)
    GlobalHydra.instance().clear()
    sys.argv = ["specdec", *argv]
    main()
"""


@pytest.fixture(scope="module")
def runs(folder) -> dict[str, Path]:
    """Every command of the page, run from the folder with `$MY` and PYTHONPATH set as the page says;
    name -> its run folder."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"MY": str(folder), "PYTHONPATH": str(folder), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    jobs, out = [], {}
    for name, text in blocks("run").items():
        (line,) = [x for x in text.splitlines() if x.strip()]
        assert line.startswith("python -m specdec "), line
        split = subprocess.run(["bash", "-c", 'printf "%s\\0" ' + line.removeprefix("python -m specdec ")],
                               env=env, capture_output=True, text=True, check=True)
        argv = split.stdout.split("\0")[:-1]
        given = {_key(a) for a in argv}
        out[name] = folder / "runs" / name
        jobs.append((name, argv + [f for f in FAST if _key(f) not in given] + [f"hydra.run.dir={out[name]}"]))
    (folder / "jobs.json").write_text(json.dumps(jobs))
    done = subprocess.run([sys.executable, "-c", DRIVER, str(folder / "jobs.json")], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _rows(run: Path) -> dict[str, list[dict]]:
    """method -> its results.jsonl lines."""
    by_method: dict[str, list[dict]] = {}
    for line in (run / "results.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_method.setdefault(row["method"], []).append(row)
    return by_method


def _same_tokens_as_baseline(rows: dict[str, list[dict]], method: str) -> None:
    base = {r["prompt_id"]: r["output_token_ids"] for r in rows["autoregressive"]}
    assert rows[method] and all(r["new_tokens"] > 0 for r in rows[method])
    assert {r["prompt_id"]: r["output_token_ids"] for r in rows[method]} == base


def test_every_example_has_its_files_and_a_command():
    files, commands = blocks("file"), blocks("run")
    assert {"repeat_last.py", "capped_greedy.py", "ramp.py", "arithmetic.py", "jsonl_tracker.py"} <= set(files)
    assert set(commands) == {"repeat_last", "capped", "ramp", "arithmetic", "jsonl"}
    for yaml_file in (n for n in files if n.endswith(".yaml")):
        assert yaml_file.startswith("conf/"), yaml_file


def test_the_proposer_runs_and_is_lossless(runs):
    rows = _rows(runs["repeat_last"])
    _same_tokens_as_baseline(rows, "repeat_last")
    assert all(r["proposed"] > 0 for r in rows["repeat_last"])
    summary = json.loads((runs["repeat_last"] / "summary.json").read_text())
    assert summary["matches_baseline"] == 1.0 and summary["lossless"] is True


def test_the_verifier_caps_what_is_accepted(runs):
    rows = _rows(runs["capped"])
    _same_tokens_as_baseline(rows, "draft")
    assert all(r["verifier"] == "capped_greedy" and r["lossless"] for r in rows["draft"])
    accepted = [n for r in rows["draft"] for n in r["accepted_lengths"]]
    # the target drafting for itself in float32 has every draft right: only the cap stops it at 2
    assert accepted and max(accepted) == 2


def test_the_schedule_ramps_k(runs):
    rows = _rows(runs["ramp"])["draft"]
    for r in rows:  # a row's steps over all its turns; each turn is a generation, which starts at 1
        steps = r["draft_lengths"]
        # each step ramps on, or starts a turn again at 1, or drafts less where the row's room cut it
        assert steps[0] == 1 and all(b <= min(a + 1, 4) for a, b in zip(steps, steps[1:])), steps
        assert any(b == a + 1 for a, b in zip(steps, steps[1:])), steps  # it did ramp
    assert any(3 in r["draft_lengths"] for r in rows)
    assert rows[0]["reports"][0]["schedule"] == {"name": "ramp", "start": 1, "step": 1}


def test_the_prompt_source_supplies_the_prompts(runs):
    rows = _rows(runs["arithmetic"])
    ids = {r["prompt_id"] for r in rows["ngram"]}
    assert ids == {"add-1"}  # data.limit=1 per category, of the n=3 it made
    assert {r["category"] for r in rows["ngram"]} == {"arithmetic"}
    _same_tokens_as_baseline(rows, "ngram")


def test_the_tracker_hears_the_whole_run(runs):
    events = [json.loads(line) for line in (runs["jsonl"] / "events.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-2:] == ["summary", "finish"] and "prompt" in kinds
    assert (events[0]["project"], events[0]["method"]) == ("arith", "ngram")
    summary = json.loads((runs["jsonl"] / "summary.json").read_text())
    assert events[-2]["speedup"] == pytest.approx(summary["speedup"]) and events[-1]["exit_code"] == 0


def test_the_proposer_keeps_the_proposal_contract(folder, monkeypatch):
    """Every Proposal it returns, called by the decoding loop on a ragged batch: rank 2, B rows, long ids
    in the vocabulary, B lengths within the width and the width the longest length."""
    monkeypatch.syspath_prepend(str(folder))
    from repeat_last import RepeatLastProposer

    engine = Engine(tiny_random_model(), device="cpu", dtype="float32")
    proposer = RepeatLastProposer(engine)
    seen = []
    propose = proposer.propose

    def checked(state, k):
        proposal = propose(state, k)
        b, vocab = state.batch_size, engine.target.vocab_size
        assert proposal.tokens.dim() == 2 and proposal.tokens.shape[0] == b
        assert proposal.tokens.dtype == torch.long and proposal.tokens.device == state.tokens.device
        assert len(proposal.lengths) == b and all(isinstance(n, int) for n in proposal.lengths)
        assert all(0 <= n <= proposal.k <= k for n in proposal.lengths)
        assert proposal.k == max(proposal.lengths, default=0)
        assert proposal.probs is None
        if proposal.k:
            assert 0 <= int(proposal.tokens.min()) and int(proposal.tokens.max()) < vocab
        seen.append(proposal.k)
        return proposal

    proposer.propose = checked
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    out = SpeculativeDecoder(engine, proposer, num_speculative_tokens=3).generate(prompts, max_new_tokens=6)
    plain = SpeculativeDecoder(engine).generate(prompts, max_new_tokens=6)
    assert seen and out.output_ids == plain.output_ids
