"""The EAGLE-style drafter on tiny random targets: every node it feeds while growing a dynamic tree
gets the output of a plain, uncached pass over exactly its own path (tree mask and positions over the
drafter's cache are right); greedy decoding with dynamic trees of several shapes is token-identical
to plain greedy at batch size 1 and in a ragged batch; the training script's loss falls and its
checkpoint runs as `method=eagle`."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.models import tiny_random_model
from specdec.proposers.eagle import EagleDrafter, EagleProposer
from specdec.proposers.heads import OutputHead, save_checkpoint
from specdec.study import experiment
from specdec.train.head_training import FOLLOW_UPS
from tests.conftest import RAGGED_PROMPTS, load_script

ROOT = Path(__file__).resolve().parents[2]
TINY_EAGLE = ROOT / "tests" / "assets" / "tiny_random_eagle.safetensors"
SHAPES = [dict(budget=10, topk=3, width=3, depth=4), dict(budget=6, topk=2, width=1, depth=6),
          dict(budget=16, topk=4, width=4, depth=3), dict(budget=1, topk=1, width=1, depth=1)]


@pytest.fixture(scope="module")
def target():
    return tiny_random_model(seed=0, eos_token_id=None)


class RecordingEagle(EagleProposer):
    """Records, for every propose that expanded its tree past the root (two drafter passes or more),
    the target's state and each drafter pass (inputs and outputs), in `records`: a generation's last
    steps draft shallower trees, or none, their rows' room cut to a few tokens."""

    def propose(self, state, k):
        self._recording = []
        seen = (state.tokens.clone(), list(self.target.lengths), self.target.cache.hidden.clone())
        out = super().propose(state, k)
        if len(self._recording) > 1:
            self.records.append((seen, self._recording))
        return out

    def reset(self, state):
        super().reset(state)
        self.records = []

    def _feed(self, tokens, features, positions, counts, region=None):
        out = super()._feed(tokens, features, positions, counts, region)
        self._recording.append((tokens, features, positions, region, out))
        return out


def _check_against_plain_passes(proposer: RecordingEagle, record: tuple):
    (tokens, lengths, hidden), calls = record
    drafter, embed = proposer.drafter, proposer.embed
    levels = calls[1:]  # the first pass is the catch-up
    checked = 0
    for b, n in enumerate(lengths):
        prefix = (tokens[b, 1 : n + 1], hidden[b, :n], torch.arange(n))  # (x_{t+1}, f_t) at position t
        fed = [[], [], []]
        for level_tokens, features, positions, (_, visible, _), out in levels:
            for j in range(level_tokens.shape[1]):
                fed[0].append(level_tokens[b, j])
                fed[1].append(features[b, j])
                fed[2].append(positions[b, j])
            start = len(fed[0]) - level_tokens.shape[1]
            for j in range(level_tokens.shape[1]):
                path = visible[b, j].nonzero().flatten().tolist()
                assert path[-1] == start + j  # every node sees itself, last
                seq_tokens = torch.cat([prefix[0], torch.stack([fed[0][i] for i in path])])
                seq_features = torch.cat([prefix[1], torch.stack([fed[1][i] for i in path])])
                seq_positions = torch.cat([prefix[2], torch.stack([fed[2][i] for i in path])])
                with torch.inference_mode():
                    ref = drafter(embed(seq_tokens[None]), seq_features[None], seq_positions[None])[0, -1]
                assert torch.allclose(out[b, j], ref, atol=1e-4), (b, j)
                checked += 1
    return checked


def test_every_fed_node_equals_a_plain_pass_over_its_path(target):
    engine = Engine(target, dtype="float32")
    proposer = RecordingEagle(engine, str(TINY_EAGLE), budget=12, topk=3, width=3, depth=4)
    dec = SpeculativeDecoder(engine, proposer, num_speculative_tokens=4)
    checked = 0
    for max_new, later in ((6, False), (9, True)):  # the first step after prefill, and a later one after compaction
        dec.generate(RAGGED_PROMPTS, max_new_tokens=max_new)
        deepest = [r for r in proposer.records if len(r[1]) == 4]  # the catch-up and three levels
        assert not later or deepest[-1] is not proposer.records[0]  # a step after the first, past a compaction
        checked += _check_against_plain_passes(proposer, deepest[-1] if later else proposer.records[0])
    assert checked >= 2 * 3 * 9  # three rows, three levels of three nodes


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s.values())))
@pytest.mark.parametrize("batch", ["single", "ragged"])
@pytest.mark.parametrize("trained", [True, False])
def test_greedy_dynamic_trees_equal_plain_greedy(target, tmp_path, shape, batch, trained):
    path = TINY_EAGLE
    if not trained:  # the drafter as initialised from the target's last layer
        path = tmp_path / "init.safetensors"
        save_checkpoint(path, "eagle", EagleDrafter(target).state_dict(), {"hidden_size": 64, "vocab_size": 256})
    engine = Engine(target, dtype="float32")
    prompts = RAGGED_PROMPTS[:1] if batch == "single" else RAGGED_PROMPTS
    ref = SpeculativeDecoder(engine).generate(prompts, max_new_tokens=24)
    out = SpeculativeDecoder(engine, EagleProposer(engine, str(path), **shape),
                             num_speculative_tokens=shape["depth"]).generate(prompts, max_new_tokens=24)
    assert out.output_ids == ref.output_ids and out.lossless


def test_trained_drafter_is_accepted_on_text_like_its_training_text(target):
    # The tiny tokenizer maps the English training prompts to <unk> runs: prompts like those.
    engine = Engine(target, dtype="float32")
    prompts = [[2] * 9, [2] * 7]
    ref = SpeculativeDecoder(engine).generate(prompts, max_new_tokens=24)
    out = SpeculativeDecoder(engine, EagleProposer(engine, str(TINY_EAGLE), **SHAPES[0]),
                             num_speculative_tokens=4).generate(prompts, max_new_tokens=24)
    assert out.output_ids == ref.output_ids and out.stats.mean_accepted_length > 2.5


def test_train_heads_script_trains_an_eagle_drafter(tmp_path):
    script = load_script("train_heads")
    out = tmp_path / "eagle.safetensors"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train_heads", overrides=[
            "kind=eagle", "target.path=tiny_random", "dtype=float32", "prompts.count=32", "prompts.target_written=0",
            "prompts.held_out=6", "generation.max_new_tokens=24", "generation.batch_size=8", "generation.cache=false",
            "heads.vocab=128", "train.epochs=4", "train.lr=3e-3", "train.max_tokens=256", "train.autocast=null",
            "eval.prompts=2", "eval.max_new_tokens=10", "eagle.budget=8", "eagle.topk=2", "eagle.width=2",
            "eagle.depth=3", f"out={out}", "progress=false"])
    report = script.run(cfg)
    assert report["loss_by_epoch"][-1] < 0.7 * report["loss_by_epoch"][0]
    assert report["decode_check"]["equal_to_plain"] == 1.0 and report["num_layers"] == 1


def test_eagle_runs_as_an_experiment_method(tmp_path):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            "target=tiny_random", "draft=none", "logger=none", "data.limit=1", "generation.max_new_tokens=8",
            "plots=false", "warmup=false", "dtype=float32", "method=eagle", f"method.heads_path={TINY_EAGLE}",
            "method.proposer.budget=8"])
    result = experiment.run(cfg, tmp_path)
    assert result.summary["method"] == "eagle" and result.summary["matches_baseline"] == 1.0


def test_a_medusa_checkpoint_is_not_an_eagle_drafter(target):
    with pytest.raises(ValueError, match="holds medusa heads, not eagle"):
        EagleProposer(Engine(target, dtype="float32"), str(ROOT / "tests" / "assets" / "tiny_random_medusa.safetensors"))


def test_family_plan_builds_each_stage_from_the_targets_answers():
    from specdec.study.data import load_builtin, load_spec_bench
    from specdec.train.head_training import FamilyPlan, check_disjoint

    evaluation = [t for p in load_spec_bench() + load_builtin() for t in p.turns]
    plan = FamilyPlan(written=5, math=4, qa=3, follow_ups=4, passages=3, code=2, derived=2, seed=0)
    first = plan.stage([])
    assert {k: plan.kinds.count(k) for k in set(plan.kinds)} == {"written": 5, "math": 4, "qa": 3, "code": 2,
                                                                  "passage": 3, "ask": 3}
    assert all(history == [] for history, _ in first)
    check_disjoint([u for _, u in first], evaluation)
    passage = "The river rose after three days of rain and the town closed its bridge. " * 6
    answers = [passage if k == "passage" else f"answer {i}" for i, k in enumerate(plan.kinds)]
    second = plan.stage(answers)
    kinds = plan.kinds
    assert kinds.count("summarize") == 2 and kinds.count("rag") == 2 and kinds.count("follow_up") == 4
    assert all(u.startswith("Summarize: The river rose") for (_, u), k in zip(second, kinds) if k == "summarize")
    # a follow-up continues a conversation: the first turn and the target's own answer to it
    follow = [(h, u) for (h, u), k in zip(second, kinds) if k == "follow_up"]
    assert all(len(h) == 1 and h[0][1].startswith("answer ") for h, _ in follow)
    german = ["Der Fluss stieg nach drei Tagen Regen." if k == "to_german" else "x" for k in kinds]
    third = plan.stage(german)
    assert third and all(u == "Translate German to English: Der Fluss stieg nach drei Tagen Regen." for _, u in third)
    assert plan.stage(["y"] * len(third)) == []  # three stages, then done
    check_disjoint([u for _, u in second + third], evaluation)


def test_eagle_labels_at_prompt_positions_are_the_targets_own_predictions():
    from specdec.train.head_training import eagle_sequences, vocab_index
    from specdec.train.training import Example

    torch.manual_seed(0)
    head = torch.randn(32, 8)
    example = Example(torch.tensor([3, 4, 5, 6, 7, 8, 9]), 1, torch.randn(6, 8))  # hidden: f_0..f_5
    plain = eagle_sequences(example, 4, vocab_index(None, 32))
    assert plain["labels"].tolist() == [-100, -100, 7, 8, 9]  # the continuation starts at index 4 (token 7)
    labelled = eagle_sequences(example, 4, vocab_index(None, 32), OutputHead(head))
    # position t learns x_{t+2}; inside the prompt that is the target's top-1 at f_{t+1}
    assert labelled["labels"].tolist() == [*(example.hidden[1:3] @ head.T).argmax(-1).tolist(), 7, 8, 9]


def test_unrolled_eagle_loss_reads_its_own_predicted_features(target):
    from specdec.train.head_training import eagle_loss

    torch.manual_seed(0)
    drafter = EagleDrafter(target)
    embed = target.get_input_embeddings()
    h = target.config.hidden_size
    batch = {"tokens": torch.randint(0, 200, (2, 6)), "features": torch.randn(2, 6, h), "next": torch.randn(2, 6, h),
             "labels": torch.randint(0, 50, (2, 6))}
    valid = torch.ones(2, 6, dtype=torch.bool)
    head = OutputHead(target.get_output_embeddings().weight[:50])
    one, _ = eagle_loss(drafter, embed, head, batch, valid, unroll=1)
    two, cls = eagle_loss(drafter, embed, head, batch, valid, unroll=2)
    positions = torch.arange(6)[None].expand(2, 6)
    with torch.no_grad():
        first = drafter(embed(batch["tokens"]), batch["features"], positions)
        second_features = torch.cat([batch["features"][:, :1], first[:, :-1]], 1)
        second = eagle_loss(drafter, embed, head, {**batch, "features": second_features}, valid, unroll=1)[0]
    assert torch.allclose(two, (one + second) / 2, atol=1e-5)
    assert not torch.allclose(one, second)


def test_train_heads_script_runs_the_task_families(tmp_path):
    script = load_script("train_heads")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train_heads", overrides=[
            "kind=eagle", "target.path=tiny_random", "dtype=float32",
            "prompts.families={written: 4, math: 2, qa: 2, follow_ups: 3, passages: 2, code: 1, derived: 2}",
            "prompts.held_out=3", "generation.max_new_tokens=12", "generation.batch_size=8", "generation.cache=false",
            "heads.vocab=128", "train.epochs=2", "train.max_tokens=256", "train.autocast=null", "train.unroll=2",
            "train.prompt_labels=true", "eval.prompts=2", "eval.max_new_tokens=6", "eagle.budget=4", "eagle.topk=2",
            "eagle.width=2", "eagle.depth=2", f"out={tmp_path / 'e.safetensors'}", "progress=false"])
    report = script.run(cfg)
    # stage 1 (4 written, 2 math, 2 qa, 1 code, 2 passages, 2 asks) and 3 follow-up turns at least
    assert report["train_prompts"] + report["held_out_prompts"] >= 16
    assert any(p in report["prompts"] for p in FOLLOW_UPS)
    assert report["decode_check"]["equal_to_plain"] == 1.0
