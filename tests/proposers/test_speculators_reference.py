"""specdec's EAGLE-3 reading and exporting checked against the `speculators` package itself.

The package (PyPI `speculators`, vLLM's training and conversion library) defines the canonical
EAGLE-3 names. A tiny random Eagle3 speculator is built with its own classes over a tiny random
Llama target and saved; `read_drafter` must read it, the drafter specdec builds from it must give the
package's logits (1e-5, float32) on the same target features, and a drafter exported by specdec
must load back in the package with the same logits. The package needs Python >= 3.11 and
transformers <= 5.19, so CI runs this file in a virtual environment of its own (.ci/run, last stage);
elsewhere it is skipped.
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("speculators", reason="the speculators package is not installed (.ci/run installs it in "
                                          ".make/venv-speculators)")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from specdec.proposers.export import export_speculators  # noqa: E402
from specdec.proposers.formats import read_drafter  # noqa: E402

V, VD, H, TARGET_LAYERS, T = 64, 16, 32, 6, 7
LAYER_IDS = [1, 3, 5]
DRAFT_IDS = torch.tensor([0, 1, 2, 3, 5, 8, 13, 21, 22, 30, 34, 40, 41, 55, 60, 63])  # VD target ids, ascending


def llama_config(layers):
    return LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random Llama, saved where the package reads it as the verifier. -> (model, folder)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(TARGET_LAYERS)).eval()
    folder = tmp_path_factory.mktemp("target")
    model.save_pretrained(folder)
    return model, folder


def eager(config):
    """The package's model defaults to flex attention; the reference runs eager attention on the CPU."""
    config.transformer_layer_config._attn_implementation = "eager"
    return config


@pytest.fixture(scope="module")
def speculator(target, tmp_path_factory):
    """A tiny random Eagle3 speculator built with the package's classes and saved. -> (model, folder)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    model_t, folder_t = target
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=llama_config(1), draft_vocab_size=VD, norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=LAYER_IDS,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            verifier=VerifierConfig(name_or_path=str(folder_t), architectures=["LlamaForCausalLM"])))
    model = Eagle3DraftModel(eager(config)).eval()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[DRAFT_IDS] = True
    model.load_vocab_mappings(t2d, DRAFT_IDS - torch.arange(VD))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("verifier_"):
                continue
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)
        model.embed_tokens.weight.copy_(model_t.get_input_embeddings().weight)
    folder = tmp_path_factory.mktemp("speculator")
    model.save_pretrained(folder)
    return model, folder


def features(target_model, seed=2):
    """(input ids [1, T], token embeddings [1, T, H], taps [1, T, 3H], positions [1, T]) of the target."""
    ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = target_model(ids, output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i] for i in LAYER_IDS], dim=-1)
    return ids, target_model.get_input_embeddings()(ids).detach(), taps, torch.arange(T)[None]


def package_logits(model, ids, taps, positions):
    """The package's own forward, one step: the logits its lm_head computes [1, T, Vd]."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    try:
        with torch.no_grad():
            model(hidden_states=taps, input_ids=ids, document_ids=torch.zeros_like(ids), position_ids=positions,
                  ttt_steps=1)
    finally:
        hook.remove()
    return seen[0]


def drafter_logits(drafter, embeds, taps, positions):
    with torch.no_grad():
        return drafter.logits(drafter(embeds, taps, positions))


def test_read_drafter_reads_the_package_folder(speculator):
    model, folder = speculator
    files = read_drafter(folder)
    assert (files.format, files.kind) == ("eagle3-speculators", "eagle3")
    cfg = files.config
    assert cfg["layer_ids"] == LAYER_IDS and cfg["layer_ids_source"]["ids"] == LAYER_IDS
    assert (cfg["vocab_size"], cfg["draft_vocab_size"], cfg["hidden_size"], cfg["num_layers"]) == (V, VD, H, 1)
    assert cfg["norm_before_residual"] is False and cfg["head_dim"] == H // 4
    assert torch.equal(torch.arange(VD) + files.tensors["d2t"], DRAFT_IDS)
    state = model.state_dict()
    for name, tensor in files.tensors.items():
        assert torch.equal(tensor, state[name]), name


def test_drafter_logits_equal_the_package_forward(target, speculator):
    eagle3 = pytest.importorskip("specdec.proposers.eagle3", reason="specdec.proposers.eagle3 is not there yet")
    model_t, _ = target
    model, folder = speculator
    drafter = eagle3.Eagle3Drafter.from_files(read_drafter(folder), model_t).eval()
    for seed in (2, 3):
        ids, embeds, taps, positions = features(model_t, seed)
        want = package_logits(model, ids, taps, positions)
        torch.testing.assert_close(drafter_logits(drafter, embeds, taps, positions), want, rtol=0, atol=1e-5)
    assert torch.equal(drafter.target_ids(torch.arange(VD)), DRAFT_IDS)


def test_an_exported_drafter_loads_back_in_the_package(target, speculator, tmp_path):
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    eagle3 = pytest.importorskip("specdec.proposers.eagle3", reason="specdec.proposers.eagle3 is not there yet")
    model_t, folder_t = target
    _, folder = speculator
    drafter = eagle3.Eagle3Drafter.from_files(read_drafter(folder), model_t).eval()
    out = export_speculators(drafter, tmp_path / "exported", str(folder_t),
                             embed_tokens=model_t.get_input_embeddings().weight)
    config = eager(Eagle3SpeculatorConfig.from_pretrained(out))
    loaded = Eagle3DraftModel.from_pretrained(out, config=config).eval()
    assert loaded.config.eagle_aux_hidden_state_layer_ids == LAYER_IDS
    ids, embeds, taps, positions = features(model_t, 4)
    torch.testing.assert_close(package_logits(loaded, ids, taps, positions),
                               drafter_logits(drafter, embeds, taps, positions), rtol=0, atol=1e-5)
    assert torch.equal(loaded.d2t, DRAFT_IDS - torch.arange(VD))
