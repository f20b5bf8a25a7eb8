"""Published EAGLE-1/2 drafters (SafeAILab's `yuhuili/EAGLE-*`, HASS) run through `method=eagle`.

Folders are written here with the published names and shapes (config.json and pytorch_model.bin or
model.safetensors) and read back by path. The loaded drafter's output equals a forward written here
from FORMATS.md's formulas (section 1.2: fc over cat(embedding, feature) with the file's bias, the
layers, layer 0 without input_layernorm, no final norm, the target's output head). Each trap of
section 1.3 changes that output, so a loader that ignored it fails here: fc.bias present or absent,
a config whose num_hidden_layers is wrong, embeddings missing from the file. Greedy decoding is
token-identical to plain greedy, alone and in a ragged batch. No sampling test: the proposer drafts
trees of deterministic nodes (a one-hot q), as with specdec's own checkpoints, whose sampling tests
cover the verifier.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.core.errors import InputError, InvalidInput
from specdec.models import tiny_random_model
from specdec.proposers.eagle import EagleProposer
from tests.conftest import RAGGED_PROMPTS, make_engine

INTERMEDIATE = 96  # the drafter's MLP width, not the target's (128): the layers are built from the file's config


def _rand(*shape, scale=0.2):
    return scale * torch.randn(*shape)


def eagle_tensors(target, layers=1, fc_bias=True, embed=False, seed=3, layer0_norm=False):
    """SafeAILab's tensor names and shapes for a drafter of `target` (random values)."""
    c = target.config
    h, d = c.hidden_size, c.hidden_size // c.num_attention_heads
    gen = torch.random.fork_rng(devices=[])
    with gen:
        torch.manual_seed(seed)
        t = {"fc.weight": _rand(h, 2 * h)}
        if fc_bias:
            t["fc.bias"] = _rand(h, scale=1.0)
        for i in range(layers):
            p = f"layers.{i}."
            t.update({p + "self_attn.q_proj.weight": _rand(c.num_attention_heads * d, h),
                      p + "self_attn.k_proj.weight": _rand(c.num_key_value_heads * d, h),
                      p + "self_attn.v_proj.weight": _rand(c.num_key_value_heads * d, h),
                      p + "self_attn.o_proj.weight": _rand(h, c.num_attention_heads * d),
                      p + "mlp.gate_proj.weight": _rand(INTERMEDIATE, h),
                      p + "mlp.up_proj.weight": _rand(INTERMEDIATE, h),
                      p + "mlp.down_proj.weight": _rand(h, INTERMEDIATE),
                      p + "post_attention_layernorm.weight": 1 + _rand(h)})
            if i or layer0_norm:
                t[p + "input_layernorm.weight"] = 1 + _rand(h)
        if embed:
            t["embed_tokens.weight"] = _rand(c.vocab_size, h, scale=1.0)
    return t


def eagle_config(target, **extra):
    c = target.config
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "intermediate_size": INTERMEDIATE, "vocab_size": c.vocab_size, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "max_position_embeddings": 2048, "num_hidden_layers": 1, **extra}


def write(folder, config, tensors, weights="pytorch_model.bin"):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    if weights.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / weights))
    else:
        torch.save(tensors, str(folder / weights))
    return folder


@pytest.fixture(scope="module")
def target():
    return tiny_random_model(seed=0, eos_token_id=None)


@pytest.fixture(scope="module")
def small_target():
    """A 16-token vocabulary: a random drafter's guesses are often accepted, so steps accept and compact."""
    return tiny_random_model(seed=3, vocab_size=16, num_layers=2, eos_token_id=None, logit_std=2.0)


# --- the forward, written from FORMATS.md section 1.2 --------------------------------------------


def _rms(x, w, eps=1e-6):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rotate(x, positions, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = torch.cat([positions[..., None].double() * inv] * 2, -1)[:, None]  # [B, 1, T, d]
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * freqs.cos() + half * freqs.sin()


def reference_features(t, config, embeds, features, positions, layers=None):
    """SafeAILab's EAGLE-1 drafter (cnets1.py) from the raw tensors, causal, in float64: the
    predicted next features [B, T, H], with no final norm. `layers`: how many to run (default: all
    the tensors hold)."""
    t = {k: v.double() for k, v in t.items()}
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config["hidden_size"] // heads
    x = torch.cat([embeds, features], -1) @ t["fc.weight"].T + t.get("fc.bias", 0)
    n_layers = layers or 1 + max(int(k.split(".")[1]) for k in t if k.startswith("layers."))
    b, n = x.shape[:2]
    for i in range(n_layers):
        p = f"layers.{i}."
        y = x if i == 0 else _rms(x, t[p + "input_layernorm.weight"])  # layer 0: no input norm
        q = (y @ t[p + "self_attn.q_proj.weight"].T).view(b, n, heads, d).transpose(1, 2)
        k = (y @ t[p + "self_attn.k_proj.weight"].T).view(b, n, kv, d).transpose(1, 2)
        v = (y @ t[p + "self_attn.v_proj.weight"].T).view(b, n, kv, d).transpose(1, 2)
        q, k = _rotate(q, positions), _rotate(k, positions)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        scores = (q @ k.transpose(-1, -2)) / d ** 0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        x = x + (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, heads * d) @ t[p + "self_attn.o_proj.weight"].T
        m = _rms(x, t[p + "post_attention_layernorm.weight"])
        x = x + (torch.nn.functional.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)) \
            @ t[p + "mlp.down_proj.weight"].T
    return x


def _inputs(target, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.config.vocab_size, (2, 7), generator=gen)
    features = torch.randn(2, 7, target.config.hidden_size, generator=gen, dtype=torch.float64)
    return tokens, features, torch.arange(3, 10).expand(2, 7)


def _loaded(target, folder):
    """The proposer's drafter (float64: the check is of the formulas) and its embeddings."""
    proposer = EagleProposer(Engine(target, dtype="float32"), str(folder))
    return proposer.drafter.double(), proposer.embed


def _drafted(target, folder, tokens, features, positions):
    drafter, embed = _loaded(target, folder)
    with torch.inference_mode():
        return drafter(embed(tokens).double(), features, positions)


@pytest.mark.parametrize("layers, fc_bias, embed, weights", [
    (1, True, False, "pytorch_model.bin"), (1, False, True, "model.safetensors"), (2, True, True, "pytorch_model.bin"),
    (3, False, False, "model.safetensors")])
def test_drafter_forward_follows_the_published_formulas(target, tmp_path, layers, fc_bias, embed, weights):
    tensors = eagle_tensors(target, layers, fc_bias, embed)
    folder = write(tmp_path / "d", eagle_config(target, num_hidden_layers=layers, bias=fc_bias), tensors, weights)
    tokens, features, positions = _inputs(target)
    out = _drafted(target, folder, tokens, features, positions)
    table = tensors["embed_tokens.weight"] if embed else target.get_input_embeddings().weight.detach()
    ref = reference_features(tensors, eagle_config(target), table.double()[tokens], features, positions)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the output goes straight into the target's output head: no norm between them
    proposer = EagleProposer(Engine(target, dtype="float32"), str(folder))
    head = target.get_output_embeddings().weight.detach().double()
    torch.testing.assert_close(proposer.head.logits(out.float()).double(), ref @ head.T, atol=1e-4, rtol=1e-4)


# --- the traps of FORMATS.md section 1.3: each changes the output --------------------------------


def test_fc_bias_is_read_from_the_tensors_not_the_config(target, tmp_path):
    tokens, features, positions = _inputs(target)
    with_bias = eagle_tensors(target, fc_bias=True)
    without = {k: v for k, v in with_bias.items() if k != "fc.bias"}
    # the configs say the opposite of the tensors (LLaMA-3 drafts set bias false; Vicuna's have fc.bias)
    a = _drafted(target, write(tmp_path / "a", eagle_config(target, bias=False), with_bias), tokens, features, positions)
    b = _drafted(target, write(tmp_path / "b", eagle_config(target, bias=True), without), tokens, features, positions)
    embeds = target.get_input_embeddings().weight.detach().double()[tokens]
    torch.testing.assert_close(a, reference_features(with_bias, eagle_config(target), embeds, features, positions),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b, reference_features(without, eagle_config(target), embeds, features, positions),
                               atol=1e-5, rtol=1e-5)
    assert (a - b).abs().max() > 1e-2


@pytest.mark.parametrize("said", [1, 40])
def test_the_layer_count_comes_from_the_tensors_not_num_hidden_layers(target, tmp_path, said):
    tokens, features, positions = _inputs(target)
    tensors = eagle_tensors(target, layers=2)
    out = _drafted(target, write(tmp_path / "d", eagle_config(target, num_hidden_layers=said), tensors),
                   tokens, features, positions)
    embeds = target.get_input_embeddings().weight.detach().double()[tokens]
    both = reference_features(tensors, eagle_config(target), embeds, features, positions)
    first = reference_features(tensors, eagle_config(target), embeds, features, positions, layers=1)
    torch.testing.assert_close(out, both, atol=1e-5, rtol=1e-5)
    assert (out - first).abs().max() > 1e-2


def test_embeddings_from_the_file_else_the_targets(target, tmp_path):
    tokens, features, positions = _inputs(target)
    own = eagle_tensors(target, embed=True)
    shared = {k: v for k, v in own.items() if k != "embed_tokens.weight"}
    drafter, embed = _loaded(target, write(tmp_path / "own", eagle_config(target), own))
    assert torch.equal(embed(tokens), own["embed_tokens.weight"][tokens])
    assert embed is not target.get_input_embeddings()
    a = _drafted(target, tmp_path / "own", tokens, features, positions)
    b = _drafted(target, write(tmp_path / "shared", eagle_config(target), shared), tokens, features, positions)
    _, embed_b = _loaded(target, tmp_path / "shared")
    assert embed_b is target.get_input_embeddings()
    assert (a - b).abs().max() > 1e-2


def test_a_layer_zero_input_norm_in_the_file_is_skipped_as_safeailab_does(target, tmp_path):
    tokens, features, positions = _inputs(target)
    tensors = eagle_tensors(target, layer0_norm=True)
    out = _drafted(target, write(tmp_path / "d", eagle_config(target), tensors), tokens, features, positions)
    embeds = target.get_input_embeddings().weight.detach().double()[tokens]
    torch.testing.assert_close(out, reference_features(tensors, eagle_config(target), embeds, features, positions),
                               atol=1e-5, rtol=1e-5)


def test_qkv_bias_puts_a_bias_on_q_k_v_only(target, tmp_path):
    tensors = eagle_tensors(target)
    for name in ("q", "k", "v"):
        w = tensors[f"layers.0.self_attn.{name}_proj.weight"]
        tensors[f"layers.0.self_attn.{name}_proj.bias"] = torch.randn(w.shape[0])
    drafter, _ = _loaded(target, write(tmp_path / "d", eagle_config(target, qkv_bias=True), tensors))
    attn = drafter.layers[0].self_attn
    assert torch.equal(attn.q_proj.bias.float(), tensors["layers.0.self_attn.q_proj.bias"])
    assert attn.o_proj.bias is None


# --- greedy: token identity ---------------------------------------------------------------------


@pytest.mark.parametrize("layers, embed", [(1, False), (2, True)])
@pytest.mark.parametrize("batch", ["single", "ragged"])
def test_greedy_trees_equal_plain_greedy(small_target, tmp_path, layers, embed, batch):
    folder = write(tmp_path / "d", eagle_config(small_target), eagle_tensors(small_target, layers, embed=embed))
    prompts = [[t % 16 for t in p] for p in (RAGGED_PROMPTS[2:] if batch == "single" else RAGGED_PROMPTS)]
    engine = Engine(small_target, dtype="float32")
    ref = SpeculativeDecoder(engine).generate(prompts, max_new_tokens=20)
    proposer = EagleProposer(engine, str(folder), budget=10, topk=3, width=3, depth=4)
    out = SpeculativeDecoder(engine, proposer, num_speculative_tokens=4).generate(prompts, max_new_tokens=20)
    assert out.output_ids == ref.output_ids and out.lossless
    assert sum(r.accepted for r in out.stats.rows) > 0  # drafts were accepted: the caches were compacted


def test_compiled_drafting_equals_plain_greedy(small_target, tmp_path):
    """compile=on compiles the published drafter's passes (several layers, its own embeddings) too."""
    folder = write(tmp_path / "d", eagle_config(small_target), eagle_tensors(small_target, 2, embed=True))
    prompts = [[t % 16 for t in p] for p in RAGGED_PROMPTS]
    ref = SpeculativeDecoder(make_engine(small_target)).generate(prompts, max_new_tokens=16)
    engine = make_engine(small_target, compile="on")
    proposer = EagleProposer(engine, str(folder), budget=10, topk=3, width=3, depth=4)
    assert proposer.compiled is not None
    out = SpeculativeDecoder(engine, proposer, num_speculative_tokens=3).generate(prompts, max_new_tokens=16)
    assert out.output_ids == ref.output_ids and sum(r.accepted for r in out.stats.rows) > 0

def test_a_token_map_restricts_the_drafts_to_its_ids(small_target, tmp_path):
    folder = write(tmp_path / "d", eagle_config(small_target), eagle_tensors(small_target))
    from specdec.proposers.formats import read_drafter

    kept = torch.tensor([1, 3, 4, 8, 9, 12])
    files = read_drafter(folder, token_map=kept)
    engine = Engine(small_target, dtype="float32")
    proposer = EagleProposer(engine, files, budget=6, topk=2, width=2, depth=3)
    prompts = [[t % 16 for t in p] for p in RAGGED_PROMPTS]
    ref = SpeculativeDecoder(engine).generate(prompts, max_new_tokens=12)
    dec = SpeculativeDecoder(engine, proposer, num_speculative_tokens=3)
    state_tokens = []
    original = proposer.propose

    def propose(state, k):
        p = original(state, k)
        state_tokens.append(p.tokens)
        return p

    proposer.propose = propose
    out = dec.generate(prompts, max_new_tokens=12)
    assert out.output_ids == ref.output_ids
    drafted = torch.cat([t.flatten() for t in state_tokens])
    assert drafted.numel() and bool(torch.isin(drafted, kept).all())


# --- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("change, message", [
    (lambda c, t: c.update(vocab_size=300), "vocab_size=300 where the target has 256"),
    (lambda c, t: t.update({"embed_tokens.weight": torch.zeros(256, 64), "layers.0.self_attn.q_norm.weight":
                            torch.ones(16)}), "unexpected \\['layers.0.self_attn.q_norm.weight'\\]"),
])
def test_drafters_that_do_not_fit_the_target_are_refused(target, tmp_path, change, message):
    config, tensors = eagle_config(target), eagle_tensors(target)
    change(config, tensors)
    with pytest.raises(InvalidInput, match=message):
        EagleProposer(Engine(target, dtype="float32"), str(write(tmp_path / "d", config, tensors)))


def test_a_drafter_of_another_width_is_refused(target, tmp_path):
    narrow = tiny_random_model(seed=0, hidden_size=32, num_heads=2, num_kv_heads=1, eos_token_id=None)
    folder = write(tmp_path / "d", eagle_config(narrow), eagle_tensors(narrow))
    with pytest.raises(InvalidInput, match="hidden_size=32 where the target has 64"):
        EagleProposer(Engine(target, dtype="float32"), str(folder))


def test_a_medusa_folder_is_refused_naming_its_method(target, tmp_path):
    h = target.config.hidden_size
    folder = tmp_path / "m"
    folder.mkdir()
    torch.save({"0.0.linear.weight": torch.zeros(h, h), "0.0.linear.bias": torch.zeros(h),
                "0.1.weight": torch.zeros(256, h)}, str(folder / "medusa_lm_head.pt"))
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 1, "medusa_num_layers": 1}))
    with pytest.raises(InvalidInput, match="holds a medusa drafter .*use method=medusa"):
        EagleProposer(Engine(target, dtype="float32"), str(folder))


@pytest.mark.parametrize("path", [None, ""])
def test_a_missing_drafter_names_what_to_pass(target, path):
    with pytest.raises(InputError, match="method=eagle needs a drafter: set method.heads_path="):
        EagleProposer(Engine(target, dtype="float32"), path)


def test_heads_info_reads_folders_and_leaves_checkpoints_to_the_config(target, tmp_path):
    folder = write(tmp_path / "d", eagle_config(target), eagle_tensors(target))
    assert EagleProposer.heads_info(str(folder)) == (256, False)
    assert EagleProposer.heads_info("embedded") is None and EagleProposer.heads_info(None) is None



# --- the config: method=eagle method.heads_path=<folder> ----------------------------------------


def run_config(*overrides):
    """The experiment config on the tiny random target (seed 0: `target` here) with `overrides`."""
    from hydra import compose, initialize_config_dir

    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose("config", overrides=["~experiment", "target=tiny_random", "logger=none", *overrides])


def test_a_folder_runs_as_method_heads_path_and_a_broken_one_is_refused_before_any_model_loads(target, tmp_path):
    from specdec.study import experiment
    from specdec.study.config import ConfigError, validate

    folder = write(tmp_path / "d", eagle_config(target), eagle_tensors(target, layers=2))
    cfg = run_config("method=eagle", f"method.heads_path={folder}", "data.limit=1", "generation.max_new_tokens=8")
    validate(cfg)
    experiment.run(cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    drafted = {(r["prompt_id"], r["repeat"]): r for r in rows if r["method"] == "eagle"}
    plain = {(r["prompt_id"], r["repeat"]): r["output_text"] for r in rows if r["method"] == "autoregressive"}
    assert drafted and all(r["proposed"] > 0 and r["output_text"] == plain[key] for key, r in drafted.items())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^method.heads_path: .*holds no weights"):
        validate(run_config("method=eagle", f"method.heads_path={tmp_path / 'empty'}"))
    with pytest.raises(ConfigError, match=r"^method.proposer.topk: is 300, but the drafter proposes from 256 tokens"):
        validate(run_config("method=eagle", f"method.heads_path={folder}", "method.proposer.topk=300"))
