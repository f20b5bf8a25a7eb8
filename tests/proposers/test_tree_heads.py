"""Trained heads on tiny random targets: the training script runs end to end in seconds, its loss
falls and the held-out agreement rises; the checkpoint loads as `method=medusa` and decodes exactly
the target's greedy output at batch size 1 and in a ragged batch; a checkpoint for another target,
a missing one and a bad tree are refused before any decoding."""

import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.core.errors import InvalidInput
from specdec.models import tiny_random_model, tiny_random_tokenizer
from specdec.proposers.medusa import MedusaHeads, MedusaProposer
from specdec.study import experiment
from specdec.study.config import ConfigError, validate
from specdec.train.head_training import check_disjoint, medusa_labels, training_prompts, vocab_index
from specdec.train.training import Example
from tests.conftest import RAGGED_PROMPTS, load_script, tiny_of

ROOT = Path(__file__).resolve().parents[2]
TINY_MEDUSA = ROOT / "tests" / "assets" / "tiny_random_medusa.safetensors"


def _script():
    return load_script("train_heads")


def _train_cfg(out: Path, *extra: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train_heads", overrides=[
            "target.path=tiny_random", "dtype=float32", "prompts.count=48", "prompts.target_written=4",
            "prompts.held_out=8", "generation.max_new_tokens=32", "generation.batch_size=8", "generation.cache=false",
            "heads.num_heads=3", "heads.vocab=128", "train.epochs=6", "train.lr=3e-3", "train.max_tokens=256",
            "train.autocast=null", "eval.prompts=2", "eval.max_new_tokens=12", f"out={out}", "progress=false",
            *extra,
        ])


def test_train_heads_script_end_to_end(tmp_path):
    out = tmp_path / "medusa.safetensors"
    report = _script().run(_train_cfg(out))
    assert report["loss_by_epoch"][-1] < 0.8 * report["loss_by_epoch"][0]  # the loss falls
    before, after = report["held_out_curve"][0], report["held_out_curve"][-1]
    gain = sum(after["top1_per_head"]) - sum(before["top1_per_head"])
    assert gain > 0.15  # and the held-out agreement of the heads rises
    assert report["decode_check"]["equal_to_plain"] == 1.0
    assert out.with_suffix(".json").is_file() and report["train_prompts"] > 40
    _decodes_like_plain_greedy(out)
    with pytest.raises(InvalidInput, match="another model of this target's shape"):  # same shape, other weights
        MedusaProposer(Engine(tiny_random_model(seed=1), dtype="float32"), str(out))


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_train_heads_script_trains_for_a_gpt_neox_target(tmp_path, monkeypatch, kind):
    """GPT-NeoX keeps its decoder under `gpt_neox` (the teacher pass read `model.model` and failed after
    the target had written the training text): its heads train, the loss falls, and they decode the
    held-out prompts as plain decoding does."""
    import transformers

    script = _script()
    target = tiny_of(transformers.GPTNeoXConfig, rotary_pct=0.5)
    monkeypatch.setattr(script, "load_model", lambda spec: (target, tiny_random_tokenizer()))
    report = script.run(_train_cfg(tmp_path / f"{kind}.safetensors", f"kind={kind}", "prompts.count=24",
                                   "prompts.target_written=0", "prompts.held_out=4", "generation.max_new_tokens=16",
                                   "train.epochs=3", "eagle.budget=6", "eagle.topk=2", "eagle.width=2", "eagle.depth=2"))
    assert report["loss_by_epoch"][-1] < report["loss_by_epoch"][0]
    assert report["decode_check"]["equal_to_plain"] == 1.0


@pytest.mark.parametrize("kind, config, message", [
    ("eagle", "GPT2Config", "method=eagle needs a Llama-like target"),
    ("medusa", "ElectraConfig", "output head reads 32-wide inputs, not its decoder's 64-wide"),
])
def test_a_target_the_heads_cannot_read_is_refused_before_generating(tmp_path, monkeypatch, kind, config, message):
    """GPT-2 has no rotary embedding for EAGLE's drafter, ELECTRA's generator projects its hidden states
    before the head: refused as the target loads, not after it has written the training text."""
    import transformers

    script = _script()
    extra = dict(is_decoder=True, embedding_size=32) if config == "ElectraConfig" else {}
    target = tiny_of(getattr(transformers, config), **extra)
    monkeypatch.setattr(script, "load_model", lambda spec: (target, tiny_random_tokenizer()))
    monkeypatch.setattr(script, "_continuations", lambda *a, **k: pytest.fail("generated"))
    with pytest.raises(InvalidInput, match=message):
        script.run(_train_cfg(tmp_path / "heads.safetensors", f"kind={kind}", "prompts.target_written=0"))


def _decodes_like_plain_greedy(path: Path):
    engine = Engine(tiny_random_model(seed=0, eos_token_id=None), dtype="float32")
    for prompts in (RAGGED_PROMPTS[:1], RAGGED_PROMPTS):
        ref = SpeculativeDecoder(engine).generate(prompts, max_new_tokens=24)
        out = SpeculativeDecoder(engine, MedusaProposer(engine, str(path), tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
                                 num_speculative_tokens=3).generate(prompts, max_new_tokens=24)
        assert out.output_ids == ref.output_ids
        assert out.lossless and out.stats.steps < ref.stats.steps  # accepted drafts shortened the run


def test_shipped_tiny_checkpoint_decodes_like_plain_greedy():
    _decodes_like_plain_greedy(TINY_MEDUSA)


def test_medusa_runs_as_an_experiment_method(tmp_path):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            "target=tiny_random", "draft=none", "logger=none", "data.limit=1", "generation.max_new_tokens=8",
            "plots=false", "warmup=false", "dtype=float32", "method=medusa", f"method.heads_path={TINY_MEDUSA}",
            "method.tree=[[0],[1],[0,0]]"])
    result = experiment.run(cfg, tmp_path)
    assert result.summary["method"] == "medusa" and result.summary["matches_baseline"] == 1.0


@pytest.mark.parametrize("overrides, message", [
    (["method.heads_path=null"], "needs trained heads"),
    (["method.heads_path=/nonexistent/heads.safetensors"], "file not found"),
    ([f"method.heads_path={TINY_MEDUSA}", "method.tree=[[0],[0,1,0]]"], "no parent"),
])
def test_bad_medusa_configs_fail_before_loading(overrides, message):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["target=tiny_random", "draft=none", "method=medusa", *overrides])
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_checkpoint_for_another_target_or_too_shallow_is_refused():
    wide = Engine(tiny_random_model(seed=0, hidden_size=32, num_heads=2, num_kv_heads=1), dtype="float32")
    with pytest.raises(ValueError, match="trained for a target with"):
        MedusaProposer(wide, str(TINY_MEDUSA))
    engine = Engine(tiny_random_model(seed=0), dtype="float32")
    with pytest.raises(ValueError, match="4 deep but the checkpoint has 3 heads"):
        MedusaProposer(engine, str(TINY_MEDUSA), tree=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]])


def test_heads_for_another_model_of_the_same_shape_are_refused(tmp_path):
    """The shapes of two seeds' tiny models agree; the recorded sample of the output head tells them
    apart, and still accepts the model the heads were trained for in bfloat16."""
    from specdec.proposers.heads import save_checkpoint, target_signature

    trained_for = tiny_random_model(seed=0)
    path = save_checkpoint(tmp_path / "medusa.safetensors", "medusa", MedusaHeads(64, 2).state_dict(),
                           {"hidden_size": 64, "vocab_size": 256, "num_heads": 2, "target": "tiny_random seed 0",
                            "target_signature": target_signature(trained_for)})
    MedusaProposer(Engine(tiny_random_model(seed=0), dtype="bfloat16"), str(path))
    with pytest.raises(InvalidInput, match=r"another model of this target's shape \(tiny_random seed 0\): its "
                                           r"output-head weights correlate -?0\.\d\d with this target's"):
        MedusaProposer(Engine(tiny_random_model(seed=1), dtype="float32"), str(path))


def test_untrained_heads_start_as_the_targets_own_head():
    heads = MedusaHeads(16, 3)
    hidden = torch.randn(5, 16)
    assert torch.equal(heads(hidden), hidden[:, None].expand(5, 3, 16))


def test_the_output_head_keeps_its_bias_whole_and_on_a_reduced_vocabulary():
    """Phi's, GPT-J's and CodeGen's output heads have a bias: the heads' logits are the target head's own,
    bias included, on the whole vocabulary and on a checkpoint's `vocab_ids` rows, and so are Medusa's
    compiled guesses (they were refused; ignoring the bias would rank the tokens otherwise)."""
    import transformers

    from specdec.proposers.heads import OutputHead
    from specdec.proposers.medusa import MedusaGuesses

    torch.manual_seed(0)
    lm_head = torch.nn.Linear(16, 40)
    lm_head.bias.data.normal_(0.0, 5.0)
    model = torch.nn.Module()
    model.config = transformers.PretrainedConfig()  # no logit scale or cap
    model.get_output_embeddings = lambda: lm_head
    hidden = torch.randn(6, 16)
    whole = OutputHead.of(model)
    torch.testing.assert_close(whole.logits(hidden), lm_head(hidden))
    ids = torch.tensor([1, 5, 7, 30])
    torch.testing.assert_close(OutputHead.of(model, ids).logits(hidden), lm_head(hidden)[:, ids])
    heads = MedusaHeads(16, 2)
    ranks = MedusaGuesses(heads, whole)(hidden, depth=2, ranks=3)  # untrained: the target's own top 3
    assert torch.equal(ranks, lm_head(hidden).topk(3).indices[:, None].expand(6, 2, 3))


def test_labels_are_the_tokens_ahead_inside_the_continuation():
    example = Example(torch.tensor([10, 11, 12, 13, 14, 15]), 1)
    labels = medusa_labels(example, continuation_start=3, num_heads=2, index=vocab_index(None, 32))
    # position t: head 1 learns token t+2, head 2 token t+3; prompt tokens (index < 3) and the end are -100
    assert labels.tolist() == [[-100, 13], [13, 14], [14, 15], [15, -100], [-100, -100]]
    reduced = vocab_index(torch.tensor([13, 15]), 32)
    assert medusa_labels(example, 3, 2, reduced).tolist()[1] == [0, -100]  # 14 is outside the vocabulary


def test_training_prompts_are_distinct_and_disjoint_from_evaluation_sets():
    from specdec.study.data import load_builtin, load_spec_bench

    prompts = training_prompts(600)
    assert len(set(prompts)) == 600
    check_disjoint(prompts, [t for p in load_spec_bench() + load_builtin() for t in p.turns])
    with pytest.raises(ValueError, match="training prompts are evaluation prompts"):
        check_disjoint(prompts[:3] + ["What is  the capital of France?"], ["what is the capital of france?"])


@pytest.mark.parametrize("overrides, message", [
    (["kind=hydra"], "kind='hydra': must be one of medusa, eagle"),
    (["prompts.held_out=52"], "prompts.held_out=52: must be below the 52 prompts"),
    (["heads.num_heads=0"], "heads.num_heads=0: must be >= 1"),
    (["train.epochs=-1"], "train.epochs=-1: must be >= 1"),
    (["train.lr=-1"], "train.lr=-1: must be > 0"),
    (["eval.prompts=9"], "at most prompts.held_out=8"),
    (["prompts.families={writen: 4}"], "prompts.families: unknown writen"),
    (["out=heads.json"], "must end in .safetensors"),
])
def test_bad_training_configs_fail_before_loading(tmp_path, monkeypatch, overrides, message):
    script = _script()
    monkeypatch.setattr(script, "load_model", lambda *a, **k: pytest.fail("loaded the target"))
    cfg = _train_cfg(tmp_path / "medusa.safetensors", *overrides)
    with pytest.raises(InvalidInput, match=re.escape(message)):
        script.run(cfg)


def test_an_existing_checkpoint_is_kept_unless_overwrite(tmp_path, monkeypatch):
    script = _script()
    out = tmp_path / "medusa.safetensors"
    out.write_bytes(b"earlier heads")
    monkeypatch.setattr(script, "load_model", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(InvalidInput, match="exists; pass overwrite=true"):
        script.run(_train_cfg(out))
    assert out.read_bytes() == b"earlier heads"
    script.check_config(_train_cfg(out, "overwrite=true"))  # asked for: accepted


def test_logger_is_a_config_group():
    assert _train_cfg(Path("x.safetensors")).logger.kind == "none"
    assert _train_cfg(Path("x.safetensors"), "logger=wandb").logger.kind == "wandb"


def test_a_checkpoint_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    from specdec.proposers import heads

    out = tmp_path / "h.safetensors"
    heads.save_checkpoint(out, "medusa", {"w": torch.ones(2)}, {"hidden_size": 2})
    before = out.read_bytes()

    def interrupted(tensors, path, metadata):
        Path(path).write_bytes(b"cut sh")
        raise KeyboardInterrupt

    monkeypatch.setattr(heads, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        heads.save_checkpoint(out, "medusa", {"w": torch.zeros(2)}, {"hidden_size": 2})
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["h.safetensors"]
