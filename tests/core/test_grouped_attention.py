"""grouped_sdpa computes transformers' SDPA attention without repeating the key heads, and the engine's
eager passes run through it."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specdec.core.attention import GROUPED_SDPA, AttentionLayout, grouped_attention, grouped_sdpa
from specdec.core.engine import CachedModel
from tests.conftest import RAGGED_PROMPTS


class _Module(torch.nn.Module):
    """What the attention functions read from an attention layer."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _qkv(t: int, s: int, heads: int = 6, kv_heads: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, heads, t, 8, generator=g), torch.randn(2, kv_heads, s, 8, generator=g),
            torch.randn(2, kv_heads, s, 8, generator=g))


def _ragged_mask(t: int, s: int, additive: bool):
    """`[2, 1, t, s]`: row 0's queries sit at the last t keys, row 1's three keys earlier."""
    ends = torch.tensor([[s - t], [s - t - 3]]) + torch.arange(t)  # [2, t]: the last key each query sees
    allowed = (torch.arange(s)[None, None, :] <= ends[:, :, None])[:, None]
    if not additive:
        return allowed
    return torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("additive", [True, False])
def test_grouped_sdpa_equals_sdpa_with_a_mask(t, additive):
    q, k, v = _qkv(t, 20)
    mask = _ragged_mask(t, 20, additive)
    module = _Module(groups=3)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    got, _ = grouped_sdpa(module, q, k, v, mask, scaling=0.3)
    assert got.shape == want.shape == (2, t, 6, 8)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("t,s", [(1, 20), (7, 7)])
def test_grouped_sdpa_without_a_mask_matches_sdpa(t, s):
    """One query needs no mask; a causal block without one (a prefill) is left to SDPA's is_causal."""
    q, k, v = _qkv(t, s)
    module = _Module(groups=3)
    want, _ = sdpa_attention_forward(module, q, k, v, None)
    got, _ = grouped_sdpa(module, q, k, v, None)
    torch.testing.assert_close(got, want)
    if t > 1:  # and it is causal: the first query sees only the first key
        torch.testing.assert_close(got[:, 0], v[:, :, 0].repeat_interleave(3, dim=1))


@pytest.mark.parametrize("t,masked", [(1, True), (5, True), (5, False)])
def test_grouped_sdpa_reads_the_grouping_from_the_keys(t, masked):
    """Latent attention (DeepSeek-V2 with `num_key_value_heads` < heads) expands its keys to every query
    head, while its module still says 3 groups: the keys' own head count decides."""
    q, k, v = _qkv(t, 20 if masked else t, heads=6, kv_heads=6)
    mask = _ragged_mask(t, 20, additive=True) if masked else None
    got, _ = grouped_sdpa(_Module(groups=3), q, k, v, mask, scaling=0.3)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked,
                                                            scale=0.3)
    torch.testing.assert_close(got, want.transpose(1, 2))


def _passes_and_logits(model, feeds):
    """Run `feeds` (tokens [B, T], advance) through a fresh CachedModel; the attention implementation
    seen by the first layer in each pass, and each pass's logits."""
    seen = []
    handle = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args: seen.append(model.config._attn_implementation))
    try:
        cached = CachedModel(model)
        cached.reset(feeds[0][0].shape[0], 32)
        logits = [cached.forward(tokens, advance=advance) for tokens, advance in feeds]
    finally:
        handle.remove()
    assert model.config._attn_implementation == "sdpa"  # swapped back after every pass
    return seen, logits


def test_the_engines_uniform_passes_run_grouped_attention(target):
    """A prefill (no mask: left to SDPA's is_causal), a one-token step (no mask: grouped) and a
    three-token block (the mask transformers builds for SDPA: grouped) of rows at equal lengths all
    run with the grouped implementation, and equal a full forward."""
    rows = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    step = torch.tensor([[40], [41]])
    block = torch.tensor([[42, 43, 44], [45, 46, 47]])
    seen, (prefill, next_logits, block_logits) = _passes_and_logits(target, [(rows, None), (step, None),
                                                                             (block, None)])
    assert seen == [GROUPED_SDPA] * 3
    full = target(torch.cat([rows, step, block], 1)).logits
    torch.testing.assert_close(prefill, full[:, :6], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(next_logits[:, 0], full[:, 6], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(block_logits, full[:, 7:], atol=1e-4, rtol=1e-4)


def test_the_engines_ragged_passes_run_grouped_attention(target):
    """Rows at different lengths (explicit masks) and then one token each: grouped, and equal to a
    full forward of each row."""
    longest = max(map(len, RAGGED_PROMPTS))
    tokens = torch.tensor([p + [0] * (longest - len(p)) for p in RAGGED_PROMPTS])
    step = torch.tensor([[40], [41], [42]])
    seen, (prefill, next_logits) = _passes_and_logits(target, [(tokens, [len(p) for p in RAGGED_PROMPTS]),
                                                               (step, None)])
    assert seen == [GROUPED_SDPA, GROUPED_SDPA]
    for b, p in enumerate(RAGGED_PROMPTS):
        full = target(torch.tensor([p + [40 + b]])).logits[0]
        torch.testing.assert_close(prefill[b, : len(p)], full[: len(p)], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(next_logits[b, 0], full[len(p)], atol=1e-4, rtol=1e-4)


def test_models_loaded_without_sdpa_keep_their_implementation(target):
    target.config._attn_implementation = "eager"
    try:
        with grouped_attention(target):
            assert target.config._attn_implementation == "eager"
    finally:
        target.config._attn_implementation = "sdpa"


def test_a_generation_holds_the_swap_and_gives_it_back(target):
    """Setting a transformers config attribute costs microseconds, so a generation swaps once for all
    its passes; the config is SDPA again afterwards, also when the generation fails midway, and a
    layout read inside a generation takes the held swap for SDPA."""
    from specdec.core.decoding import SpeculativeDecoder
    from specdec.core.engine import Engine

    engine = Engine(target, dtype="float32")
    seen = []

    def look(row, ids):
        seen.append((target.config._attn_implementation, AttentionLayout.of(target).layer_types))
        if len(seen) == 3:
            raise KeyboardInterrupt  # a failure inside the generation

    with pytest.raises(KeyboardInterrupt):
        SpeculativeDecoder(engine).generate(RAGGED_PROMPTS[:1], max_new_tokens=8, on_tokens=look)
    assert [s[0] for s in seen] == [GROUPED_SDPA] * 3
    assert target.config._attn_implementation == "sdpa"
    out = SpeculativeDecoder(engine).generate(RAGGED_PROMPTS[:1], max_new_tokens=4)  # the engine is free again
    assert len(out.output_ids[0]) == 4 and target.config._attn_implementation == "sdpa"


def test_a_generation_holds_the_swap_of_a_proposers_own_model(target):
    """Layer skipping drafts with a view of the target's first layers, whose config is its own: the
    generation holds its swap too, and gives it back."""
    from specdec.core.decoding import SpeculativeDecoder
    from specdec.core.engine import Engine
    from specdec.proposers.layer_skip import LayerSkipProposer

    engine = Engine(target, dtype="float32")
    proposer = LayerSkipProposer(engine, exit_layer=1)
    view = proposer.draft.model
    seen = []
    SpeculativeDecoder(engine, proposer, num_speculative_tokens=2).generate(
        RAGGED_PROMPTS[:1], max_new_tokens=6, on_tokens=lambda row, ids: seen.append(view.config._attn_implementation))
    assert seen and set(seen) == {GROUPED_SDPA}
    assert view.config._attn_implementation == "sdpa"


def test_engines_sharing_a_model_keep_the_swap_until_the_last_leaves(target):
    """Two engines on one model, as two threads would run them: the first generation to end must not
    swap the config back under the other, still running; the last one to leave does."""
    from specdec.core.engine import Engine

    first, second = Engine(target, dtype="float32").exclusive(), Engine(target, dtype="float32").exclusive()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert target.config._attn_implementation == GROUPED_SDPA
    with grouped_attention(target):  # a pass of the engine still running
        assert target.config._attn_implementation == GROUPED_SDPA
    assert target.config._attn_implementation == GROUPED_SDPA
    second.__exit__(None, None, None)
    assert target.config._attn_implementation == "sdpa"
