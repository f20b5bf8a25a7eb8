"""The draft-training script on a tiny target: it runs end to end in seconds, the KL loss falls,
and the saved directory loads with `load_model` and drafts losslessly for the target; so it does on
a GPT-NeoX target, and a target without a decoder stack is refused before anything is generated."""

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from hydra import compose, initialize_config_dir

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.core.errors import InputError, InvalidInput
from specdec.models import ModelSpec, load_model, tiny_random_model, tiny_random_tokenizer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.study.data import Prompt
from specdec.train.training import distill, make_draft, split_prompts, take_per_category, teacher_targets
from tests.conftest import load_script, tiny_of

ROOT = Path(__file__).resolve().parents[2]


def _script():
    return load_script("train_draft")


@pytest.fixture
def spec_bench_file(tmp_path):
    """A Spec-Bench-format file in the tiny tokenizer's words: two categories of 8 prompts."""
    g = torch.Generator().manual_seed(0)
    lines = []
    for i in range(16):
        words = " ".join(f"t{t}" for t in torch.randint(3, 60, (6 + i % 5,), generator=g).tolist())
        lines.append(json.dumps({"question_id": i, "category": "a" if i < 8 else "b", "turns": [words]}))
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(lines))
    return path


def test_train_draft_script_end_to_end(tmp_path, spec_bench_file):
    out = tmp_path / "draft"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train_draft", overrides=[
            "target.path=tiny_random", "prompts.builtin=false", f"prompts.spec_bench={spec_bench_file}",
            "prompts.holdout_per_category=2", "prompts.train_per_category=null", "prompts.eval_per_category=2",
            "generation.max_new_tokens=24", "generation.batch_size=4", "draft.num_layers=1",
            "train.epochs=4", "train.lr=3e-3", "generation.cache=false", "train.max_tokens=128", "eval.max_new_tokens=12",
            f"out={out}", "progress=false",
        ])
    report = _script().run(cfg)
    assert report["train_prompts"] == 12 and report["eval_prompts"] == 4
    assert report["loss_by_epoch"][-1] < 0.7 * report["loss_by_epoch"][0]  # the KL falls
    assert 0.0 <= report["trained"]["acceptance_rate"] <= 1.0 and report["trained"]["speedup"] > 0
    # measured by the experiment's harness: both methods on every held-out prompt, greedy and lossless
    trained = report["trained"]["methods"]
    assert trained["draft"]["overall"]["num_prompts"] == trained["autoregressive"]["overall"]["num_prompts"] == 4
    assert report["trained"]["matches_baseline"] == 1.0 and trained["draft"]["exact_greedy"] == "on"
    assert json.loads((out / "train_report.json").read_text())["num_layers"] == 1

    draft, _ = load_model(ModelSpec(path=str(out)))
    assert draft.config.num_hidden_layers == 1
    target = tiny_random_model(seed=0)  # what ModelSpec(path="tiny_random") builds
    engine = Engine(target, draft, dtype="float32")
    prompts = [[5, 6, 7, 8], [9, 10]]
    ref = SpeculativeDecoder(engine).generate(prompts, max_new_tokens=16)
    got = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=3).generate(
        prompts, max_new_tokens=16)
    assert got.output_ids == ref.output_ids


def test_draft_starts_as_the_targets_first_layers_and_shares_the_frozen_head():
    target = tiny_random_model(seed=0, num_layers=3)
    draft = make_draft(target, 2)
    assert draft.config.num_hidden_layers == 2 and target.config.num_hidden_layers == 3
    torch.testing.assert_close(draft.model.layers[1].mlp.up_proj.weight, target.model.layers[1].mlp.up_proj.weight)
    assert not draft.lm_head.weight.requires_grad and not draft.model.embed_tokens.weight.requires_grad
    assert draft.model.layers[0].self_attn.q_proj.weight.requires_grad
    with pytest.raises(ValueError, match="num_layers"):
        make_draft(target, 3)


def test_distill_lowers_the_kl_to_the_target():
    from specdec.train.training import Example

    target = tiny_random_model(seed=0, num_layers=3)
    g = torch.Generator().manual_seed(1)
    examples = [Example(torch.randint(3, 200, (20,), generator=g), 8) for _ in range(16)]
    teacher_targets(target, examples, max_tokens=80, progress=False)
    draft = make_draft(target, 1)
    losses = distill(draft, target.lm_head, examples, epochs=6, lr=3e-3, max_tokens=80, progress=False)
    assert sum(losses[-4:]) / 4 < 0.7 * sum(losses[:4]) / 4


def test_held_out_prompts_are_the_first_of_each_category():
    ps = [Prompt(str(i), c, ("x",)) for i, c in enumerate("aabbbacc")]
    train, held = split_prompts(ps, 2, {"c": "a"})
    assert [p.prompt_id for p in held] == ["0", "1", "2", "3"]  # a: 0, 1; b: 2, 3 (c counts as a)
    assert [p.prompt_id for p in train] == ["4", "5", "6", "7"]
    assert len(take_per_category(train, 1, {"c": "a"})) == 2


def _cfg(out, *overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train_draft", overrides=["target.path=tiny_random", "prompts.builtin=true",
                                                 "prompts.spec_bench=false", "draft.num_layers=1",
                                                 "generation.cache=false", f"out={out}", "progress=false",
                                                 *overrides])


@pytest.mark.parametrize("overrides, message", [
    (["draft.num_layers=0"], "draft.num_layers=0: must be >= 1"),
    (["train.epochs=0"], "train.epochs=0: must be >= 1"),
    (["train.loss_on=bogus"], "train.loss_on='bogus': must be one of all, continuation"),
    (["eval.k=0"], "eval.k=0: must be >= 1"),
    (["dtype=nonsense"], "dtype='nonsense'"),
    (["prompts.spec_bench=/nonexistent/q.jsonl"], "prompts.spec_bench=/nonexistent/q.jsonl: file not found"),
])
def test_bad_configs_fail_before_loading(tmp_path, monkeypatch, overrides, message):
    script = _script()
    monkeypatch.setattr(script, "load_model", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(InputError, match=re.escape(message)):
        script.run(_cfg(tmp_path / "draft", *overrides))


def test_too_deep_a_draft_is_refused_before_generating(tmp_path, monkeypatch):
    script = _script()
    monkeypatch.setattr(script, "cached_continuations", lambda *a, **k: pytest.fail("generated"))
    with pytest.raises(InvalidInput, match=r"draft.num_layers=2: must be in \[1, 1\] for this 2-layer target"):
        script.run(_cfg(tmp_path / "draft", "draft.num_layers=2"))


def test_a_gpt_neox_target_trains_a_draft_end_to_end(tmp_path, spec_bench_file, monkeypatch):
    """GPT-NeoX keeps its decoder under `gpt_neox` (the teacher pass, the cut draft and the distillation
    read `model.model` and failed after generating): its draft trains, loads back and drafts losslessly."""
    script = _script()
    target = tiny_of(transformers.GPTNeoXConfig, rotary_pct=0.5)
    monkeypatch.setattr(script, "load_model", lambda spec: (target, tiny_random_tokenizer()))
    out = tmp_path / "draft"
    report = script.run(_cfg(out, "prompts.builtin=false", f"prompts.spec_bench={spec_bench_file}",
                             "prompts.holdout_per_category=2", "prompts.train_per_category=null",
                             "prompts.eval_per_category=1", "generation.max_new_tokens=16", "train.epochs=3",
                             "train.lr=3e-3", "train.max_tokens=128", "eval.max_new_tokens=8"))
    assert report["loss_by_epoch"][-1] < report["loss_by_epoch"][0]
    assert report["trained"]["matches_baseline"] == 1.0
    draft, _ = load_model(ModelSpec(path=str(out)))
    assert type(draft).__name__ == "GPTNeoXForCausalLM" and draft.config.num_hidden_layers == 1


@pytest.mark.parametrize("config, extra", [("CohereConfig", {}), ("Gemma2Config", dict(final_logit_softcapping=2.0, attention="eager"))])
def test_the_teacher_distribution_is_the_targets_own(config, extra):
    """Distillation's teacher is the head on the stored hidden states, scaled and capped as the target
    does (Cohere's logits are its head's x 0.0625, Gemma-2's soft-capped): its logits at every loss
    position equal the target's (without the transform, Cohere's were 16 times too sharp)."""
    from specdec.core.decoder_stack import final_logits, logit_transform
    from specdec.train.training import Example

    target = tiny_of(getattr(transformers, config), **extra)
    tokens = torch.arange(3, 15)
    example = Example(tokens, 4)
    teacher_targets(target, [example], progress=False)
    with torch.inference_mode():
        want = target(tokens[None]).logits[0, 3:-1]  # the outputs that predict tokens 4..11
        got = final_logits(target.get_output_embeddings()(example.hidden), *logit_transform(target))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert logit_transform(target) != (1.0, None)


def test_a_target_without_a_decoder_stack_is_refused_before_generating(tmp_path, monkeypatch):
    script = _script()
    bert = tiny_of(transformers.BertConfig, is_decoder=True)
    monkeypatch.setattr(script, "load_model", lambda spec: (bert, tiny_random_tokenizer()))
    monkeypatch.setattr(script, "cached_continuations", lambda *a, **k: pytest.fail("generated"))
    with pytest.raises(InvalidInput, match="train_draft needs a causal LM whose decoder .* keeps a list of layers"):
        script.run(_cfg(tmp_path / "draft"))


def test_an_existing_folder_and_the_target_are_never_overwritten(tmp_path, monkeypatch):
    script = _script()
    monkeypatch.setattr(script, "load_model", lambda *a, **k: pytest.fail("loaded the target"))
    out = tmp_path / "draft"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"earlier draft")
    with pytest.raises(InvalidInput, match="exists and is not empty; pass overwrite=true"):
        script.run(_cfg(out))
    with pytest.raises(InvalidInput, match="the target's own folder"):
        script.run(_cfg(out, f"target.path={out}", "overwrite=true"))
    assert (out / "model.safetensors").read_bytes() == b"earlier draft"


def test_an_interrupted_save_keeps_the_earlier_draft(tmp_path, monkeypatch):
    from specdec.models import tiny_random_tokenizer
    from specdec.train.training import save_draft

    out = tmp_path / "draft"
    draft = make_draft(tiny_random_model(seed=0), 1)
    save_draft(draft, tiny_random_tokenizer(), out)
    before = sorted(p.name for p in out.iterdir())

    def interrupted(path, **kwargs):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(draft, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_draft(draft, tiny_random_tokenizer(), out)
    assert sorted(p.name for p in out.iterdir()) == before and [p.name for p in tmp_path.iterdir()] == ["draft"]
    assert load_model(ModelSpec(path=str(out)))[0].config.num_hidden_layers == 1
