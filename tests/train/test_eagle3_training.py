"""EAGLE-3 training (`specdec.train.eagle3_training`, `scripts/train_heads.py kind=eagle3`) on the
tiny random Llama: the training-time test's steps are the drafter's own causal passes along a
draft path; a tiny run's loss falls and its speculators folder reads back and decodes losslessly;
the conversation readers take both chat formats and refuse malformed files; the frequency
vocabulary and its d2t/t2d agree. Only the single-process path is run (no torchrun here)."""

import json
import random
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.errors import InvalidInput, MissingInput
from specdec.proposers.eagle3 import Eagle3Proposer
from specdec.proposers.formats import read_drafter
from specdec.proposers.heads import OutputHead
from specdec.train.eagle3_training import (
    TrainingTimeTest,
    conversation_requests,
    draft_vocab,
    make_drafter,
    read_conversations,
    ttt_batches,
    ttt_mask,
)
from tests.conftest import RAGGED_PROMPTS, load_script, make_engine

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- the training-time test


def _batch(target, vocab_ids, t: int = 9, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    h = target.config.hidden_size
    return {"tokens": torch.randint(0, 256, (1, t), generator=gen), "features": torch.randn(1, t, 3 * h, generator=gen),
            "teacher": torch.randn(1, t, h, generator=gen),
            "top1": vocab_ids[torch.randint(0, len(vocab_ids), (1, t), generator=gen)],
            "mask": torch.ones(1, t, dtype=torch.bool), "valid": torch.ones(1, t, dtype=torch.bool)}


def test_each_step_is_the_drafters_causal_pass_along_its_draft_path(tiny_target):
    """Step j's output at t equals one causal drafter pass over the step-0 entries 0..t followed by
    the path's entries: token t+1+i with step i-1's output at t, at position t+i (decoding's view)."""
    vocab_ids = torch.arange(0, 256, 2)
    drafter = make_drafter(tiny_target, None, vocab_ids, vocab_ids - torch.arange(len(vocab_ids))).eval()
    t2d = torch.zeros(256, dtype=torch.bool)
    t2d[vocab_ids] = True
    embed = tiny_target.get_input_embeddings()
    ttt = TrainingTimeTest(drafter, embed, OutputHead.of(tiny_target, vocab_ids), t2d, steps=3)
    batch = _batch(tiny_target, vocab_ids)
    with torch.no_grad():
        outs = [out for out, _, _ in ttt.unroll(batch)]
        tokens, feats = batch["tokens"][0], drafter.fc(batch["features"][0])
        for t in (0, 3, 5):
            for j in range(3):
                ids = torch.cat([tokens[: t + 1], tokens[t + 1 : t + 1 + j]])
                hidden = torch.cat([feats[: t + 1], *[outs[i][0, t : t + 1] for i in range(j)]])
                positions = torch.cat([torch.arange(t + 1), t + 1 + torch.arange(j)])[None]
                alone = drafter(embed(ids)[None], hidden[None], positions)[0, -1]
                torch.testing.assert_close(outs[j][0, t], alone, atol=1e-5, rtol=1e-4)


def test_the_step_mask_sees_the_past_causally_and_each_later_step_at_its_own_position():
    mask = ttt_mask(4, 2)[0, 0]
    assert mask.shape == (4, 12)
    assert torch.equal(mask[:, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(mask[:, 4:8], torch.eye(4, dtype=torch.bool))
    assert torch.equal(mask[:, 8:], torch.eye(4, dtype=torch.bool))


def test_ranks_share_the_batches_without_overlap_and_in_equal_numbers():
    sequences = [{"tokens": torch.arange(n), "mask": torch.ones(n, dtype=torch.bool)} for n in range(3, 40)]

    def keys(batches):  # the lengths a batch holds: every sequence has its own length
        return [tuple(b["valid"].sum(1).tolist()) for b in batches]

    whole = keys(ttt_batches(sequences, 64, random.Random(0)))
    first, second = (keys(ttt_batches(sequences, 64, random.Random(0), rank, 2)) for rank in (0, 1))
    assert len(first) == len(second) == len(whole) // 2 > 0
    assert not set(first) & set(second) and set(first) | set(second) <= set(whole)


# ---------------------------------------------------------------- vocabulary


def test_the_frequency_vocabulary_and_its_maps_agree():
    text = [torch.tensor([7, 7, 7, 3, 3, 250, 9, 9, 9, 9]), torch.tensor([3, 100, 7])]
    ids, d2t, t2d = draft_vocab(text, 3, 256)
    assert ids.tolist() == [3, 7, 9]  # the three most frequent, ascending
    assert torch.equal(torch.arange(3) + d2t, ids)
    assert t2d.sum() == 3 and t2d[ids].all()
    whole, d2t_whole, t2d_whole = draft_vocab(text, 300, 256)
    assert torch.equal(whole, torch.arange(256)) and not d2t_whole.any() and t2d_whole.all()


# ---------------------------------------------------------------- conversations


def test_both_chat_formats_are_read(tmp_path):
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                      {"from": "gpt", "value": "Hello"}, {"from": "human", "value": "Bye"}]}]))
    messages = tmp_path / "messages.jsonl"
    messages.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]},
        {"messages": [{"role": "user", "content": "Name a colour."}]}]) + "\n")
    a = read_conversations(sharegpt)
    b = read_conversations(messages)
    assert a == [[("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello"), ("user", "Bye")]]
    assert b[1] == [("user", "Name a colour.")] and len(b) == 2
    requests = conversation_requests(a, max_turns=2)
    assert requests == [("Be brief.", [], "Hi"), ("Be brief.", [("Hi", "Hello")], "Bye")]
    assert conversation_requests(a) == [("Be brief.", [], "Hi")]
    assert len(read_conversations(messages, limit=1)) == 1


@pytest.mark.parametrize("content, message", [
    ('[{"text": "no turns here"}]', r"record 0 has neither `conversations` nor `messages`"),
    ('[{"messages": [{"role": "user"}]}]', r"record 0 turn 0: expected `role` and `content` strings"),
    ('[{"conversations": [{"from": "narrator", "value": "x"}]}]', r"turn 0: unknown role 'narrator'"),
    ('[{"messages": []}]', r"the turns must be a non-empty list"),
    ("this is not json {", r"cannot be read as JSON or JSONL"),
])
def test_malformed_files_are_refused_with_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(InvalidInput, match=message):
        read_conversations(path)


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(MissingInput, match="does not exist"):
        read_conversations(tmp_path / "none.jsonl")


# ---------------------------------------------------------------- the script, end to end


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    """kind=eagle3 on the tiny target: a few prompts, a 64-token draft vocabulary, 4 epochs."""
    out = tmp_path_factory.mktemp("eagle3") / "drafter"
    chats = out.parent / "chats.jsonl"
    chats.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"Tell me about item {i}."},
                                                        {"role": "assistant", "content": "It is an item."}]})
                               for i in range(6)) + "\n")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train_heads", overrides=[
            "kind=eagle3", "target.path=tiny_random", "dtype=float32", "prompts.count=24", "prompts.target_written=0",
            "prompts.held_out=4", f"prompts.conversations={chats}", "generation.max_new_tokens=24",
            "generation.batch_size=8", "generation.cache=false", "eagle3.draft_vocab_size=64", "eagle3.steps=3",
            "eagle3.budget=4", "eagle3.depth=3", "train.epochs=4", "train.lr=1e-3", "train.max_tokens=256",
            "train.autocast=null", "eval.prompts=2", "eval.max_new_tokens=12", f"out={out}", "progress=false"])
    report = load_script("train_heads").run(cfg)
    return out, report


def test_a_tiny_runs_loss_falls(trained):
    _, report = trained
    assert report["loss_by_epoch"][-1] < report["loss_by_epoch"][0]
    assert report["train_prompts"] == 24 - 4 + 6  # the conversations' turns train too


def test_the_saved_folder_reads_back_and_decodes_losslessly(trained, tiny_target):
    out, report = trained
    files = read_drafter(out)
    assert files.format == "eagle3-speculators" and files.config["draft_vocab_size"] == 64
    assert files.config["layer_ids"] == report["layer_ids"]
    ids = torch.arange(64) + files.tensors["d2t"]
    assert torch.equal(files.tensors["t2d"].nonzero()[:, 0], ids)
    assert report["decode_check"]["equal_to_plain"] == 1.0
    engine = make_engine(tiny_target)
    plain = SpeculativeDecoder(engine).generate(RAGGED_PROMPTS, max_new_tokens=20)
    for chain in (False, True):
        proposer = Eagle3Proposer(engine, str(out), budget=4, topk=2, width=2, depth=3, chain=chain)
        spec = SpeculativeDecoder(engine, proposer, num_speculative_tokens=3).generate(RAGGED_PROMPTS, max_new_tokens=20)
        assert spec.output_ids == plain.output_ids


def test_an_eagle3_out_that_is_a_file_is_refused_before_the_target_loads(tmp_path):
    file = tmp_path / "taken"
    file.write_text("x")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train_heads", overrides=["kind=eagle3", f"out={file}"])
    with pytest.raises(InvalidInput, match="is a file"):
        load_script("train_heads").check_config(cfg)
