"""Published drafters read into the canonical form (`specdec.proposers.formats`), the traps users
reported (FORMATS.md 1.3) each with a test, and the exporters' round trips.

Each test writes a tiny checkpoint with the published names and shapes into tmp_path."""

import itertools
import json

import pytest
import torch
from safetensors.torch import save_file

from specdec.core.errors import InvalidInput, MissingInput
from specdec.proposers.export import export_safeailab, export_speculators
from specdec.proposers.formats import read_drafter, vocab_map_to_d2t
from specdec.proposers.heads import save_checkpoint

H, HEADS, KV, HEAD_DIM, INTER, V, VD = 16, 2, 1, 8, 24, 40, 10


DRAWS = itertools.count(1)


def rand(*shape):
    """Random values, a new seed each call (every tensor differs, so a mixed-up name shows)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(next(DRAWS)))


def layer_tensors(prefix, in_width, input_norm=True, hidden_norm=True):
    t = {f"{prefix}self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, in_width),
         f"{prefix}self_attn.k_proj.weight": rand(KV * HEAD_DIM, in_width),
         f"{prefix}self_attn.v_proj.weight": rand(KV * HEAD_DIM, in_width),
         f"{prefix}self_attn.o_proj.weight": rand(H, HEADS * HEAD_DIM),
         f"{prefix}mlp.gate_proj.weight": rand(INTER, H), f"{prefix}mlp.up_proj.weight": rand(INTER, H),
         f"{prefix}mlp.down_proj.weight": rand(H, INTER), f"{prefix}post_attention_layernorm.weight": rand(H)}
    if input_norm:
        t[f"{prefix}input_layernorm.weight"] = rand(H)
    if hidden_norm:
        t[f"{prefix}hidden_norm.weight"] = rand(H)
    return t


def draft_ids(n=VD, vocab=V):
    """n target ids, spread over the vocabulary, ascending."""
    return torch.linspace(0, vocab - 1, n).round().long()


def eagle3_tensors(prefix="midlayer.", taps=3, draft=VD):
    t = {"fc.weight": rand(H, taps * H), **layer_tensors(prefix, 2 * H), "norm.weight": rand(H),
         "lm_head.weight": rand(draft, H)}
    if draft != V:
        ids = draft_ids(draft)
        t["d2t"] = ids - torch.arange(draft)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        t["t2d"] = t2d
    return t


LLAMA = {"hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HEAD_DIM,
         "intermediate_size": INTER, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 256,
         "vocab_size": V}


def write(folder, config, tensors, weights="model.safetensors"):
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if weights.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / weights))
    else:
        torch.save(tensors, folder / weights)
    return folder


def safeailab_eagle3(tmp_path, **config):
    return write(tmp_path / "safeailab", {**LLAMA, "architectures": ["LlamaForCausalLM"], "draft_vocab_size": VD,
                                          "num_hidden_layers": 1, **config}, eagle3_tensors())


def speculators_eagle3(tmp_path, tensors=None, **config):
    top = {"speculators_model_type": "eagle3", "architectures": ["Eagle3DraftModel"],
           "transformer_layer_config": {**LLAMA, "model_type": "llama", "num_hidden_layers": 1},
           "draft_vocab_size": VD, "eagle_aux_hidden_state_layer_ids": [2, 16, 29],
           "speculators_config": {"algorithm": "eagle3"}, **config}
    return write(tmp_path / "speculators", top, tensors or eagle3_tensors("layers.0."))


# ---- EAGLE-3 dialects -------------------------------------------------------------------------------


def test_safeailab_eagle3_renames_midlayer_and_counts_layers_from_the_tensors(tmp_path):
    """yuhuili/EAGLE3-Vicuna1.3-13B says num_hidden_layers=40 yet ships one mid-layer (sglang#33966)."""
    raw = eagle3_tensors()
    folder = write(tmp_path / "d", {**LLAMA, "draft_vocab_size": VD, "num_hidden_layers": 40}, raw)
    files = read_drafter(folder)
    assert (files.format, files.kind) == ("eagle3-safeailab", "eagle3")
    assert files.config["num_layers"] == 1
    assert any("num_hidden_layers=40" in n for n in files.notes)
    assert not any(k.startswith("midlayer.") for k in files.tensors)
    assert torch.equal(files.tensors["layers.0.hidden_norm.weight"], raw["midlayer.hidden_norm.weight"])
    cfg = files.config
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["draft_vocab_size"], cfg["target_hidden_size"]) == (H, V, VD, H)
    assert cfg["layer_ids"] is None and cfg["layer_ids_source"] is None
    assert cfg["norm_before_residual"] is False and cfg["rope_theta"] == 500000.0
    assert not cfg["attention_bias"] and not cfg["mlp_bias"]
    # d2t holds offsets: the draft token i is the target's i + d2t[i]
    assert torch.equal(torch.arange(VD) + files.tensors["d2t"], draft_ids())


def test_sglang_layer_ids_get_one_added_when_the_first_is_one(tmp_path):
    """SpecForge's default [1, N//2-1, N-4] is vLLM's [2, N//2, N-3]; SGLang adds 1 only when the first
    id is 1 (sglang#25454)."""
    cfg = {**LLAMA, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": VD}
    spec = read_drafter(write(tmp_path / "a", {**cfg, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28],
                                                                       "use_aux_hidden_state": True}}, eagle3_tensors()))
    assert spec.format == "eagle3-sglang"
    assert spec.config["layer_ids"] == [2, 16, 29]
    assert spec.config["layer_ids_source"]["ids"] == [1, 15, 28]
    other = read_drafter(write(tmp_path / "b", {**cfg, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}},
                               eagle3_tensors()))
    assert other.config["layer_ids"] == [2, 16, 29]
    assert "no +1" in other.config["layer_ids_source"]["convention"]


def test_speculators_layer_ids_are_kept_and_the_residual_default_is_recorded(tmp_path):
    files = read_drafter(speculators_eagle3(tmp_path))
    assert files.format == "eagle3-speculators"
    assert files.config["layer_ids"] == [2, 16, 29]
    assert files.config["norm_before_residual"] is False
    assert any("norm_before_residual" in n and "vLLM" in n for n in files.notes)
    said = read_drafter(speculators_eagle3(tmp_path / "x", norm_before_residual=True))
    assert said.config["norm_before_residual"] is True
    assert not any("norm_before_residual" in n for n in said.notes)


def test_speculators_unloaded_embeddings_are_dropped_and_an_unloaded_head_refused(tmp_path):
    """The package initialises embed_tokens and lm_head to NaN and saves them so when no verifier
    filled them."""
    tensors = {**eagle3_tensors("layers.0."), "embed_tokens.weight": torch.full((V, H), float("nan"))}
    files = read_drafter(speculators_eagle3(tmp_path / "a", tensors))
    assert "embed_tokens.weight" not in files.tensors and any("NaN" in n for n in files.notes)
    tensors["lm_head.weight"] = torch.full((VD, H), float("nan"))
    with pytest.raises(InvalidInput, match=r"lm_head\.weight holds NaN"):
        read_drafter(speculators_eagle3(tmp_path / "b", tensors))


def test_speculators_norm_before_fc_and_fc_norm_need_their_tensors(tmp_path):
    tensors = {**eagle3_tensors("layers.0."), "input_norm.weight": rand(3 * H)}
    files = read_drafter(speculators_eagle3(tmp_path / "a", tensors, norm_before_fc=True))
    assert files.config["norm_before_fc"] and not files.config["fc_norm"]
    with pytest.raises(InvalidInput, match="input_norm.weight"):
        read_drafter(speculators_eagle3(tmp_path / "b", norm_before_fc=True))
    with pytest.raises(InvalidInput, match=r"fc_norm\.0\.weight"):
        read_drafter(speculators_eagle3(tmp_path / "c", fc_norm=True))
    tensors = {**eagle3_tensors("layers.0."), **{f"fc_norm.{i}.weight": rand(H) for i in range(3)}}
    files = read_drafter(speculators_eagle3(tmp_path / "d", tensors, fc_norm=True, norm_output=True))
    assert files.config["fc_norm"] and files.config["norm_output"]


def test_sglang_eagle31_fc_norm_from_its_flag(tmp_path):
    tensors = {**eagle3_tensors(), **{f"fc_norm.{i}.weight": rand(H) for i in range(3)}}
    folder = write(tmp_path / "d", {**LLAMA, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": VD,
                                    "fc_norm": True, "norm_output": True}, tensors)
    files = read_drafter(folder)
    assert files.format == "eagle3-sglang" and files.config["fc_norm"] and files.config["norm_output"]


def test_modelopt_nested_config(tmp_path):
    eagle_config = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [1, 15, 28],
                    "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True, "use_mtp_layernorm": False}
    cfg = {**LLAMA, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": VD, "eagle_config": eagle_config}
    files = read_drafter(write(tmp_path / "a", cfg, eagle3_tensors()))
    assert files.format == "eagle3-modelopt" and files.config["layer_ids"] == [2, 16, 29]
    cfg["eagle_config"] = {**eagle_config, "use_last_layernorm": False}
    with pytest.raises(InvalidInput, match="use_last_layernorm"):
        read_drafter(write(tmp_path / "b", cfg, eagle3_tensors()))


def test_eagle3_target_hidden_size_from_fc(tmp_path):
    tensors = eagle3_tensors()
    tensors["fc.weight"] = rand(H, 3 * 24)
    files = read_drafter(write(tmp_path / "d", {**LLAMA, "draft_vocab_size": VD}, tensors))
    assert files.config["target_hidden_size"] == 24


@pytest.mark.parametrize("change, match", [
    (lambda c, t: t.pop("d2t"), r"without the tensor d2t"),
    (lambda c, t: t.__setitem__("d2t", draft_ids()), r"offsets"),  # ids where offsets belong
    (lambda c, t: t.__setitem__("midlayer.self_attn.q_proj.weight", rand(HEADS * HEAD_DIM, H)), r"2H = 32"),
    (lambda c, t: c.__setitem__("draft_vocab_size", 32000), r"draft_vocab_size=32000"),
    (lambda c, t: c.__setitem__("num_attention_heads", 4), r"num_attention_heads=4"),
    (lambda c, t: t.pop("midlayer.hidden_norm.weight"), r"layers\.0\.hidden_norm\.weight"),
    (lambda c, t: t.pop("norm.weight"), r"norm\.weight"),
    (lambda c, t: c.__setitem__("hidden_size", 4096), r"hidden_size=4096"),
])
def test_eagle3_refusals_name_format_key_and_expectation(tmp_path, change, match):
    config, tensors = {**LLAMA, "draft_vocab_size": VD}, eagle3_tensors()
    change(config, tensors)
    with pytest.raises(InvalidInput, match=match) as err:
        read_drafter(write(tmp_path / "d", config, tensors))
    assert "eagle3-safeailab" in str(err.value)


def test_speculators_other_algorithms_are_refused(tmp_path):
    with pytest.raises(InvalidInput, match="dflash"):
        read_drafter(speculators_eagle3(tmp_path, speculators_model_type="dflash"))


# ---- EAGLE-1/2 --------------------------------------------------------------------------------------


def eagle_tensors(layers=1, fc_bias=True, embed=False):
    t = {"fc.weight": rand(H, 2 * H)}
    if fc_bias:
        t["fc.bias"] = rand(H)
    for i in range(layers):
        t.update(layer_tensors(f"layers.{i}.", H, input_norm=i > 0, hidden_norm=False))
    if embed:
        t["embed_tokens.weight"] = rand(V, H)
    return t


def test_eagle1_bias_from_the_tensors_not_the_config(tmp_path):
    """Vicuna and LLaMA-2 EAGLE drafts carry fc.bias; older vLLM trusted the config and failed
    (vllm#11126). The config saying bias=false must not drop it."""
    folder = write(tmp_path / "d", {**LLAMA, "bias": False, "num_hidden_layers": 32}, eagle_tensors(2),
                   "pytorch_model.bin")
    files = read_drafter(folder)
    assert (files.format, files.kind) == ("eagle-safeailab", "eagle")
    assert files.config["fc_bias"] is True and "fc.bias" in files.tensors
    assert files.config["num_layers"] == 2
    assert any("bias=False" in n for n in files.notes)
    assert any("no embed_tokens" in n for n in files.notes)
    no_bias = read_drafter(write(tmp_path / "e", {**LLAMA, "bias": False}, eagle_tensors(1, fc_bias=False)))
    assert no_bias.config["fc_bias"] is False


def test_eagle1_layer_zero_lacks_input_layernorm_the_others_need_it(tmp_path):
    tensors = eagle_tensors(2, embed=True)
    files = read_drafter(write(tmp_path / "a", LLAMA, tensors))
    assert "layers.0.input_layernorm.weight" not in files.tensors
    assert "embed_tokens.weight" in files.tensors
    del tensors["layers.1.input_layernorm.weight"]
    with pytest.raises(InvalidInput, match=r"eagle-safeailab .*layers\.1\.input_layernorm\.weight"):
        read_drafter(write(tmp_path / "b", LLAMA, tensors))


def test_eagle1_needs_a_config(tmp_path):
    with pytest.raises(MissingInput, match="config.json"):
        read_drafter(write(tmp_path / "d", None, eagle_tensors()))


def test_token_map_gives_d2t(tmp_path):
    """SGLang's FR-Spec --speculative-token-map: a 1-D tensor of kept target ids, in any order."""
    ids = torch.tensor([30, 2, 17, 5, 39])
    d2t = vocab_map_to_d2t(ids)
    assert torch.equal(torch.arange(5) + d2t, torch.sort(ids).values)
    with pytest.raises(InvalidInput, match="repeat"):
        vocab_map_to_d2t(torch.tensor([3, 3]))
    with pytest.raises(InvalidInput, match="1-D"):
        vocab_map_to_d2t(torch.tensor([[1, 2]]))
    torch.save(ids, tmp_path / "freq_5.pt")
    files = read_drafter(write(tmp_path / "d", LLAMA, eagle_tensors()), token_map=tmp_path / "freq_5.pt")
    assert torch.equal(files.tensors["d2t"], d2t) and files.config["draft_vocab_size"] == 5
    full = read_drafter(write(tmp_path / "e", {**LLAMA, "draft_vocab_size": V}, eagle3_tensors(draft=V)),
                        token_map=ids)
    assert full.tensors["lm_head.weight"].shape == (5, H) and full.config["draft_vocab_size"] == 5


# ---- Medusa -----------------------------------------------------------------------------------------


def test_medusa_fasterdecoding_renamed_to_vllm_names(tmp_path):
    raw = {}
    for h in range(3):
        raw[f"{h}.0.linear.weight"], raw[f"{h}.0.linear.bias"] = rand(H, H), rand(H)
        raw[f"{h}.1.weight"] = rand(V, H)
    folder = write(tmp_path / "d", {"medusa_num_heads": 5, "medusa_num_layers": 1,
                                    "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}, raw, "medusa_lm_head.pt")
    files = read_drafter(folder)
    assert (files.format, files.kind) == ("medusa-fasterdecoding", "medusa")
    assert files.config["num_heads"] == 3 and files.config["num_layers"] == 1 and files.config["bias"]
    assert any("5 heads" in n for n in files.notes)
    for h in range(3):
        assert torch.equal(files.tensors[f"blocks.{h}.layers.0.weight"], raw[f"{h}.0.linear.weight"])
        assert torch.equal(files.tensors[f"blocks.{h}.layers.0.bias"], raw[f"{h}.0.linear.bias"])
        assert torch.equal(files.tensors[f"lm_heads.{h}.weight"], raw[f"{h}.1.weight"])


def test_medusa_shared_resblock_is_noted(tmp_path):
    """FasterDecoding's [ResBlock(H)] * L shares one block across a head's L layers."""
    raw = {}
    for h in range(2):
        w, b = rand(H, H), rand(H)
        for layer in range(2):
            raw[f"{h}.{layer}.linear.weight"], raw[f"{h}.{layer}.linear.bias"] = w, b
        raw[f"{h}.2.weight"] = rand(V, H)
    files = read_drafter(write(tmp_path / "d", {"medusa_num_heads": 2, "medusa_num_layers": 2}, raw,
                               "medusa_lm_head.pt"))
    assert files.config["num_layers"] == 2 and any("shares one block" in n for n in files.notes)


def test_medusa_fasterdecoding_head_without_its_lm_head_is_refused(tmp_path):
    raw = {"0.0.linear.weight": rand(H, H), "0.0.linear.bias": rand(H), "0.1.weight": rand(V, H),
           "1.0.linear.weight": rand(H, H), "1.0.linear.bias": rand(H)}
    with pytest.raises(InvalidInput, match="medusa-fasterdecoding head 1 has no output head"):
        read_drafter(write(tmp_path / "d", {"medusa_num_heads": 2}, raw, "medusa_lm_head.pt"))


def test_medusa_vllm_bias_and_token_map(tmp_path):
    token_map = torch.tensor([0, 3, 7, 9, 12, 20])
    raw = {f"blocks.{h}.layers.0.weight": rand(H, H) for h in range(2)}
    raw.update({f"blocks.{h}.layers.0.bias": rand(H) for h in range(2)})
    raw.update({f"lm_heads.{h}.weight": rand(6, H) for h in range(2)})
    raw["token_map"] = token_map
    folder = write(tmp_path / "d", {"model_type": "medusa", "num_heads": 2, "num_hidden_layers": 1,
                                    "truncated_vocab_size": 6, "vocab_size": V}, raw)
    files = read_drafter(folder)
    assert files.format == "medusa-vllm" and files.config["bias"] and files.config["truncated_vocab_size"] == 6
    assert not any("medusa_fc_bias" in n for n in files.notes)
    assert torch.equal(files.tensors["token_map"], token_map)
    noted = read_drafter(write(tmp_path / "e", {"model_type": "medusa", "num_heads": 2, "medusa_fc_bias": False,
                                                "vocab_size": V}, raw))
    assert any("medusa_fc_bias=False" in n for n in noted.notes) and noted.config["bias"]


# ---- files and specdec's own --------------------------------------------------------------------------


def test_specdec_checkpoint_kind_from_its_metadata(tmp_path):
    tensors = {"layer.weight": rand(4, 4)}
    path = save_checkpoint(tmp_path / "eagle.safetensors", "eagle", tensors, {"hidden_size": 4, "vocab_size": 8})
    files = read_drafter(path)
    assert (files.format, files.kind) == ("specdec", "eagle")
    assert files.config["vocab_size"] == 8 and torch.equal(files.tensors["layer.weight"], tensors["layer.weight"])


def test_unreadable_inputs_are_refused(tmp_path):
    with pytest.raises(MissingInput, match="does not exist"):
        read_drafter(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MissingInput, match="model.safetensors"):
        read_drafter(tmp_path / "empty")
    with pytest.raises(InvalidInput, match="not a drafter format"):
        read_drafter(write(tmp_path / "other", {"architectures": ["LlamaForCausalLM"]},
                           {"model.embed_tokens.weight": rand(V, H)}))
    folder = tmp_path / "pickled"
    folder.mkdir()
    torch.save({"fc": torch.nn.Linear(2, 2)}, folder / "pytorch_model.bin")
    with pytest.raises(InvalidInput, match="weights_only"):
        read_drafter(folder)


def test_sharded_safetensors_are_joined(tmp_path):
    tensors = eagle3_tensors()
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA, "draft_vocab_size": VD}))
    names = sorted(tensors)
    half = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for shard, keys in half.items():
        save_file({k: tensors[k].contiguous() for k in keys}, str(folder / shard))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: shard for shard, keys in half.items() for k in keys}}))
    assert read_drafter(folder).format == "eagle3-safeailab"


# ---- export round trips -------------------------------------------------------------------------------


def assert_same(a, b):
    assert set(a.tensors) == set(b.tensors)
    for k in a.tensors:
        assert torch.equal(a.tensors[k], b.tensors[k]), k
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
            "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size", "draft_vocab_size",
            "target_hidden_size", "layer_ids", "norm_before_residual", "norm_before_fc", "fc_norm",
            "norm_output", "attention_bias", "mlp_bias", "num_layers")
    assert {k: a.config[k] for k in keys} == {k: b.config[k] for k in keys}


def test_export_speculators_round_trip(tmp_path):
    source = read_drafter(write(tmp_path / "sg", {**LLAMA, "architectures": ["LlamaForCausalLMEagle3"],
                                                  "draft_vocab_size": VD, "norm_before_residual": True,
                                                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}},
                                eagle3_tensors()))
    out = export_speculators(source, tmp_path / "out", "meta-llama/Llama-3.1-8B-Instruct", speculative_tokens=5)
    written = json.loads((out / "config.json").read_text())
    assert written["speculators_model_type"] == "eagle3"
    assert written["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]  # vLLM's convention
    assert written["norm_before_residual"] is True
    assert written["speculators_config"]["verifier"]["name_or_path"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert written["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert written["transformer_layer_config"]["vocab_size"] == V
    back = read_drafter(out)
    assert back.format == "eagle3-speculators"
    assert_same(source, back)


def test_export_speculators_writes_t2d_from_d2t(tmp_path):
    tensors = eagle3_tensors()
    del tensors["t2d"]
    source = read_drafter(write(tmp_path / "d", {**LLAMA, "draft_vocab_size": VD}, tensors))
    back = read_drafter(export_speculators(source, tmp_path / "out"))
    assert torch.equal(back.tensors["t2d"].nonzero().flatten(), draft_ids())


def test_export_safeailab_round_trip_and_refusals(tmp_path):
    source = read_drafter(safeailab_eagle3(tmp_path))
    out = export_safeailab(source, tmp_path / "out")
    back = read_drafter(out)
    assert back.format == "eagle3-safeailab"
    assert_same(source, back)
    with pytest.raises(InvalidInput, match="layer_ids"):
        export_safeailab(read_drafter(speculators_eagle3(tmp_path)), tmp_path / "bad")
    with pytest.raises(InvalidInput, match="norm_before_residual"):
        export_safeailab(read_drafter(speculators_eagle3(tmp_path / "x", norm_before_residual=True,
                                                         eagle_aux_hidden_state_layer_ids=None)), tmp_path / "bad2")


def test_dialects_give_the_same_drafter(tmp_path):
    """The same weights read from SafeAILab's, SGLang's and the speculators layout draft the same."""
    eagle3 = pytest.importorskip("specdec.proposers.eagle3")
    tensors = eagle3_tensors()
    a = read_drafter(write(tmp_path / "a", {**LLAMA, "draft_vocab_size": VD}, tensors))
    b = read_drafter(export_speculators(a, tmp_path / "b"))
    embeds, hidden = rand(1, 5, H), rand(1, 5, 3 * H)
    positions = torch.arange(5)[None]
    outs = []
    for files in (a, b):
        drafter = eagle3.Eagle3Drafter({**files.config, "layer_ids": [2, 4, 6]})
        drafter.load_state_dict(files.tensors, strict=False)
        outs.append(drafter.logits(drafter(embeds, hidden, positions)))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
