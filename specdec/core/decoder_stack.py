"""Where a Hugging Face causal LM keeps its decoder stack, what lies between it and the logits, and a
shallower view of it.

Strategies that reuse part of the target need its decoder's list of layers and its final norm: the
layer-skip draft (the first layers, then the norm and the head), a distilled draft started from those
layers (`training.make_draft`), the EAGLE-style drafter (a copy of the last layer and the norm). The
names differ by family (Llama's `model.layers` and `model.norm`, GPT-2's and Falcon's `transformer.h`
and `ln_f`, GPT-NeoX's `gpt_neox.layers` and `final_layer_norm`, Phi's `final_layernorm`, a
multimodal wrapper's `model.language_model`); the decoder is the one `get_decoder()` names, found in
the model's module tree by identity, so the view replaces it wherever it sits.

Drafters of hidden states (Medusa, EAGLE) and their training read the decoder's output and end in
the target's output head (`hidden_source`); the logits are that head's output times a scale
(Cohere's `logit_scale`, Granite's `logits_scaling`) and soft-capped (Gemma-2's
`final_logit_softcapping`), `final_logits`. That the model's logits are exactly this is checked on
a few tokens, since some heads are more than one layer (BERT's prediction transform, ELECTRA's
projection) and nothing in the config says so.
"""

from __future__ import annotations

import copy
import weakref

import torch

from specdec.core.attention import grouped_attention
from specdec.core.errors import InvalidInput

# Llama's names, then GPT-J's and Falcon's (`h`, `ln_f`), Phi's and Persimmon's (`final_layernorm`),
# GPT-NeoX's (`final_layer_norm`), XGLM's and BioGPT's (`layer_norm`), CTRL's (`layernorm`).
LAYER_LISTS = ("layers", "h")
FINAL_NORMS = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "layer_norm", "layernorm")
# Models whose logits `hidden_source` found to be their head's output on the decoder's: a property of
# the model's structure, checked once per model object (every proposer, engine and teacher pass asks).
_HEAD_CHECKED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def decoder_stack(decoder: torch.nn.Module) -> tuple[str, torch.nn.ModuleList, torch.nn.Module] | None:
    """(name of the layer list, the layers, the final norm) of a decoder, or None when it has no such pair."""
    named = next(((n, m) for n in LAYER_LISTS if isinstance(m := getattr(decoder, n, None), torch.nn.ModuleList)), None)
    norm = next((m for n in FINAL_NORMS if isinstance(m := getattr(decoder, n, None), torch.nn.Module)), None)
    return None if named is None or norm is None else (*named, norm)


def logit_transform(model: torch.nn.Module) -> tuple[float, float | None]:
    """(scale, cap) of what `model`'s forward does to its output head's output: logits x scale
    (Cohere's `logit_scale`; 1 / Granite's `logits_scaling`), then cap x tanh(logits / cap) (Gemma-2's
    `final_logit_softcapping`; None: no cap)."""
    config = model.config.get_text_config(decoder=True)
    scale = getattr(config, "logit_scale", None) or 1.0
    if getattr(config, "logits_scaling", None):
        scale = scale / config.logits_scaling
    return float(scale), getattr(config, "final_logit_softcapping", None)


def final_logits(logits: torch.Tensor, scale: float = 1.0, cap: float | None = None) -> torch.Tensor:
    """The model's logits from its output head's output `logits: [..., V]` (`logit_transform`)."""
    if scale != 1.0:
        logits = logits * scale
    return logits if cap is None else torch.tanh(logits / cap) * cap


def hidden_source(model: torch.nn.Module, name: str | None = None) -> torch.nn.Module:
    """The decoder of causal LM `model` whose output is its output head's input: what drafters of
    hidden states read while decoding and what their training reads (`training.teacher_targets`), so
    both see the same features. ValueError for a model without one: no `get_decoder()` (or one that
    names the output projection, ModernBERT-decoder's), a head that reads another width (ELECTRA's
    generator projects its hidden states before the head), or logits that are not the head's output
    (`final_logits`) on the decoder's, checked on 8 tokens once per model (BERT-style decoders: a
    prediction transform, dense + activation + norm, sits between them). `name`: the model's name in
    the message."""
    name = name or type(model).__name__
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings()
    # ModernBERT-decoder's `get_decoder()` is its output projection (BERT's name for it), which a
    # prediction head (dense, activation, norm) feeds: not a stack whose output the head reads.
    if decoder is None or decoder is model or decoder is head:
        raise ValueError(f"{name}: {type(model).__name__} exposes no decoder (get_decoder()) whose "
                         "output is the output head's input; drafters that read hidden states cannot use it")
    hidden = model.config.get_text_config(decoder=True).hidden_size
    width = getattr(head, "in_features", hidden)
    if width != hidden:
        raise ValueError(f"{name}: {type(model).__name__}'s output head reads {width}-wide inputs, "
                         f"not its decoder's {hidden}-wide hidden states (a projection sits between them); "
                         "drafters that read hidden states cannot use it; use a draft model or method=ngram")
    if model not in _HEAD_CHECKED:
        error = _head_error(model, decoder, head)
        if error > 0.01:
            raise ValueError(f"{name}: {type(model).__name__}'s logits are not its output head applied to its "
                             f"decoder's output (they differ by {error:.0%} of their range: a layer sits between "
                             "them); drafters that read hidden states cannot use it; use a draft model or method=ngram")
        _HEAD_CHECKED.add(model)
    return decoder


@torch.inference_mode()
def _head_error(model: torch.nn.Module, decoder: torch.nn.Module, head: torch.nn.Module) -> float:
    """max |logits - final_logits(head(decoder output))| / max |logits| over 8 tokens (two passes of
    8 tokens, in eval mode: no dropout): ~0 where the head reads the decoder's output, up to rounding
    in low precision."""
    weight = head.weight
    ids = torch.arange(8, device=weight.device)[None] % weight.shape[0]
    training = model.training
    model.eval()
    try:
        with grouped_attention(model):
            want = model(input_ids=ids, use_cache=False).logits.float()
            got = final_logits(head(decoder(input_ids=ids, use_cache=False)[0]).float(), *logit_transform(model))
    finally:
        model.train(training)
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object holding the same parameters, buffers and children; its own registries,
    so replacing a child of the copy leaves the original untouched."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    out._parameters = dict(module._parameters)
    out._buffers = dict(module._buffers)
    return out


def early_exit_view(model: torch.nn.Module, exit_layer: int, key: str = "method.proposer.exit_layer",
                    user: str = "method=layer_skip") -> torch.nn.Module:
    """A causal LM that runs `model`'s embeddings, its first `exit_layer` decoder layers, its final
    norm and its head, sharing all of `model`'s parameters (no weight is copied). Its config is a copy
    with the (text) layer count and `layer_types` cut to `exit_layer`, so the engine gives it a cache
    of that many layers. InvalidInput for a model without a decoder stack (`decoder_stack`) or an
    `exit_layer` outside [1, layers - 1]; `key` and `user` name the setting and the caller in it."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    path = next((name for name, m in model.named_modules() if m is decoder), None) if decoder is not None else None
    stack = decoder_stack(decoder) if path else None  # path "": the model is its own decoder
    if stack is None or head is None:
        raise InvalidInput(
            f"{user} needs a causal LM whose decoder (get_decoder()) keeps a list of layers and a final norm "
            f"(Llama's model.layers and model.norm, GPT-2's transformer.h and ln_f, GPT-NeoX's, Phi's, ...) "
            f"and an output head; {type(model).__name__} has another layout")
    original = model.config.get_text_config(decoder=True)  # a multimodal wrapper's language model
    if getattr(original, "hidden_size_per_layer_input", None) or getattr(original, "num_kv_shared_layers", None):
        raise InvalidInput(
            f"{user}: model type {original.model_type!r} ({type(model).__name__}) feeds its decoder layers per-layer "
            "inputs from a table sized by the layer count, or lets its last layers read earlier layers' keys "
            "and values (Gemma-3n, Gemma-4 E2B and E4B): a shallower model is not its first layers; "
            "use a draft model or method=ngram")
    layers_name, layers, _ = stack
    n = len(layers)
    if not 1 <= exit_layer < n:
        allowed = f"must be in [1, {n - 1}] for this {n}-layer target" if n > 1 else \
            "this target's decoder has a single layer, so no shallower part of it exists"
        raise InvalidInput(f"{key}={exit_layer}: {allowed}")
    config = copy.deepcopy(model.config)
    text = config.get_text_config(decoder=True)
    text.num_hidden_layers = exit_layer  # an alias where the config calls it otherwise (GPT-2's n_layer)
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = list(text.layer_types)[:exit_layer]
    configs = {id(model.config): config, id(original): text}

    def own(module: torch.nn.Module) -> torch.nn.Module:
        out = _shallow(module)
        if id(getattr(module, "config", None)) in configs:
            out.config = configs[id(module.config)]
        return out

    view = own(model)
    parent, parts = view, path.split(".")
    for part in parts[:-1]:  # the modules between the model and its decoder, each its own copy
        child = own(getattr(parent, part))
        setattr(parent, part, child)
        parent = child
    shallow_decoder = own(decoder)
    setattr(shallow_decoder, layers_name, torch.nn.ModuleList(list(layers)[:exit_layer]))
    setattr(parent, parts[-1], shallow_decoder)
    return view
