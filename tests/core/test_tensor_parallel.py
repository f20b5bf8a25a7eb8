"""A target sharded over 2 gloo processes (transformers' tensor parallelism under torchrun) decodes what
one process decodes: greedy tokens, and sampled ones from the same seed, for every method that runs on
tiny random models; the ranks agree; a rank that draws differently is caught at its first pass, not
left to hang; an experiment under torchrun writes its results from rank 0 alone; and the config
refuses what cannot work before any model loads.

This file is also the script torchrun runs (`python tests/core/test_tensor_parallel.py <dir>`): each
rank writes what it decoded, and what a deliberately diverging generation raised, to
`<dir>/rank<r>.json`; the tests compare the files with the same decoding in the test's own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.models import tiny_random_model, tiny_random_tokenizer

HERE = Path(__file__).resolve()
PROMPTS = [[5, 9, 17, 33, 5, 9, 17], [7, 8, 9, 10, 11, 12, 13, 14, 15, 7, 8]]
NEW_TOKENS = 24
SEED = 3
METHODS = ("autoregressive", "draft", "self", "ngram", "suffix", "suffix_tree", "layer_skip", "medusa", "eagle")
ASSETS = HERE.parents[1] / "assets"  # heads trained for the tiny target


def decoder_of(method: str, engine: Engine) -> SpeculativeDecoder:
    """One decoder per method, on an engine whose draft is a separate model (`self`: the target)."""
    from specdec.proposers.draft_model import DraftModelProposer
    from specdec.proposers.eagle import EagleProposer
    from specdec.proposers.layer_skip import LayerSkipProposer
    from specdec.proposers.medusa import MedusaProposer
    from specdec.proposers.ngram import NgramProposer
    from specdec.proposers.suffix import SuffixProposer, SuffixTreeProposer

    if method == "autoregressive":
        return SpeculativeDecoder(engine)
    proposer = {"draft": lambda: DraftModelProposer(engine), "self": lambda: DraftModelProposer(engine),
                "ngram": lambda: NgramProposer(engine), "suffix": lambda: SuffixProposer(engine),
                "suffix_tree": lambda: SuffixTreeProposer(engine, budget=6),
                "layer_skip": lambda: LayerSkipProposer(engine, exit_layer=1),
                "medusa": lambda: MedusaProposer(engine, str(ASSETS / "tiny_random_medusa.safetensors")),
                "eagle": lambda: EagleProposer(engine, str(ASSETS / "tiny_random_eagle.safetensors"), budget=6,
                                               topk=3, width=2, depth=3)}[method]()
    return SpeculativeDecoder(engine, proposer, num_speculative_tokens=3)


def decode_all(target: torch.nn.Module, draft: torch.nn.Module, seed_shift: int = 0) -> dict[str, list]:
    """Every method, greedy and at temperature 1: {"<method>@<temperature>": output ids per row}."""
    out = {}
    for method in METHODS:
        engine = Engine(target, target if method == "self" else draft, device="cpu", dtype="float32")
        for temperature in (0.0, 1.0):
            generation = decoder_of(method, engine).generate(PROMPTS, max_new_tokens=NEW_TOKENS,
                                                              temperature=temperature, seed=SEED + seed_shift)
            out[f"{method}@{temperature}"] = generation.output_ids
    return out


def save_models(folder: Path) -> None:
    """The tiny target (4 heads, 2 key-value heads, 2 layers, no EOS) and a 1-layer draft, saved."""
    target = tiny_random_model(seed=0, eos_token_id=None)
    target.save_pretrained(folder / "target")
    tiny_random_tokenizer().save_pretrained(folder / "target")
    tiny_random_model(seed=1, num_layers=1, eos_token_id=None).save_pretrained(folder / "draft")


def worker(folder: Path) -> None:
    """What each torchrun rank runs: every method's tokens, the shape of its cache, then one generation
    that rank 1 seeds differently, with the error its first disagreeing pass raises."""
    from transformers import AutoModelForCausalLM

    from specdec.core import tensor_parallel as tp

    device = tp.init(2, "cpu")
    target, _ = tp.load_sharded(str(folder / "target"), 2, device, torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(folder / "draft", dtype=torch.float32).eval()
    record = {"rank": tp.rank(), "local_heads": list(tp.local_heads(target))}
    record["tokens"] = decode_all(target, draft)
    engine = Engine(target, draft, device="cpu", dtype="float32")
    decoder_of("draft", engine).generate(PROMPTS, max_new_tokens=4)
    record["cache_shape"] = list(engine.target.cache.layers[0].keys.shape)
    tp.guard_passes(target)
    try:
        decoder_of("draft", engine).generate(PROMPTS, max_new_tokens=NEW_TOKENS, temperature=1.0,
                                             seed=SEED + tp.rank())
    except tp.RanksDivergedError as err:
        record["error"] = str(err)
    (folder / f"rank{tp.rank()}.json").write_text(json.dumps(record))


def torchrun(*args: str, cwd: Path | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 <args>` on this machine (a free port, one thread per rank)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parents[2])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    folder = tmp_path_factory.mktemp("tp")
    save_models(folder)
    torchrun(str(HERE), str(folder))
    return folder, [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_each_rank_computes_and_caches_its_own_heads(sharded_run):
    _, ranks = sharded_run
    for record in ranks:
        assert record["local_heads"] == [2, 1]  # of 4 query and 2 key-value heads
        batch, heads, _, head_dim = record["cache_shape"]
        assert (batch, heads, head_dim) == (len(PROMPTS), 1, 16)


@pytest.mark.parametrize("method", METHODS)
def test_greedy_tokens_equal_one_process(sharded_run, method):
    folder, ranks = sharded_run
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(folder / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(folder / "draft", dtype=torch.float32).eval()
    engine = Engine(target, target if method == "self" else draft, device="cpu", dtype="float32")
    single = decoder_of(method, engine).generate(PROMPTS, max_new_tokens=NEW_TOKENS).output_ids
    plain = decoder_of("autoregressive", engine).generate(PROMPTS, max_new_tokens=NEW_TOKENS).output_ids
    assert single == plain  # the reference itself is lossless
    for record in ranks:
        assert record["tokens"][f"{method}@0.0"] == single, f"rank {record['rank']}"


def test_sampling_ranks_draw_alike_and_as_one_process(sharded_run):
    """Draft tokens, uniforms and residual samples come from one generator seeded alike on every rank:
    both ranks sample the same tokens, and the tokens one process samples from the same seed (the
    logits differ by float rounding only, far below where a draw would change)."""
    folder, ranks = sharded_run
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(folder / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(folder / "draft", dtype=torch.float32).eval()
    single = decode_all(target, draft)
    zero, one = (r["tokens"] for r in ranks)
    for key in single:
        if key.endswith("@1.0"):
            assert zero[key] == one[key], key
            assert zero[key] == single[key], key
    assert zero["draft@1.0"] != zero["draft@0.0"]  # it sampled


def test_a_rank_that_draws_differently_is_caught(sharded_run):
    """Rank 1 seeds its generator apart: both ranks raise at the first pass fed different tokens,
    rather than decoding on apart or hanging in a collective."""
    _, ranks = sharded_run
    for record in ranks:
        error = record.get("error", "")
        assert "rank 1 holds other tokens than rank 0" in error, error
        assert "target pass" in error


@pytest.mark.slow
def test_an_experiment_writes_from_rank_zero_only(tmp_path):
    """`torchrun -m specdec target.tp_size=2`: one results folder, from rank 0, whose greedy tokens equal
    plain decoding's; rank 1's Hydra folder is removed at the end (it logged nothing)."""
    torchrun("-m", "specdec", "experiment=tiny_smoke", "method=ngram", "draft=none", "target.tp_size=2",
             "data.limit=2", "plots=false", "threads=1", "hydra.run.dir=outputs/${now:%H-%M-%S.%f}_${oc.env:RANK}",
             cwd=tmp_path, timeout=300)
    folders = [p.parent for p in tmp_path.glob("outputs/*/.hydra")]
    results = [f for f in folders if (f / "summary.json").exists()]
    assert len(results) == 1 and results[0].name.endswith("_0"), folders
    assert not [f for f in tmp_path.glob("outputs/*") if f.name.endswith("_1")]
    summary = json.loads((results[0] / "summary.json").read_text())
    assert summary["complete"] and summary["num_prompts"] > 0 and summary["target_tp_size"] == 2
    assert summary["matches_baseline"] == 1.0  # greedy: every prompt's tokens are plain decoding's


# ---------------------------------------------------------------- the config's checks


def _config(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(HERE.parents[2] / "conf"), version_base="1.3"):
        return compose("config", overrides=["experiment=tiny_smoke", *overrides])


@pytest.fixture
def as_torchrun(monkeypatch):
    """The variables torchrun sets, for 2 processes (no process group is started)."""
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)


def test_config_refuses_tp_without_torchrun(monkeypatch):
    from specdec.study.config import ConfigError, validate

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=r"target.tp_size.*not started by torchrun.*torchrun --nproc-per-node 2"):
        validate(_config(["target.tp_size=2"]))


@pytest.mark.parametrize(("overrides", "message"), [
    (["target.tp_size=4"], r"started 2 processes"),
    (["draft.tp_size=2"], r"draft.tp_size: the draft runs whole"),
    (["method.schedule=cost_aware"], r"method.schedule: .*measured in this process"),
    (["method=hybrid", "method.heads_path=null"], r"method.proposer: .*measured in this process"),
    (["method=hf_generate"], r"method.decoder: .*transformers' own decoding loop"),
    (["compile=on"], r"compile: runs on whole weights"),
])
def test_config_refuses_what_cannot_run_sharded(as_torchrun, overrides, message):
    from specdec.study.config import ConfigError, validate

    with pytest.raises(ConfigError, match=message):
        validate(_config(["target.tp_size=2", "method=ngram", *overrides]))


def test_config_refuses_tp_that_splits_a_head(as_torchrun, monkeypatch):
    from specdec.study.config import ConfigError, validate

    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"target.tp_size=3 does not divide the target's 4 attention heads.*1, 2"):
        validate(_config(["target.tp_size=3", "method=ngram"]))


def test_config_takes_tp_under_torchrun(as_torchrun):
    from specdec.study.config import validate

    validate(_config(["target.tp_size=2", "method=ngram"]))


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
