"""How specdec's ragged rows meet a transformers model: which layouts work, their masks, the call.

specdec's KV cache (`cache.py`) keeps one valid length per batch row and writes row b's new tokens at
cache index `len_b`, so a key's cache index *is* its position. No transformers mask helper can
describe that (they assume every row's queries sit at the same offset), so for a ragged batch the
engine builds the 4-D masks itself, one per kind of attention layer the model has:

- `full_attention`: query at position p sees keys 0..p;
- `sliding_attention`: query at position p sees keys p-w+1..p (w = `config.sliding_window`; the
  same rule as transformers' `sliding_window_overlay`, `kv_idx > q_idx - w`).

`AttentionLayout.of(model)` reads that layout from the config (a multimodal wrapper's: from its
text config, whose layers are the ones that meet the cache) and refuses up front, naming the model
type, what the engine cannot serve exactly: position schemes that ignore `position_ids` (ALiBi:
Bloom, MPT, Falcon with `alibi=True`; recurrent models), attention kinds other than the two above
(chunked, linear, hybrid state-space layers), non-causal models (among them BERT-style encoders
loaded as causal LMs without `is_decoder=True`, which attend both ways and skip the cache), models
that build their own masks and take no 4-D one (XLM), attention implementations that take no 4-D
mask (flash, flex), and soft-capped attention logits under an implementation that drops the cap
(only `eager` computes it).

Everything that depends on transformers' calling convention is in `AttentionLayout.call`, because
it changed within 5.x and is what breaks first on another version:

- the cache argument was renamed from `past_key_values` to `cache` in 5.x; an unknown keyword is
  swallowed by `**kwargs`, so passing the wrong name silently runs *without* the cache (under 5.17
  that showed as an SDPA broadcast error on ragged rows and as wrong tokens on uniform ones). The
  name is read from the model's `forward` signature;
- a 4-D tensor mask is returned as-is by every mask helper, so one tensor serves a model whose
  layers are all of one kind; a model that mixes kinds (Gemma-2/3, Qwen2 with sliding layers) takes
  a dict keyed by layer type instead, which its forward uses as its per-type mask mapping;
- `attention_mask=None` (rows at equal lengths, a view that ends with the block) lets the model build
  its own masks from positions and the cache's `get_mask_sizes`, exactly as in `generate()`; a view
  longer than that (exact greedy's whole buffer) takes explicit masks, since for a single query
  transformers' SDPA path skips the mask and would attend to every key of the view.

Models loaded with SDPA run every pass, eager or compiled, through `grouped_sdpa` (`grouped_attention`
swaps it in around a call): grouped-query attention over the cache's key heads as they are, where
transformers would copy them to every query head (`repeat_kv`) or take SDPA's slow grouped kernel
for one query in bfloat16 on a CPU. A model whose own code picks SDPA by the implementation's name
(Falcon's attention) keeps plain SDPA (`names_sdpa`): under the swap it would run its other branch.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import threading
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from specdec.core.errors import InvalidInput

FULL, SLIDING = "full_attention", "sliding_attention"

# Attention implementations that apply an arbitrary additive 4-D mask.
MASKED_IMPLEMENTATIONS = ("eager", "sdpa")

# Model types whose attention adds ALiBi biases instead of reading `position_ids`. Most also lack a
# `position_ids` argument (caught generically); Falcon has one but ignores it when `alibi=True`.
_ALIBI_MODEL_TYPES = ("bloom", "mpt", "jais")

# Model types that build their attention masks themselves and read `attention_mask` as a 2-D padding
# mask: a 4-D mask is misread (XLM asserts on it), so ragged rows cannot be masked.
_OWN_MASK_MODEL_TYPES = ("xlm",)

# Model types whose `sliding_window` transformers applies through its cache alone: Moshi builds plain
# causal masks, while the cache built from its config keeps only a window of keys, so a prompt's pass
# attends to the whole prompt and each later pass to the window. No per-row mask reproduces that once
# a sequence outgrows the window; a window of the whole context (the released checkpoints') never binds.
_CACHE_WINDOWED_MODEL_TYPES = ("moshi",)


class UnsupportedModelError(InvalidInput):
    """The model's attention layout cannot be run exactly by specdec's engine."""


def eager_attention_needed(config) -> bool:
    """True when the model soft-caps attention logits, which only the eager implementation computes
    (SDPA raises on it in newer transformers and silently skips the cap in older ones)."""
    return getattr(config, "attn_logit_softcapping", None) is not None


@dataclass(frozen=True)
class AttentionLayout:
    """What the engine needs to know to mask and call one model.

    model_type:     `config.model_type`, for messages.
    layer_types:    per decoder layer, `full_attention` or `sliding_attention`.
    sliding_window: w of the sliding layers (None when there are none).
    cache_kwarg:    the name under which this transformers version's `forward` takes the cache.
    keeps_logits:   whether `forward` takes `logits_to_keep` (else the logits are sliced after the head).
    """

    model_type: str
    layer_types: tuple[str, ...]
    sliding_window: int | None
    cache_kwarg: str
    keeps_logits: bool = True

    @classmethod
    def of(cls, model: torch.nn.Module) -> AttentionLayout:
        """Read the layout of `model`; raise `UnsupportedModelError` (naming the model type and why) if
        the engine cannot run it exactly."""
        model_type = getattr(model.config, "model_type", type(model).__name__)
        # A multimodal wrapper (Gemma-3, Fuyu, GOT-OCR2) keeps its language model's layout in its text
        # config, and the top-level config has no `num_hidden_layers`; a text-only config is its own.
        config = model.config.get_text_config(decoder=True)

        def refuse(why: str, fix: str = "use a model with rotary or learned positions and full or sliding-window "
                                         "attention (Llama, Qwen2/3, Mistral, Gemma-2/3, Phi-3, GPT-NeoX, ...)"):
            return UnsupportedModelError(f"specdec cannot run model type {model_type!r} ({type(model).__name__}): "
                                         f"{why}; {fix}.")

        if getattr(model.config, "is_encoder_decoder", False) or getattr(config, "is_encoder_decoder", False):
            raise refuse("it is an encoder-decoder model; specdec serves decoder-only causal LMs")
        params = inspect.signature(model.forward).parameters
        if model_type in _ALIBI_MODEL_TYPES or getattr(config, "alibi", False):
            raise refuse("its attention adds ALiBi position biases, which do not follow the per-row positions "
                         "that ragged batches need")
        if "position_ids" not in params:
            raise refuse("its forward takes no position_ids, and ragged batches need a position per token")
        cache_kwarg = next((name for name in ("cache", "past_key_values") if name in params), None)
        if cache_kwarg is None:
            raise refuse("its forward takes no `cache`/`past_key_values` key-value cache (a recurrent "
                         "or otherwise cache-less model)")
        if not getattr(config, "is_causal", True) or getattr(config, "use_bidirectional_attention", False):
            raise refuse("its attention is not causal")
        if model_type in _OWN_MASK_MODEL_TYPES:
            raise refuse("it builds its own attention masks from per-row lengths and takes `attention_mask` as a 2-D "
                         "padding mask, not the per-row 4-D masks of ragged batches")
        # BERT-style encoders (BERT, RoBERTa, ELECTRA, XLM-R, ...) become causal only with
        # `is_decoder=True`; without it their layers attend both ways and do not use the cache, so
        # every pass would see only the tokens it is fed. Their layers carry the flag as `is_decoder`.
        if not getattr(config, "is_decoder", False) and any(getattr(m, "is_decoder", None) is False
                                                            for m in model.modules()):
            raise refuse("its layers attend both ways unless the config sets is_decoder=True (an encoder loaded as a "
                         "causal LM)", "set is_decoder=True in its config (config.json, or from_pretrained(path, "
                         "is_decoder=True)) to use it as a causal LM")

        num_layers = getattr(config, "num_hidden_layers", None)
        if num_layers is None:  # Byte Latent Transformer: local encoder, global and local decoder stacks
            raise refuse("its config has no num_hidden_layers, so it has no single stack of decoder layers for the "
                         "cache to follow")
        window = getattr(config, "sliding_window", None)
        declared = getattr(config, "layer_types", None)
        if declared is not None:
            layer_types = tuple(declared[:num_layers])
        elif window is not None and getattr(config, "use_sliding_window", True):
            layer_types = (SLIDING,) * num_layers  # Mistral, Mixtral, Phi-3, Starcoder2: one window for all
        else:
            layer_types = (FULL,) * num_layers
        other = sorted(set(layer_types) - {FULL, SLIDING})
        if other:
            raise refuse(f"it has {', '.join(other)} layers; the engine masks only full and sliding-window attention")
        if getattr(config, "attention_chunk_size", None) is not None:
            raise refuse("it uses chunked attention")
        if SLIDING in layer_types and not window:
            raise refuse("it has sliding-window layers but no config.sliding_window")
        context = getattr(config, "max_position_embeddings", None)
        if model_type in _CACHE_WINDOWED_MODEL_TYPES and window and (context is None or window < context):
            raise refuse(f"transformers applies its sliding window ({window}) through the cache but not the masks, so "
                         "a pass over a prompt longer than the window sees more keys than the passes after it",
                         f"use a config whose sliding_window is at least max_position_embeddings ({context})")

        implementation = getattr(config, "_attn_implementation", None) or "eager"
        if implementation == GROUPED_SDPA:  # read inside a generation, which holds the swap (`grouped_attention`)
            implementation = "sdpa"
        if implementation not in MASKED_IMPLEMENTATIONS:
            raise refuse(f"attn_implementation={implementation!r} does not take the per-row 4-D masks of "
                         "ragged batches", "load it with attn_implementation='sdpa' or 'eager'")
        if eager_attention_needed(config) and implementation != "eager":
            raise refuse(f"it soft-caps attention logits (attn_logit_softcapping={config.attn_logit_softcapping}), "
                         f"which attn_implementation={implementation!r} does not compute",
                         "load it with attn_implementation='eager' (specdec's loader does)")
        return cls(model_type, layer_types, window if SLIDING in layer_types else None, cache_kwarg,
                   keeps_logits="logits_to_keep" in params)

    def masks(self, positions: torch.Tensor, kv_len: int, dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive masks `[B, 1, T, kv_len]` for queries at `positions: [B, T]` over cache indices 0..kv_len-1.

        One tensor when all layers are of one kind, else a dict keyed by layer type. Indices past a
        row's queries (other rows' longer history, scratch from rejected drafts) are always hidden.
        """
        keys = torch.arange(kv_len, device=positions.device)[None, None, :]
        query = positions[:, :, None]
        causal = keys <= query
        out = {}
        for kind in set(self.layer_types):
            allowed = causal if kind == FULL else causal & (keys > query - self.sliding_window)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
            out[kind] = mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
        return next(iter(out.values())) if len(out) == 1 else out

    def call(self, model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor, cache,
             attention_mask: torch.Tensor | dict[str, torch.Tensor] | None,
             keep: torch.Tensor | None) -> torch.Tensor:
        """One forward pass of `tokens: [B, T]` at `positions: [B, T]` through `cache`; returns logits
        `[B, T or len(keep), V]`. `attention_mask=None` lets the model build its own causal masks
        (rows at equal lengths)."""
        kwargs = {self.cache_kwarg: cache}
        if self.keeps_logits and keep is not None:
            kwargs["logits_to_keep"] = keep
        logits = model(input_ids=tokens, position_ids=positions, attention_mask=attention_mask,
                       use_cache=True, **kwargs).logits
        return logits[:, keep] if keep is not None and not self.keeps_logits else logits


GROUPED_SDPA = "specdec_grouped_sdpa"


def grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs) -> tuple[torch.Tensor, None]:
    """SDPA for grouped-query attention without copying the cache: `query: [B, H, T, D]` is viewed as
    `[B, Hkv, G*T, D]` (the G query heads that share a key head become G*T queries of it), `key, value:
    [B, Hkv, S, D]` are read as they are, the mask `attention_mask: [B, 1, T, S]` is repeated G times
    along the queries (for one query it broadcasts: no copy). Each (head, query) pair computes what
    SDPA over repeated keys computes.

    Why: transformers' SDPA path repeats the keys and values to H heads first (`repeat_kv`, a copy of
    the whole cache per layer and pass) for several queries with a mask, and under dynamo always;
    without a mask it asks SDPA for grouped-query attention, whose CPU kernel for one query in bfloat16 is
    slow. Without the copy a pass over a long cache is cheaper eagerly, and compiled a large key
    bucket costs about what a small one does (experiments/gpu/LOG.md, "Runs 11-14" and "Runs 6-10").

    Passes this form does not cover go to transformers' SDPA unchanged: no grouping, a causal pass
    without a mask (a prefill: its causality is SDPA's `is_causal`, which the regrouped queries
    would break), a per-head mask, position biases."""
    # The grouping is read from the tensors, not from `module.num_key_value_groups`: latent attention
    # (DeepSeek-V2/V3) expands its keys to every query head whatever `num_key_value_heads` says, and
    # transformers' SDPA path, trusting the attribute, would regroup heads that are not grouped.
    b, h, t, d = query.shape
    groups = h // key.shape[1]
    if groups == 1 and getattr(module, "num_key_value_groups", 1) != 1 and kwargs.get("position_bias") is None:
        causal = attention_mask is None and t > 1 and getattr(module, "is_causal", True)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               is_causal=causal, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    per_head_mask = attention_mask is not None and attention_mask.shape[1] != 1
    if groups == 1 or (attention_mask is None and t > 1) or per_head_mask or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    query = query.reshape(b, h // groups, groups * t, d)
    if attention_mask is not None and t > 1:  # one query: [B, 1, 1, S] broadcasts over the G rows as it is
        attention_mask = attention_mask.repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, h, t, -1).transpose(1, 2).contiguous(), None


_HOLDERS: dict[int, int] = {}  # id(config) -> contexts holding its swap now
_HOLDERS_LOCK = threading.Lock()


class _Swap:
    """Holds `config`'s swap to GROUPED_SDPA: the first holder swaps, the last one to leave swaps back.
    Counted, under a lock, because engines in other threads may share the model: a generation that
    ends must not swap back under another one still running (its passes would change implementation
    midway, and under dynamo compile again)."""

    def __init__(self, config):
        self.config = config

    def __enter__(self):
        with _HOLDERS_LOCK:
            key = id(self.config)
            if key not in _HOLDERS:
                self.config._attn_implementation = GROUPED_SDPA
            _HOLDERS[key] = _HOLDERS.get(key, 0) + 1

    def __exit__(self, *exc):
        with _HOLDERS_LOCK:
            key = id(self.config)
            _HOLDERS[key] -= 1
            if _HOLDERS[key] == 0:
                del _HOLDERS[key]
                self.config._attn_implementation = "sdpa"


_NAMES_SDPA: dict[type, bool] = {}  # model class -> whether a module of it branches on the name "sdpa"
_SDPA_BY_NAME = re.compile(r"""_attn_implementation\s*==\s*["']sdpa["']""")


def names_sdpa(model: torch.nn.Module) -> bool:
    """Whether one of `model`'s modules branches on `config._attn_implementation == "sdpa"` in its own
    forward instead of dispatching through transformers' attention interface (Falcon's attention, in
    transformers 5.24). Under the swap to GROUPED_SDPA such a module takes its other branch, its own
    eager attention, which adds the mask to the scores as an additive float mask, while transformers'
    mask helpers still build SDPA's boolean masks for it: `True` (attend) adds 1, `False` 0, and the
    model attends to every key, future ones included, in every pass whose mask it builds itself (a
    prefill, rows at equal lengths). Such models keep plain SDPA. Read once per model class."""
    cls = type(model)
    if cls not in _NAMES_SDPA:
        found = False
        for module_class in {type(m) for m in model.modules()}:
            try:
                source = inspect.getsource(module_class.forward)
            except (OSError, TypeError):  # built-in or generated: no source to read
                continue
            if _SDPA_BY_NAME.search(source):
                found = True
                break
        _NAMES_SDPA[cls] = found
    return _NAMES_SDPA[cls]


def grouped_attention(model: torch.nn.Module):
    """A context in which `model` (and modules built from its config, such as EAGLE's drafter layer)
    runs its SDPA layers through `grouped_sdpa`, with the masks transformers builds for SDPA. Models
    loaded with another implementation (eager: soft-capped logits) keep theirs. The implementation
    is read from the config at call time (and, under dynamo, while tracing, and guarded), so the
    swap is around a call, never inside a compiled region. Setting a config attribute costs about
    25 us in transformers 5 (validation), so `Engine.exclusive` holds the swap for a whole
    generation and the per-pass contexts inside it only count; passes outside a generation swap
    around themselves. Holders are counted (`_Swap`): the config goes back to SDPA when the last
    one leaves, whichever thread it is in."""
    config = model.config
    if getattr(config, "_attn_implementation", None) not in ("sdpa", GROUPED_SDPA):  # not SDPA: keep it
        return contextlib.nullcontext()
    if names_sdpa(model):  # its own code picks SDPA by name: the swap would change what it computes
        return contextlib.nullcontext()
    if GROUPED_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
        ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return _Swap(config)
