"""MTP heads as drafters on tiny targets written to disk with MTP tensors in their shards: transformers
drops them when it loads the target and the reader finds them; the MTP logits equal a forward
written here from FORMATS.md's formulas (DeepSeek-V3 and Qwen3-Next layouts); the proposer's cached,
recursive chain equals that forward re-run over the whole sequence; greedy decoding of a DeepSeek-V3
target is token-identical to plain greedy, alone and in a ragged batch; sampling keeps the target's
distribution (and a twin whose q sits at the wrong token ids fails the same test); folders without MTP
weights, targets from no folder and tensors that do not fit are refused, naming the file and key.

Qwen3-Next's linear-attention layers are refused by the engine, so its MTP module is checked against
the forward written here only, not decoded."""

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import Engine
from specdec.core.errors import InputError, InvalidInput, MissingInput
from specdec.core.sampling import SamplingParams
from specdec.proposers.base import Proposal
from specdec.proposers.mtp import DEEPSEEK, QWEN3_NEXT, MTPDrafter, MTPProposer, check_target_files, find_mtp
from tests.conftest import RAGGED_PROMPTS
from tests.stats import chi_square_pvalue, exact_joint_of_tokens_2_and_3

N_LAYERS = 2


def _deepseek_config(vocab: int, layers: int, mtp: int) -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=256, num_nextn_predict_layers=mtp,
        initializer_range=0.1, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        attn_implementation="sdpa")


def _qwen3_next_config(vocab: int, kinds: list[str], mtp: int) -> Qwen3NextConfig:
    return Qwen3NextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=len(kinds), layer_types=kinds, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        max_position_embeddings=256, num_nextn_predict_layers=mtp, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="sdpa")


def _saved_tensors(model, folder: Path) -> dict[str, torch.Tensor]:
    """The tensors `save_pretrained` writes for `model` (experts one by one, as published shards hold them)."""
    model.save_pretrained(folder)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _write(folder: Path, config, tensors: dict[str, torch.Tensor], sharded: bool) -> None:
    """config.json and the tensors: one model.safetensors, or two shards and their index."""
    for old in folder.glob("*.safetensors"):
        old.unlink()
    config.save_pretrained(folder)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if not sharded:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def write_deepseek(folder: Path, vocab: int = 16, mtp: int = 1, seed: int = 0, sharded: bool = True,
                   own_embed: bool = True, logit_std: float = 3.0) -> SimpleNamespace:
    """A tiny DeepSeek-V3 target in `folder`, with `mtp` MTP layers as DeepSeek ships them: the target's
    N layers, then layers N..N+mtp-1 (a decoder block each, here the extra layers of a model built with
    N+mtp layers, whose own loader gives the reference) with enorm, hnorm, eh_proj, shared_head and
    (own_embed) embed_tokens. Returns the folder and the reference model."""
    torch.manual_seed(seed)
    donor = DeepseekV3ForCausalLM(_deepseek_config(vocab, N_LAYERS + mtp, mtp)).eval()
    with torch.no_grad():
        donor.lm_head.weight.normal_(0.0, logit_std / 32**0.5)
    tensors = _saved_tensors(donor, folder / "donor")
    for k in range(mtp):
        p = f"model.layers.{N_LAYERS + k}."
        tensors[p + "enorm.weight"] = 1 + 0.2 * torch.randn(32)
        tensors[p + "hnorm.weight"] = 1 + 0.2 * torch.randn(32)
        tensors[p + "eh_proj.weight"] = torch.randn(32, 64) / 8
        tensors[p + "shared_head.norm.weight"] = 1 + 0.2 * torch.randn(32)
        tensors[p + "shared_head.head.weight"] = donor.lm_head.weight.detach() + 0.3 * torch.randn(vocab, 32) / 32**0.5
        if own_embed:
            tensors[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    _write(folder, _deepseek_config(vocab, N_LAYERS, mtp), tensors, sharded)
    return SimpleNamespace(folder=folder, donor=donor, tensors=tensors, mtp=mtp, layout=DEEPSEEK)


def write_qwen3_next(folder: Path, vocab: int = 16, mtp: int = 1, seed: int = 0) -> SimpleNamespace:
    """A tiny Qwen3-Next target (a linear-attention layer, then a full-attention one) with `mtp.*` as
    Qwen ships it: fc, the two pre-fc norms, mtp.layers.{k} (here the layers of a full-attention model
    built for them) and mtp.norm."""
    torch.manual_seed(seed)
    target = Qwen3NextForCausalLM(_qwen3_next_config(vocab, ["linear_attention", "full_attention"], mtp)).eval()
    tensors = _saved_tensors(target, folder / "target")
    donor = Qwen3NextForCausalLM(_qwen3_next_config(vocab, ["full_attention"] * mtp, mtp)).eval()
    for key, value in _saved_tensors(donor, folder / "donor").items():
        if key.startswith("model.layers."):
            tensors["mtp." + key.removeprefix("model.")] = value
    tensors["mtp.fc.weight"] = torch.randn(32, 64) / 8
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):  # zero-centred: 1 + w scales
        tensors[f"mtp.{name}.weight"] = 0.2 * torch.randn(32)
    _write(folder, target.config, tensors, sharded=True)
    return SimpleNamespace(folder=folder, donor=donor, tensors=tensors, mtp=mtp, layout=QWEN3_NEXT)


def load_target(folder: Path):
    """The target as transformers loads it, and what it reported dropping."""
    cls = DeepseekV3ForCausalLM if json.loads((folder / "config.json").read_text())["model_type"] == "deepseek_v3" \
        else Qwen3NextForCausalLM
    model, info = cls.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    written = write_deepseek(tmp_path_factory.mktemp("deepseek"))
    written.model, written.info = load_target(written.folder)
    return written


# --- the forward of the published formulas -------------------------------------------------------


def _rms(x, w, eps, centred=False):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * ((1 + w) if centred else w)


def reference(written, target, k: int, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
    """MTP layer k from FORMATS.md 1.2, its block the reference model's own layer (loaded by
    transformers from its own files) over a causal mask -> (the hidden state fed back, logits)."""
    t, c = written.tensors, target.config
    eps = c.rms_norm_eps
    block = written.donor.model.layers[N_LAYERS + k if written.layout == DEEPSEEK else k]
    mask = torch.full((tokens.shape[1],) * 2, torch.finfo(torch.float32).min).triu(1)[None, None]
    if written.layout == DEEPSEEK:
        p = f"model.layers.{N_LAYERS + k}."
        emb = t[p + "embed_tokens.weight"][tokens] if p + "embed_tokens.weight" in t else \
            t["model.embed_tokens.weight"][tokens]
        emb = emb * (positions != 0)[..., None]  # vLLM zeroes the embedding at position 0
        x = torch.cat([_rms(emb, t[p + "enorm.weight"], eps), _rms(hidden, t[p + "hnorm.weight"], eps)], -1)
        x = x @ t[p + "eh_proj.weight"].T
        out = block(x, attention_mask=mask, position_ids=positions,
                    position_embeddings=written.donor.model.rotary_emb(x, positions))
        return out, _rms(out, t[p + "shared_head.norm.weight"], eps) @ t[p + "shared_head.head.weight"].T
    emb = t["model.embed_tokens.weight"][tokens]
    x = torch.cat([_rms(emb, t["mtp.pre_fc_norm_embedding.weight"], eps, True),
                   _rms(hidden, t["mtp.pre_fc_norm_hidden.weight"], eps, True)], -1) @ t["mtp.fc.weight"].T
    out = block(x, attention_mask=mask, position_ids=positions,
                position_embeddings=written.donor.model.rotary_emb(x, positions))
    normed = _rms(out, t["mtp.norm.weight"], eps, True)
    return normed, normed @ t["lm_head.weight"].T


def _check_forward(written, target, layers: int):
    files = find_mtp(written.folder, target.config)
    assert (files.layout, files.num_layers) == (written.layout, layers)
    drafter = MTPDrafter.from_files(files, target).eval()
    torch.manual_seed(1)
    tokens = torch.randint(0, target.config.vocab_size, (2, 7))
    hidden = torch.randn(2, 7, 32)
    positions = torch.arange(7).expand(2, 7)  # position 0 included: DeepSeek's zeroed embedding
    with torch.inference_mode():
        for k in range(layers):
            fed, normed = drafter(k, drafter.embed(k, tokens), hidden, positions)
            ref_fed, ref_logits = reference(written, target, k, tokens, hidden, positions)
            torch.testing.assert_close(fed, ref_fed, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(drafter.logits(k, normed), ref_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mtp, sharded, own_embed", [(1, True, True), (2, False, False)])
def test_deepseek_mtp_logits_follow_the_published_formulas(tmp_path, mtp, sharded, own_embed):
    written = write_deepseek(tmp_path, mtp=mtp, sharded=sharded, own_embed=own_embed)
    target, info = load_target(tmp_path)
    own = {f"model.layers.{N_LAYERS + k}.{n}.weight" for k in range(mtp) for n in ("enorm", "hnorm", "eh_proj")}
    assert own <= set(info["unexpected_keys"])  # transformers read past them ...
    assert all(k.startswith(tuple(f"model.layers.{N_LAYERS + k}." for k in range(mtp))) for k in info["unexpected_keys"])
    assert not any(k.startswith(f"model.layers.{N_LAYERS}.") for k in target.state_dict())  # ... and kept none
    _check_forward(written, target, mtp)


def test_qwen3_next_mtp_logits_follow_the_published_formulas(tmp_path):
    written = write_qwen3_next(tmp_path)
    target, info = load_target(tmp_path)
    assert not any(k.startswith("mtp.") for k in target.state_dict())  # `^mtp.*`: dropped without a word
    assert not any(k.startswith("mtp.") for k in info["unexpected_keys"])
    _check_forward(written, target, 1)


# --- the proposer's chain: the cached recursion, greedy identity, sampling ----------------------


@pytest.mark.parametrize("mtp", [1, 2])
def test_the_cached_chain_equals_the_forward_rerun_over_the_sequence(deepseek, tmp_path, mtp):
    """Each step's draft distributions q (sampling at temperature 1, so q is the MTP head's softmax)
    equal the forward re-run from scratch over the committed sequence: every position with the
    target's features (after its final norm), then each draft appended with the previous step's
    output as its hidden state, step i through MTP layer i % n."""
    written = deepseek if mtp == 1 else write_deepseek(tmp_path, mtp=2, seed=5)
    target, k = (deepseek.model if mtp == 1 else load_target(tmp_path)[0]), 3
    engine = Engine(target, dtype="float32")
    proposer = MTPProposer(engine)
    steps = []
    original = proposer.propose

    def propose(state, n):
        steps.append((list(state.committed[0][: state.seq_lens[0]]), original(state, n)))
        return steps[-1][1]

    proposer.propose = propose
    SpeculativeDecoder(engine, proposer, num_speculative_tokens=k).generate([[5, 6, 7, 8, 9, 3]], max_new_tokens=12,
                                                                          temperature=1.0, seed=0)
    assert len(steps) > 2
    with torch.inference_mode():
        for committed, proposal in steps:
            seq = torch.tensor([committed])
            tokens = seq[:, 1:]
            feats = target(seq[:, :-1], output_hidden_states=True).hidden_states[-1]
            for i in range(proposal.lengths[0]):
                fed, logits = reference(written, target, i % mtp, tokens, feats, torch.arange(tokens.shape[1])[None])
                torch.testing.assert_close(proposal.probs[0, i], torch.softmax(logits[0, -1], -1), atol=1e-5, rtol=1e-4)
                tokens = torch.cat([tokens, proposal.tokens[:, i : i + 1]], 1)
                feats = torch.cat([feats, fed[:, -1:]], 1)


def _greedy_check(model, prompts, k):
    engine = Engine(model, dtype="float32")
    ref = SpeculativeDecoder(engine).generate(prompts, max_new_tokens=20)
    out = SpeculativeDecoder(engine, MTPProposer(engine), num_speculative_tokens=k).generate(prompts, max_new_tokens=20)
    assert out.output_ids == ref.output_ids and out.lossless
    assert sum(r.accepted for r in out.stats.rows) > 0  # drafts were accepted: the cache rolled forward


@pytest.mark.parametrize("batch", ["single", "ragged"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equals_plain_greedy(deepseek, batch, k):
    prompts = [[t % 16 for t in p] for p in RAGGED_PROMPTS[: 1 if batch == "single" else 3]]
    _greedy_check(deepseek.model, prompts, k)


def test_greedy_with_two_mtp_layers_equals_plain_greedy(tmp_path):
    write_deepseek(tmp_path, mtp=2, sharded=False, own_embed=False, seed=4)
    _greedy_check(load_target(tmp_path)[0], [[t % 16 for t in p] for p in RAGGED_PROMPTS], 3)


V = 8
PROMPT = [3, 5, 2, 7, 4, 6, 3, 5, 1]
PARAMS = SamplingParams(temperature=0.9, top_k=6)
N = 10_000


@pytest.fixture(scope="module")
def sampling_target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sampling")
    write_deepseek(folder, vocab=V, seed=11, logit_std=1.5)
    return load_target(folder)[0]


class ShiftedQ(MTPProposer):
    """Deliberately broken: hands the verifier the MTP head's distribution one token id off."""

    def propose(self, state, k):
        p = super().propose(state, k)
        return p if p.probs is None else Proposal(p.tokens, p.lengths, torch.roll(p.probs, 1, dims=-1))


@pytest.mark.parametrize("cls, fits", [(MTPProposer, True), (ShiftedQ, False)])
def test_sampling_keeps_the_targets_distribution(sampling_target, cls, fits):
    engine = Engine(sampling_target, dtype="float32")
    dec = SpeculativeDecoder(engine, cls(engine), num_speculative_tokens=2)
    out = dec.generate([PROMPT] * N, max_new_tokens=4, temperature=PARAMS.temperature, top_k=PARAMS.top_k, seed=0)
    assert out.lossless and out.verifier == "speculative_sampling"
    assert 0.05 < out.stats.acceptance_rate < 0.95
    pairs = torch.tensor([o[1:3] for o in out.output_ids])
    counts = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
    p = chi_square_pvalue(counts, exact_joint_of_tokens_2_and_3(sampling_target, PROMPT, PARAMS, V))
    assert p > 1e-3 if fits else p < 1e-6


# --- refusals ------------------------------------------------------------------------------------


def test_the_configs_check_reads_the_folder_before_any_model_loads(deepseek):
    check_target_files(deepseek.folder)  # its MTP layer is there


def test_a_target_from_no_folder_is_refused(deepseek):
    config = copy.deepcopy(deepseek.model.config)
    config._name_or_path = ""
    built = DeepseekV3ForCausalLM(config).eval()  # in process: the same model, no folder
    with pytest.raises(InvalidInput, match=r"came from no folder"):
        MTPProposer(Engine(built, dtype="float32"))
    with pytest.raises(InvalidInput, match=r"target=tiny_random is built in process"):
        check_target_files("tiny_random")


def _rewrite(folder: Path, change) -> None:
    files = sorted(folder.glob("*.safetensors"))
    tensors = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            tensors |= {k: f.get_tensor(k) for k in f.keys()}
    change(tensors)
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    _write(folder, DeepseekV3Config.from_pretrained(folder), tensors, sharded=False)


@pytest.mark.parametrize("change, error, message", [
    (lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.2.")], MissingInput,
     r"model.safetensors has no key model.layers.2.eh_proj.weight: the config declares 1 MTP layer"),
    (lambda t: t.update({"model.layers.2.eh_proj.weight": torch.zeros(32, 48)}), InvalidInput,
     r"model.safetensors: model.layers.2.eh_proj.weight has shape \(32, 48\), but the target's config gives "
     r"its MTP layer \(32, 64\)"),
    (lambda t: t.update({"model.layers.2.shared_head.head.weight": torch.zeros(20, 32)}), InvalidInput,
     r"model.layers.2.shared_head.head.weight has shape \(20, 32\)"),
    (lambda t: t.pop("model.layers.2.shared_head.norm.weight"), InvalidInput,
     r"has no key model.layers.2.shared_head.norm.weight"),
    (lambda t: t.pop("model.layers.2.self_attn.o_proj.weight"), InvalidInput,
     r"has no key model.layers.2.self_attn.o_proj.weight"),
    (lambda t: t.update({"model.layers.2.mlp.experts.3.down_proj.weight_scale_inv": torch.ones(1)}), InvalidInput,
     r"is a quantization scale"),
])
def test_mtp_weights_that_are_missing_or_do_not_fit_are_refused(tmp_path, change, error, message):
    write_deepseek(tmp_path, sharded=False)
    _rewrite(tmp_path, change)
    target = load_target(tmp_path)[0]
    with pytest.raises(error, match=message):
        MTPProposer(Engine(target, dtype="float32"))


def test_layers_the_config_declares_but_the_shards_lack_are_named(tmp_path):
    write_deepseek(tmp_path, sharded=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    target = load_target(tmp_path)[0]
    with pytest.raises(MissingInput, match=r"model.safetensors.index.json has no key model.layers.3.eh_proj.weight"):
        MTPProposer(Engine(target, dtype="float32"))
    with pytest.raises(InputError, match=r"has no key model.layers.3.eh_proj.weight"):
        check_target_files(tmp_path)


def test_a_target_without_mtp_weights_is_refused(tmp_path):
    write_deepseek(tmp_path, sharded=False)
    _rewrite(tmp_path, lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.2.")])
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    target = load_target(tmp_path)[0]
    with pytest.raises(MissingInput, match=r"model.safetensors holds no MTP weights: no key "
                                           r"model.layers.2.eh_proj.weight \(DeepSeek-V3/GLM layout\) and no mtp"):
        MTPProposer(Engine(target, dtype="float32"))


def test_a_folder_without_shards_is_refused(deepseek, tmp_path):
    with pytest.raises(MissingInput, match=r"holds neither model.safetensors.index.json nor model.safetensors"):
        find_mtp(tmp_path, deepseek.model.config)


def test_qwen3_next_without_fc_names_the_key(tmp_path):
    written = write_qwen3_next(tmp_path)
    tensors = dict(written.tensors)
    tensors.pop("mtp.fc.weight")
    _write(tmp_path, load_target(tmp_path)[0].config, tensors, sharded=True)
    target = load_target(tmp_path)[0]
    with pytest.raises(InvalidInput, match=r"has no key mtp.fc.weight"):
        MTPDrafter.from_files(find_mtp(tmp_path, target.config), target)


def test_the_runs_validation_checks_the_targets_folder(deepseek, tmp_path):
    """`method=mtp` with a target folder: validation resolves the folder and reads its index before any
    model loads; a folder without MTP weights is refused under `target.path`."""
    from hydra import compose, initialize_config_dir

    from specdec.models import tiny_random_model
    from specdec.study.config import ConfigError, validate

    conf = str(Path(__file__).resolve().parents[2] / "conf")
    tiny_random_model(seed=0).save_pretrained(tmp_path / "plain")
    for folder, ok in ((deepseek.folder, True), (tmp_path / "plain", False)):
        with initialize_config_dir(config_dir=conf, version_base="1.3"):
            cfg = compose("config", overrides=["~experiment", "method=mtp", f"target.path={folder}", "draft=none"])
        if ok:
            validate(cfg)
        else:
            with pytest.raises(ConfigError, match=r"^target.path: .*MTP"):
                validate(cfg)
