"""Published Medusa drafters (FasterDecoding's `medusa_lm_head.pt`, vLLM's `model_type: medusa`) run
through `method=medusa`.

Folders are written here with the published names and shapes and read back by path. The loaded
heads equal a forward written here from FORMATS.md's formulas (section 1.2: `x + SiLU(Wx + b)`
repeated L times, then the head's own output head, on the target's post-norm last hidden state,
head i guessing token t+i+2). Each trap changes the output, so a loader that ignored it fails here:
FasterDecoding's `[ResBlock(H)] * L` shares one block per head (its file's last layer, as loading it
leaves), vLLM's blocks have a bias only where the tensors do (whatever `medusa_fc_bias` says),
and a truncated head's rows are the target ids of `token_map`. Greedy decoding is token-identical
to plain greedy, alone and in a ragged batch. No sampling test: the heads draft a static tree of
deterministic nodes (a one-hot q), as with specdec's own checkpoints, whose sampling tests cover
the verifier.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.core.errors import InputError, InvalidInput
from specdec.models import tiny_random_model
from specdec.proposers.medusa import MedusaProposer
from tests.conftest import RAGGED_PROMPTS, make_engine


@pytest.fixture(scope="module")
def target():
    return tiny_random_model(seed=0, eos_token_id=None)


@pytest.fixture(scope="module")
def small_target():
    """A 16-token vocabulary: the heads' guesses are often accepted, so steps accept and compact."""
    return tiny_random_model(seed=3, vocab_size=16, num_layers=2, eos_token_id=None, logit_std=2.0)


def head_tensors(target, heads=3, layers=1, bias=True, rows=None, seed=5, equal_layers=False):
    """Per (head, layer): (weight [H, H], bias [H] or None); per head: its output head [rows, H],
    the target's head plus noise (Medusa starts its heads from the target's). Random values."""
    h = target.config.hidden_size
    base = target.get_output_embeddings().weight.detach()
    rows = rows or base.shape[0]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        blocks = {}
        for i in range(heads):
            for j in range(layers):
                if equal_layers and j:
                    blocks[i, j] = blocks[i, 0]
                else:
                    blocks[i, j] = (0.3 * torch.randn(h, h), 0.5 * torch.randn(h) if bias else None)
        outs = {i: base[:rows] + 0.3 * torch.randn(rows, h) for i in range(heads)}
    return blocks, outs


def write_fasterdecoding(folder, blocks, outs, layers):
    """FasterDecoding's medusa_lm_head.pt: `{h}.{l}.linear.*` for l < L, `{h}.{L}.weight`."""
    state = {}
    for (i, j), (w, b) in blocks.items():
        state[f"{i}.{j}.linear.weight"] = w
        state[f"{i}.{j}.linear.bias"] = b
    for i, w in outs.items():
        state[f"{i}.{layers}.weight"] = w
    folder.mkdir(parents=True)
    torch.save(state, str(folder / "medusa_lm_head.pt"))
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": len(outs), "medusa_num_layers": layers,
                                                    "base_model_name_or_path": "tiny"}))
    return folder


def write_vllm(folder, blocks, outs, layers, token_map=None, **config):
    """vLLM's dialect: `blocks.{h}.layers.{l}.weight` (and `.bias`), `lm_heads.{h}.weight`, `token_map`."""
    state = {}
    for (i, j), (w, b) in blocks.items():
        state[f"blocks.{i}.layers.{j}.weight"] = w.clone()
        if b is not None:
            state[f"blocks.{i}.layers.{j}.bias"] = b.clone()
    for i, w in outs.items():
        state[f"lm_heads.{i}.weight"] = w.clone()
    if token_map is not None:
        state["token_map"] = token_map
    folder.mkdir(parents=True)
    save_file(state, str(folder / "model.safetensors"))
    h = next(iter(outs.values())).shape[1]
    (folder / "config.json").write_text(json.dumps({"model_type": "medusa", "num_heads": len(outs),
                                                    "num_hidden_layers": layers, "hidden_size": h, **config}))
    return folder


def reference(blocks, outs, hidden, layers, shared=False, bias=True):
    """FORMATS.md's Medusa head on `hidden` [B, H] (float64): [B, K, H] hidden states and [B, K, rows]
    logits. `shared`: one block per head, the last layer's, applied L times; `bias`: add it."""
    states, logits = [], []
    for i in range(len(outs)):
        x = hidden.double()
        for j in range(layers):
            w, b = blocks[i, layers - 1 if shared else j]
            y = x @ w.double().T
            x = x + torch.nn.functional.silu(y + b.double() if bias and b is not None else y)
        states.append(x)
        logits.append(x @ outs[i].double().T)
    return torch.stack(states, 1), torch.stack(logits, 1)


def _check(proposer, blocks, outs, layers, ids=None, **how):
    """The loaded heads' hidden states and top guesses (as target ids) equal the reference's."""
    hidden = torch.randn(3, proposer.heads.blocks[0].layers[0].in_features, generator=torch.Generator().manual_seed(1))
    states, logits = reference(blocks, outs, hidden, layers, **how)
    with torch.inference_mode():
        got = proposer.heads(hidden)
        top = proposer.head.token_ids(proposer.guesses(hidden, len(outs), 3))
    torch.testing.assert_close(got.double(), states, atol=1e-5, rtol=1e-5)
    want = logits.topk(3, -1).indices
    assert torch.equal(top, want if ids is None else ids[want])
    return got


# --- the heads against FORMATS.md's formulas -----------------------------------------------------


@pytest.mark.parametrize("dialect", ["fasterdecoding", "vllm"])
@pytest.mark.parametrize("layers", [1, 2])
def test_heads_follow_the_published_formulas(target, tmp_path, dialect, layers):
    blocks, outs = head_tensors(target, layers=layers, equal_layers=dialect == "fasterdecoding")
    write = write_fasterdecoding if dialect == "fasterdecoding" else write_vllm
    proposer = MedusaProposer(Engine(target, dtype="float32"), str(write(tmp_path / "d", blocks, outs, layers)))
    _check(proposer, blocks, outs, layers)


def test_the_first_draft_reads_the_targets_post_norm_last_hidden_state(target, tmp_path):
    """Head i guesses token t+i+2 from h_t, the final (normed) hidden state that produced token t+1."""
    blocks, outs = head_tensors(target, heads=2, layers=1)
    proposer = MedusaProposer(Engine(target, dtype="float32"), str(write_vllm(tmp_path / "d", blocks, outs, 1)),
                              tree=[[0], [1], [0, 0]])
    drafted = []
    original = proposer.propose
    proposer.propose = lambda state, k: drafted.append(original(state, k)) or drafted[-1]
    prompt = RAGGED_PROMPTS[2]
    SpeculativeDecoder(proposer.engine, proposer, num_speculative_tokens=2).generate([prompt], max_new_tokens=4)
    with torch.inference_mode():
        hidden = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][:, -1]  # post-norm
    _, logits = reference(blocks, outs, hidden, 1)
    top = logits.topk(2, -1).indices[0]  # [K, 2]
    assert drafted[0].tokens[0].tolist() == [int(top[0, 0]), int(top[0, 1]), int(top[1, 0])]


# --- the traps -----------------------------------------------------------------------------------


def test_fasterdecodings_shared_resblock_applies_the_last_layer_each_time(target, tmp_path):
    layers = 2
    blocks, outs = head_tensors(target, layers=layers)  # the file's layers differ
    fd = MedusaProposer(Engine(target, dtype="float32"), str(write_fasterdecoding(tmp_path / "fd", blocks, outs, layers)))
    shared = _check(fd, blocks, outs, layers, shared=True)
    # the same tensors in vLLM's dialect: its ResidualBlock holds L distinct layers
    vllm = MedusaProposer(Engine(target, dtype="float32"), str(write_vllm(tmp_path / "v", blocks, outs, layers)))
    distinct = _check(vllm, blocks, outs, layers, shared=False)
    assert (shared - distinct).abs().max() > 1e-2


@pytest.mark.parametrize("said", [None, False])
def test_vllm_blocks_have_a_bias_where_the_tensors_do_whatever_medusa_fc_bias_says(target, tmp_path, said):
    blocks, outs = head_tensors(target, layers=1, bias=True)
    extra = {} if said is None else {"medusa_fc_bias": said}  # vLLM's default (no bias) would drop it
    proposer = MedusaProposer(Engine(target, dtype="float32"), str(write_vllm(tmp_path / "b", blocks, outs, 1, **extra)))
    with_bias = _check(proposer, blocks, outs, 1, bias=True)
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    without, _ = reference(blocks, outs, hidden, 1, bias=False)
    assert (with_bias.double() - without).abs().max() > 1e-2
    nobias = {k: (w, None) for k, (w, _) in blocks.items()}
    bare = MedusaProposer(Engine(target, dtype="float32"), str(write_vllm(tmp_path / "n", nobias, outs, 1)))
    _check(bare, nobias, outs, 1, bias=False)


def test_a_truncated_head_proposes_the_ids_of_its_token_map(target, tmp_path):
    ids = torch.sort(torch.randperm(256, generator=torch.Generator().manual_seed(2))[:40]).values
    blocks, outs = head_tensors(target, layers=1, rows=40)
    folder = write_vllm(tmp_path / "m", blocks, outs, 1, token_map=ids, truncated_vocab_size=40, vocab_size=256)
    proposer = MedusaProposer(Engine(target, dtype="float32"), str(folder))
    _check(proposer, blocks, outs, 1, ids=ids)
    # without a map, the rows are the target's first ids
    first = write_vllm(tmp_path / "f", blocks, outs, 1, truncated_vocab_size=40, vocab_size=256)
    _check(MedusaProposer(Engine(target, dtype="float32"), str(first)), blocks, outs, 1, ids=torch.arange(40))
    assert MedusaProposer.heads_info(str(folder)) == (40, True, {"num_heads": 3})


# --- greedy: token identity ---------------------------------------------------------------------


@pytest.mark.parametrize("dialect", ["fasterdecoding", "vllm"])
@pytest.mark.parametrize("batch", ["single", "ragged"])
def test_greedy_trees_equal_plain_greedy(small_target, tmp_path, dialect, batch):
    blocks, outs = head_tensors(small_target, heads=3, layers=2, bias=dialect == "fasterdecoding")
    write = write_fasterdecoding if dialect == "fasterdecoding" else write_vllm
    folder = write(tmp_path / "d", blocks, outs, 2)
    prompts = [[t % 16 for t in p] for p in (RAGGED_PROMPTS[2:] if batch == "single" else RAGGED_PROMPTS)]
    engine = Engine(small_target, dtype="float32")
    ref = SpeculativeDecoder(engine).generate(prompts, max_new_tokens=20)
    proposer = MedusaProposer(engine, str(folder), tree=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    out = SpeculativeDecoder(engine, proposer, num_speculative_tokens=3).generate(prompts, max_new_tokens=20)
    assert out.output_ids == ref.output_ids and out.lossless
    assert sum(r.accepted for r in out.stats.rows) > 0  # drafts were accepted: the cache was compacted


def test_compiled_guesses_equal_plain_greedy(small_target, tmp_path):
    """compile=on compiles the published heads with their own output heads ([K, V', H]) too."""
    blocks, outs = head_tensors(small_target, heads=3, layers=2)
    folder = write_fasterdecoding(tmp_path / "d", blocks, outs, 2)
    prompts = [[t % 16 for t in p] for p in RAGGED_PROMPTS]
    ref = SpeculativeDecoder(make_engine(small_target)).generate(prompts, max_new_tokens=16)
    engine = make_engine(small_target, compile="on")
    proposer = MedusaProposer(engine, str(folder), tree=[[0], [1], [0, 0], [1, 0]])
    assert proposer.compiled is not None
    out = SpeculativeDecoder(engine, proposer, num_speculative_tokens=2).generate(prompts, max_new_tokens=16)
    assert out.output_ids == ref.output_ids and sum(r.accepted for r in out.stats.rows) > 0

# --- refusals ----------------------------------------------------------------------------------


def test_heads_of_another_width_or_vocabulary_are_refused(target, tmp_path):
    narrow = tiny_random_model(seed=0, hidden_size=32, num_heads=2, num_kv_heads=1, eos_token_id=None)
    blocks, outs = head_tensors(narrow, layers=1)
    with pytest.raises(InvalidInput, match="32 wide where the target's final hidden states are 64"):
        MedusaProposer(Engine(target, dtype="float32"), str(write_vllm(tmp_path / "w", blocks, outs, 1)))
    blocks, outs = head_tensors(target, layers=1)
    wide = {i: torch.cat([w, w[:44]]) for i, w in outs.items()}  # 300 rows for a 256-token target
    with pytest.raises(InvalidInput, match="300 rows where the target has 256 tokens"):
        MedusaProposer(Engine(target, dtype="float32"), str(write_fasterdecoding(tmp_path / "v", blocks, wide, 1)))
    ids = torch.arange(250, 290)
    small = {i: w[:40] for i, w in outs.items()}
    with pytest.raises(InvalidInput, match="outside the target's 256 tokens"):
        MedusaProposer(Engine(target, dtype="float32"), str(write_vllm(tmp_path / "t", blocks, small, 1, token_map=ids)))


def test_a_tree_deeper_than_the_heads_is_refused(target, tmp_path):
    blocks, outs = head_tensors(target, heads=2, layers=1)
    with pytest.raises(ValueError, match="3 deep but the checkpoint has 2 heads"):
        MedusaProposer(Engine(target, dtype="float32"), str(write_vllm(tmp_path / "d", blocks, outs, 1)),
                       tree=[[0], [0, 0], [0, 0, 0]])


def test_an_eagle_folder_is_refused_naming_its_method(target, tmp_path):
    from tests.proposers.test_published_eagle import eagle_config, eagle_tensors
    from tests.proposers.test_published_eagle import write as write_eagle

    folder = write_eagle(tmp_path / "e", eagle_config(target), eagle_tensors(target))
    with pytest.raises(InvalidInput, match="holds a eagle drafter .*use method=eagle"):
        MedusaProposer(Engine(target, dtype="float32"), str(folder))


@pytest.mark.parametrize("path", [None, ""])
def test_missing_heads_name_what_to_pass(target, path):
    with pytest.raises(InputError, match="method=medusa needs heads: set method.heads_path="):
        MedusaProposer(Engine(target, dtype="float32"), path)


# --- the config: method=medusa method.heads_path=<folder> ---------------------------------------


def test_a_folder_runs_as_method_heads_path_and_a_tree_too_deep_is_refused_before_any_model_loads(target, tmp_path):
    from specdec.study import experiment
    from specdec.study.config import ConfigError, validate
    from tests.proposers.test_published_eagle import run_config

    blocks, outs = head_tensors(target, heads=2, layers=2)
    folder = write_fasterdecoding(tmp_path / "d", blocks, outs, 2)
    cfg = run_config("method=medusa", f"method.heads_path={folder}", "data.limit=1", "generation.max_new_tokens=8")
    validate(cfg)
    experiment.run(cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    drafted = {(r["prompt_id"], r["repeat"]): r for r in rows if r["method"] == "medusa"}
    plain = {(r["prompt_id"], r["repeat"]): r["output_text"] for r in rows if r["method"] == "autoregressive"}
    assert drafted and all(r["proposed"] > 0 and r["output_text"] == plain[key] for key, r in drafted.items())
    with pytest.raises(ConfigError, match=r"^method.tree: is 3 deep but the checkpoint has 2 heads"):
        validate(run_config("method=medusa", f"method.heads_path={folder}", "method.tree=[[0],[0,0],[0,0,0]]"))
