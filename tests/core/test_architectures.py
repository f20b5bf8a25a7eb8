"""Other architectures: specdec's greedy decoding equals transformers' `generate()` for each layout.

Each tiny random model is built in-process from its config (float32, 3 layers, vocabulary 128) and
covers one attention layout: rotary Llama; Qwen2 with full and sliding-window layers mixed; Mistral
with one sliding window for all layers; Gemma-2 and Gemma-3 with alternating sliding and full layers
and soft-capped logits (eager attention); Gemma-3 inside its multimodal wrapper, whose layout is in
the text config (SDPA, the vision tower unused); Phi-3 with fused projections; GPT-NeoX with partial
rotary and parallel residuals; BERT as a decoder (learned absolute positions, post-norm layers);
Falcon (multi-query, its attention choosing SDPA by the implementation's name, so it keeps plain
SDPA rather than specdec's grouped form, under which it took its other branch and misread SDPA's
boolean masks); DeepSeek-V2's latent attention with fewer key heads than query heads; Cohere, whose
logits are the head's scaled. The
windows (4) are far shorter than the prompts, so a mask that ignores them changes the logits from the
first ragged step on. A layout the engine cannot serve (ALiBi, attention kinds it does not mask,
implementations that take no 4-D mask, soft-capping under SDPA, an encoder without `is_decoder`,
a model that builds its own masks, a window applied by the cache alone) is refused when the engine
is built, naming the model type.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from specdec.core.attention import AttentionLayout, UnsupportedModelError
from specdec.core.decoding import SpeculativeDecoder
from specdec.core.engine import CachedModel, Engine
from specdec.models import ModelSpec, load_model, tiny_random_model, tiny_random_tokenizer
from specdec.proposers.draft_model import DraftModelProposer

VOCAB = 128
WINDOW = 4
NEW_TOKENS = 12
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [3, 4], [20, 21, 22, 23, 24, 25, 26]]

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=4, max_position_embeddings=256, initializer_range=0.1,
               bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
_GQA = dict(num_key_value_heads=2)
_GEMMA = dict(_GQA, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
              attn_logit_softcapping=5.0, final_logit_softcapping=10.0)



def _gemma3_multimodal(**text):
    """Gemma-3 with its (tiny) vision tower: `text` goes to the text config, where the layout is."""
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=28, patch_size=14)
    return tf.Gemma3Config(text_config=tf.Gemma3TextConfig(**text), vision_config=vision, mm_tokens_per_image=4,
                           image_token_id=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
                           tie_word_embeddings=False)


_SLIDING_FULL_SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]

# name -> (config class or builder, arguments on top of _COMMON, attention implementation)
ARCHITECTURES = {
    "llama": (tf.LlamaConfig, _GQA, "sdpa"),
    "qwen2_sliding": (tf.Qwen2Config, dict(_GQA, use_sliding_window=True, sliding_window=WINDOW,
                                           max_window_layers=1), "sdpa"),
    "mistral_sliding": (tf.MistralConfig, dict(_GQA, sliding_window=WINDOW), "sdpa"),
    "gemma2": (tf.Gemma2Config, _GEMMA, "eager"),
    "gemma3": (tf.Gemma3TextConfig, dict(_GEMMA, layer_types=_SLIDING_FULL_SLIDING), "eager"),
    "gemma3_multimodal": (_gemma3_multimodal, dict(_GQA, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                                   layer_types=_SLIDING_FULL_SLIDING), "sdpa"),
    "phi3": (tf.Phi3Config, _GQA, "sdpa"),
    "gpt_neox": (tf.GPTNeoXConfig, dict(rotary_pct=0.5), "sdpa"),
    "bert_decoder": (tf.BertConfig, dict(is_decoder=True), "sdpa"),
    # multi-query attention that picks SDPA by the implementation's name, its own attention code otherwise
    "falcon": (tf.FalconConfig, dict(multi_query=True), "sdpa"),
    # logits scaled after the head (`logit_scale`, 0.0625)
    "cohere": (tf.CohereConfig, _GQA, "sdpa"),
    # latent attention (MLA) with fewer key heads than query heads: transformers' own SDPA call fails
    # on it (its keys are not repeated to the query heads); specdec's grouped SDPA reads the grouping
    "deepseek_v2_mla": (tf.DeepseekV2Config, dict(_GQA, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                                  qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                                                  num_experts_per_tok=2, moe_intermediate_size=32,
                                                  n_shared_experts=1, n_group=1, topk_group=1), "sdpa"),
}
EXPECTED_LAYERS = {
    "qwen2_sliding": ("full_attention", "sliding_attention", "sliding_attention"),
    "mistral_sliding": ("sliding_attention",) * 3,
    "gemma2": ("sliding_attention", "full_attention", "sliding_attention"),
    "gemma3": ("sliding_attention", "full_attention", "sliding_attention"),
    "gemma3_multimodal": ("sliding_attention", "full_attention", "sliding_attention"),
}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random model of architecture `name`, logits with std ~3 (clear greedy argmaxes)."""
    config_class, extra, attention = ARCHITECTURES[name]
    config = config_class(**_COMMON, **extra)
    config._attn_implementation = attention
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
        head = model.get_output_embeddings()
        head.weight.normal_(0.0, 3.0 / head.in_features**0.5)
    return model.float()


def greedy_reference(model: torch.nn.Module) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone: NEW_TOKENS tokens, EOS ignored."""
    reference = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)
        reference.append(out[0, len(prompt):].tolist())
    return reference


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def arch(request):
    """(name, model, per-prompt greedy continuations from transformers' generate())."""
    model = build(request.param)
    return request.param, model, greedy_reference(model)


@pytest.fixture(scope="module")
def unrelated_draft():
    return tiny_random_model(seed=7, vocab_size=VOCAB, num_layers=1, eos_token_id=None)


def test_layer_types_read_from_the_config(arch):
    name, model, _ = arch
    layout = AttentionLayout.of(model)
    assert layout.layer_types == EXPECTED_LAYERS.get(name, ("full_attention",) * 3)
    assert layout.sliding_window == (WINDOW if name in EXPECTED_LAYERS else None)


@pytest.mark.parametrize("drafter", ["plain", "self", "unrelated"])
def test_greedy_equals_generate_at_batch_one_and_ragged(arch, drafter, unrelated_draft):
    """Plain decoding and speculative decoding (the model drafting for itself, an unrelated tiny
    Llama drafting) give transformers' greedy tokens, one prompt at a time and in a ragged batch."""
    name, model, reference = arch
    draft = {"plain": None, "self": model, "unrelated": unrelated_draft}[drafter]
    engine = Engine(model, draft, dtype="float32")
    if draft is None:
        decoder = SpeculativeDecoder(engine)
    else:
        decoder = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=3)
    single = [decoder.generate([p], max_new_tokens=NEW_TOKENS).output_ids[0] for p in PROMPTS]
    assert single == reference, f"{name} batch 1"
    ragged = decoder.generate(PROMPTS, max_new_tokens=NEW_TOKENS).output_ids
    assert ragged == reference, f"{name} ragged batch"


EAGLE_LAYOUTS = {"llama", "qwen2_sliding", "mistral_sliding", "gemma2", "gemma3", "gemma3_multimodal", "phi3",
                 "gpt_neox", "falcon", "deepseek_v2_mla", "cohere"}


def test_eagle_drafts_losslessly_or_is_refused_when_built(arch, tmp_path):
    """The EAGLE drafter copies the target's layer, norm and rotary classes: on a Llama-like layout
    (a drafter started from the target's last layer; Gemma-3's rotary, which takes the layer's type, is
    given the drafter's; GPT-NeoX's layers and final norm under other names, its cache argument
    `layer_past`; Falcon's layer, which takes an ALiBi bias, None) it gives transformers' greedy tokens;
    on another (BERT: no rotary embedding) it is refused as it is built, not at the first draft."""
    from specdec.proposers.eagle import EagleDrafter, EagleProposer
    from specdec.proposers.heads import save_checkpoint

    name, model, reference = arch
    engine = Engine(model, dtype="float32")
    if name not in EAGLE_LAYOUTS:
        with pytest.raises(ValueError, match="method=eagle needs a Llama-like target"):
            EagleDrafter(model)
        return
    path = tmp_path / "eagle.safetensors"
    save_checkpoint(str(path), "eagle", EagleDrafter(model).state_dict(),
                    {"hidden_size": model.config.get_text_config(decoder=True).hidden_size, "vocab_size": VOCAB})
    decoder = SpeculativeDecoder(engine, EagleProposer(engine, str(path), budget=4, topk=2, width=2, depth=2),
                                 num_speculative_tokens=2)
    assert decoder.generate(PROMPTS, max_new_tokens=NEW_TOKENS).output_ids == reference, name


def _qwen2_moe_dense_first():
    """Qwen2-MoE whose first layer has a dense MLP and the others experts (`mlp_only_layers`)."""
    return tf.Qwen2MoeConfig(**_COMMON, **_GQA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, mlp_only_layers=[0])


def _cohere2_moe_layer_norm():
    """Cohere2-MoE with its default final norm, a LayerNorm whose epsilon is `layer_norm_eps`
    (`rms_norm_eps=None`)."""
    return tf.Cohere2MoeConfig(**_COMMON, **_GQA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               layer_types=["full_attention"] * 3)


def _got_ocr2():
    """GOT-OCR2: a Qwen2 language model inside a multimodal wrapper (a tiny vision tower, unused),
    whose top-level config has no `hidden_size`; transformers gives it no SDPA."""
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, mlp_dim=64, output_channels=32,
                  global_attn_indexes=(0,))
    return tf.GotOcr2Config(text_config=dict(model_type="qwen2", **_COMMON, **_GQA), vision_config=vision,
                            image_token_index=VOCAB - 1, tie_word_embeddings=False)


def _gemma4():
    """Gemma-4 without per-layer inputs (as its larger checkpoints): its rotary takes the layer's type,
    and its layers hand their keys and values on through a dict (`shared_kv_states`) every layer gets."""
    return tf.Gemma4TextConfig(**_COMMON, **_GQA, head_dim=16, global_head_dim=16, sliding_window=WINDOW,
                               hidden_size_per_layer_input=0,
                               layer_types=["sliding_attention", "sliding_attention", "full_attention"])


def _longcat_flash():
    """LongCat-Flash: two latent attentions a decoder layer, at cache indices 2i and 2i + 1 (one key per
    head, as in the released checkpoints)."""
    return tf.LongcatFlashConfig(vocab_size=VOCAB, hidden_size=64, num_layers=3, num_attention_heads=4,
                                 num_key_value_heads=4, ffn_hidden_size=128, expert_ffn_hidden_size=32,
                                 n_routed_experts=4, zero_expert_num=2, moe_topk=2, q_lora_rank=32, kv_lora_rank=16,
                                 qk_nope_head_dim=8, qk_rope_head_dim=8, head_dim=8, v_head_dim=16,
                                 max_position_embeddings=256, initializer_range=0.1, bos_token_id=None,
                                 eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)


@pytest.mark.parametrize("make, attention", [(_qwen2_moe_dense_first, "sdpa"), (_cohere2_moe_layer_norm, "sdpa"),
                                             (_got_ocr2, "eager"), (_longcat_flash, "sdpa"), (_gemma4, "sdpa")],
                         ids=["dense_first", "layer_norm", "wrapper", "two_attentions", "gemma4"])
def test_eagle_drafter_copies_the_targets_last_layer_and_norm(make, attention, tmp_path):
    """The drafter's layer is of the target's last layer's kind (a mixture of experts after a dense
    first layer: built at index 0 it was dense, and copying the last layer's weights into it failed),
    its norm is the target's final norm with that norm's epsilon (a LayerNorm reads `layer_norm_eps`;
    built from `rms_norm_eps`, None here, its first pass raised a TypeError), its sizes come from the
    language model's config (a multimodal wrapper's top-level config has none: an AttributeError), and
    its cache has a layer for each attention of the layer (LongCat-Flash's second attention wrote past
    a one-layer cache: an IndexError), and Gemma-4's layer gets the dict its attention hands its keys
    and values on through (a TypeError on None). All decode with transformers' greedy tokens."""
    from specdec.proposers.eagle import EagleDrafter, EagleProposer
    from specdec.proposers.heads import save_checkpoint

    config = make()
    hidden = config.get_text_config(decoder=True).hidden_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
        model = model.eval().requires_grad_(False)
        model.get_output_embeddings().weight.normal_(0.0, 3.0 / hidden**0.5)
    model = model.float()
    decoder = model.get_decoder()
    drafter = EagleDrafter(model)
    assert drafter.layer.state_dict().keys() == decoder.layers[-1].state_dict().keys()
    assert type(drafter.norm) is type(decoder.norm)
    assert getattr(drafter.norm, "variance_epsilon", None) == getattr(decoder.norm, "variance_epsilon", None)
    assert all(p.requires_grad for p in drafter.parameters())  # trainable, though the target is frozen
    reference = greedy_reference(model)
    path = tmp_path / "eagle.safetensors"
    save_checkpoint(str(path), "eagle", drafter.state_dict(), {"hidden_size": hidden, "vocab_size": VOCAB})
    engine = Engine(model, dtype="float32")
    decoder = SpeculativeDecoder(engine, EagleProposer(engine, str(path), budget=4, topk=2, width=2, depth=2),
                                 num_speculative_tokens=2)
    assert decoder.generate(PROMPTS, max_new_tokens=NEW_TOKENS).output_ids == reference
    assert drafter.cache_layers == (2 if isinstance(config, tf.LongcatFlashConfig) else 1)


# Layouts whose output head is more than the layer `get_output_embeddings()` names (BERT's prediction
# transform, dense + activation + norm, before it): drafters of hidden states refuse them.
HEAD_NOT_ON_DECODER = {"bert_decoder"}


def test_medusa_drafts_losslessly_on_every_layout(arch, tmp_path):
    """Medusa's heads read the target's last hidden state through a hook on its decoder and end in its
    output head: on every layout (a multimodal wrapper's language model too) that head on the decoder's
    output, scaled and capped as the model does (Cohere's logit scale, Gemma-2's soft cap), gives the
    model's own logits, and untrained heads, which propose the target's own next-token guesses, give
    transformers' greedy tokens. BERT's logits are not its head's output on the decoder's (a prediction
    transform sits between them; Medusa drafted from the wrong distribution, losslessly but blind):
    refused as the proposer is built."""
    from specdec.core.decoder_stack import hidden_source
    from specdec.proposers.heads import OutputHead, save_checkpoint
    from specdec.proposers.medusa import MedusaHeads, MedusaProposer

    name, model, reference = arch
    hidden = model.get_output_embeddings().in_features
    path = save_checkpoint(tmp_path / "medusa.safetensors", "medusa", MedusaHeads(hidden, 2).state_dict(),
                           {"hidden_size": hidden, "vocab_size": VOCAB, "num_heads": 2})
    engine = Engine(model, dtype="float32")
    if name in HEAD_NOT_ON_DECODER:
        with pytest.raises(ValueError, match="logits are not its output head applied to its decoder's output"):
            MedusaProposer(engine, str(path))
        return
    x = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        logits = OutputHead.of(model).logits(hidden_source(model)(input_ids=x)[0])
        torch.testing.assert_close(logits, model(x).logits)
    decoder = SpeculativeDecoder(engine, MedusaProposer(engine, str(path)), num_speculative_tokens=2)
    assert decoder.generate(PROMPTS, max_new_tokens=NEW_TOKENS).output_ids == reference, name


def test_head_training_reads_the_features_drafters_read(arch):
    """Head training's teacher pass (`teacher_targets`, right-padded batches) keeps at every position
    the hidden state the engine stores for Medusa and EAGLE while decoding: the decoder's output,
    whatever the decoder is called (GPT-NeoX's `gpt_neox`, Falcon's `transformer`, a multimodal
    wrapper's language model; it read `model.model` and failed on the others, after the target had
    written the training text), under the engine's attention (DeepSeek-V2's latent attention with two
    key heads, which transformers' own SDPA call rejects)."""
    from specdec.train.training import Example, teacher_targets

    name, model, _ = arch
    if name in HEAD_NOT_ON_DECODER:  # nothing to train heads on: refused before the pass
        with pytest.raises(ValueError, match="logits are not its output head applied"):
            teacher_targets(model, [Example(torch.tensor(PROMPTS[0]), 1)], progress=False)
        return
    examples = [Example(torch.tensor(p), 1) for p in PROMPTS]
    teacher_targets(model, examples, max_tokens=64, progress=False)  # one padded batch of three rows
    engine = Engine(model, dtype="float32")
    engine.target.keep_hidden_states()
    for prompt, example in zip(PROMPTS, examples):
        engine.target.reset(1, 32)
        engine.target.forward(torch.tensor([prompt]))
        stored = engine.target.cache.hidden[0, : len(prompt) - 1]  # the features predicting tokens 1..n-1
        assert example.hidden.shape == stored.shape
        assert torch.allclose(example.hidden, stored, atol=1e-4), name


# Layouts whose decoder keeps no list of layers under a known name (BERT's `encoder.layer`)
NO_STACK = {"bert_decoder"}


def test_layer_skip_and_a_cut_draft_decode_losslessly_on_every_stack(arch):
    """The layer-skip view (the target's first layer, its final norm and head, sharing its weights)
    and train_draft's starting draft (a one-layer model of the target's class, `make_draft`) find the
    layers under each family's names (GPT-NeoX's `gpt_neox.layers`, Falcon's `transformer.h`, a
    multimodal wrapper's language model; both needed Llama's `model.layers` and refused the others)
    and draft with transformers' greedy tokens; the draft starts with the view's logits, and the target
    keeps all its layers. A decoder without
    such a list (BERT's) is refused as the view is built."""
    from specdec.proposers.layer_skip import LayerSkipProposer, early_exit_view
    from specdec.train.training import make_draft

    name, model, reference = arch
    if name in NO_STACK:
        with pytest.raises(ValueError, match="keeps a list of layers and a final norm"):
            early_exit_view(model, 1)
        return
    view = early_exit_view(model, 1)
    assert view.config.get_text_config(decoder=True).num_hidden_layers == 1
    assert model.config.get_text_config(decoder=True).num_hidden_layers == 3
    assert {id(p) for p in view.parameters()} < {id(p) for p in model.parameters()}
    engine = Engine(model, dtype="float32")
    skip = SpeculativeDecoder(engine, LayerSkipProposer(engine, exit_layer=1), num_speculative_tokens=3)
    assert skip.generate(PROMPTS, max_new_tokens=NEW_TOKENS).output_ids == reference, name
    draft = make_draft(model, 1).eval().requires_grad_(False)
    assert type(draft) is type(model) and draft.config.get_text_config(decoder=True).num_hidden_layers == 1
    engine = Engine(model, draft, dtype="float32")
    cut = SpeculativeDecoder(engine, DraftModelProposer(engine), num_speculative_tokens=3)
    assert cut.generate(PROMPTS, max_new_tokens=NEW_TOKENS).output_ids == reference, name
    with torch.inference_mode():  # the draft starts as the view: the target's first layer, norm and head
        x = torch.tensor([PROMPTS[0]])
        torch.testing.assert_close(draft(x).logits, view(x).logits)


def test_eagle_and_shallower_views_refuse_layers_that_take_per_layer_inputs():
    """Gemma-3n (and Gemma-4's E2B and E4B) feed each decoder layer per-layer inputs beside the hidden
    states, from a table sized by the layer count, and their last layers read an earlier layer's keys
    and values: a one-layer drafter has neither, and a shallower model is not the first layers (the
    layer-skip view failed at its first pass, the cut draft as its weights loaded), so all three are
    refused as they are built."""
    from specdec.proposers.eagle import EagleDrafter
    from specdec.proposers.layer_skip import early_exit_view
    from specdec.train.training import make_draft

    config = tf.Gemma3nTextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=64, hidden_size_per_layer_input=8,
        intermediate_size=128, num_hidden_layers=4, num_kv_shared_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, laurel_rank=4,
        layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.0] * 4)
    model = tf.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="'gemma3n_text' .* per-layer inputs"):
        EagleDrafter(model)
    for cut in (early_exit_view, make_draft):
        with pytest.raises(ValueError, match="'gemma3n_text' .* per-layer inputs .* not its first layers"):
            cut(model, 2)


def _electra():
    return tf.ElectraForCausalLM(tf.ElectraConfig(vocab_size=VOCAB, hidden_size=64, embedding_size=128,
                                                  num_hidden_layers=2, num_attention_heads=4,
                                                  intermediate_size=128, is_decoder=True)).eval()


def _modernbert_decoder():
    return tf.ModernBertDecoderForCausalLM(tf.ModernBertDecoderConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)).eval()


@pytest.mark.parametrize("method", ["medusa", "eagle"])
@pytest.mark.parametrize("make, message", [
    (_electra, "output head reads 128-wide inputs, not its decoder's 64-wide"),
    (_modernbert_decoder, "exposes no decoder .* whose output is the output head's input"),
], ids=["electra", "modernbert_decoder"])
def test_drafters_of_hidden_states_refuse_a_decoder_the_head_does_not_read(method, make, message, tmp_path):
    """ELECTRA's generator projects its 64-wide hidden states to 128 before its output head, and
    ModernBERT-decoder's `get_decoder()` is the output projection itself (a prediction head sits
    before it): drafters that read the decoder's output are refused for the model, before their
    checkpoint is read (which was blamed for ELECTRA's widths; ModernBERT's Medusa crashed)."""
    from specdec.proposers.eagle import EagleProposer
    from specdec.proposers.medusa import MedusaProposer

    engine = Engine(make(), dtype="float32")
    proposer = MedusaProposer if method == "medusa" else EagleProposer
    with pytest.raises(ValueError, match=message):
        proposer(engine, str(tmp_path / "never-read.safetensors"))
    assert engine.target._hidden_source is None  # nothing was switched on


@torch.inference_mode()
def test_ragged_step_logits_equal_each_row_alone(arch):
    """One ragged step (rows at lengths 13, 2, 7) gives each row the logits of transformers' own
    forward pass over that row's tokens: the per-row, per-layer-type masks are exact."""
    name, model, _ = arch
    width = max(map(len, PROMPTS))
    buffer = torch.tensor([p + [0] * (width - len(p)) for p in PROMPTS])
    step = torch.tensor([[30, 31], [32, 33], [34, 35]])
    cached = CachedModel(model)
    cached.reset(len(PROMPTS), 64)
    cached.catch_up(buffer, [len(p) for p in PROMPTS])
    ragged = cached.forward(step)
    for row, prompt in enumerate(PROMPTS):
        alone = model(torch.tensor([prompt + step[row].tolist()])).logits[0, -2:]
        torch.testing.assert_close(ragged[row], alone, atol=1e-4, rtol=0, msg=f"{name} row {row}")


def _bloom():
    config = tf.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)
    return tf.AutoModelForCausalLM.from_config(config)


def _falcon_alibi():
    config = tf.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             alibi=True)
    return tf.AutoModelForCausalLM.from_config(config)


def _gemma2_under_sdpa():
    model = build("gemma2")
    model.config._attn_implementation = "sdpa"  # what older transformers pick by default; drops the cap
    return model


def _llama_flash():
    model = build("llama")
    model.config._attn_implementation = "flash_attention_2"
    return model


def _linear_attention_layers():
    model = build("qwen2_sliding")
    model.config.layer_types = ["full_attention", "linear_attention", "full_attention"]
    return model


def _bert_encoder():
    """BERT loaded as a causal LM without is_decoder=True: its layers attend both ways, skip the cache."""
    config = tf.BertConfig(**_COMMON)
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _xlm():
    config = tf.XLMConfig(vocab_size=VOCAB, emb_dim=64, n_layers=2, n_heads=4, causal=True)
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def _moshi_short_window():
    config = tf.MoshiConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, ffn_dim=128, max_position_embeddings=256, sliding_window=WINDOW)
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


@pytest.mark.parametrize("make, model_type, reason", [
    (_bloom, "bloom", "ALiBi"),
    (_falcon_alibi, "falcon", "ALiBi"),
    (_gemma2_under_sdpa, "gemma2", "attn_implementation='eager'"),
    (_llama_flash, "llama", "attn_implementation='sdpa' or 'eager'"),
    (_linear_attention_layers, "qwen2", "linear_attention"),
    (_bert_encoder, "bert", "is_decoder=True"),
    (_xlm, "xlm", "2-D padding mask"),
    (_moshi_short_window, "moshi", "through the cache but not the masks"),
], ids=["bloom", "falcon_alibi", "gemma2_sdpa", "flash", "linear_layers", "bert_encoder", "xlm", "moshi_window"])
def test_unsupported_layout_refused_when_the_engine_is_built(make, model_type, reason):
    model = make()
    with pytest.raises(UnsupportedModelError, match=rf"model type '{model_type}'.*") as err:
        Engine(model, dtype="float32")
    assert reason in str(err.value)


def test_model_without_one_decoder_stack_refused():
    """The Byte Latent Transformer (local encoder, global and local decoders) has no num_hidden_layers
    for the cache to follow: refused from its skeleton, as the loader checks it, not an AttributeError."""
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(tf.BltConfig(), attn_implementation="eager")
    with pytest.raises(UnsupportedModelError, match="model type 'blt'.*num_hidden_layers"):
        AttentionLayout.of(model)


def test_loader_picks_eager_attention_for_soft_capped_models(tmp_path):
    """A Gemma-2 checkpoint on disk loads with eager attention (SDPA cannot soft-cap) and decodes
    like the in-memory model it was saved from."""
    model = build("gemma2")
    model.save_pretrained(tmp_path)
    tiny_random_tokenizer(VOCAB).save_pretrained(tmp_path)
    loaded, _ = load_model(ModelSpec(path=str(tmp_path)))
    assert loaded.config._attn_implementation == "eager"
    engine = Engine(loaded, dtype="float32")
    ids = torch.tensor([PROMPTS[0]])
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=6, pad_token_id=0)[0, len(PROMPTS[0]):].tolist()
    assert SpeculativeDecoder(engine).generate([PROMPTS[0]], max_new_tokens=6).output_ids[0] == expected


def test_loader_refuses_unsupported_checkpoint_before_reading_weights(tmp_path, monkeypatch):
    _bloom().save_pretrained(tmp_path)
    tiny_random_tokenizer(VOCAB).save_pretrained(tmp_path)

    def read_weights(*args, **kwargs):  # a refusal must not get this far
        raise AssertionError("the weights were read")

    monkeypatch.setattr(tf.AutoModelForCausalLM, "from_pretrained", read_weights)
    with pytest.raises(UnsupportedModelError, match="'bloom'"):
        load_model(ModelSpec(path=str(tmp_path)))

