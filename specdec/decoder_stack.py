"""Where a Hugging Face causal LM keeps its decoder stack, and a shallower view of it.

Strategies that reuse part of the target need its decoder's list of layers and its final norm: the
layer-skip draft (the first layers, then the norm and the head), a distilled draft started from those
layers (`training.make_draft`), the EAGLE-style drafter (a copy of the last layer and the norm). The
names differ by family (Llama's `model.layers` and `model.norm`, GPT-2's and Falcon's `transformer.h`
and `ln_f`, GPT-NeoX's `gpt_neox.layers` and `final_layer_norm`, Phi's `final_layernorm`, a
multimodal wrapper's `model.language_model`); the decoder is the one `get_decoder()` names, found in
the model's module tree by identity, so the view replaces it wherever it sits.
"""

from __future__ import annotations

import copy

import torch

from specdec.errors import InvalidInput

# Llama's names, then GPT-J's and Falcon's (`h`, `ln_f`), Phi's and Persimmon's (`final_layernorm`),
# GPT-NeoX's (`final_layer_norm`), XGLM's and BioGPT's (`layer_norm`), CTRL's (`layernorm`).
LAYER_LISTS = ("layers", "h")
FINAL_NORMS = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "layer_norm", "layernorm")


def decoder_stack(decoder: torch.nn.Module) -> tuple[str, torch.nn.ModuleList, torch.nn.Module] | None:
    """(name of the layer list, the layers, the final norm) of a decoder, or None when it has no such pair."""
    named = next(((n, m) for n in LAYER_LISTS if isinstance(m := getattr(decoder, n, None), torch.nn.ModuleList)), None)
    norm = next((m for n in FINAL_NORMS if isinstance(m := getattr(decoder, n, None), torch.nn.Module)), None)
    return None if named is None or norm is None else (*named, norm)


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
    text = model.config.get_text_config(decoder=True)  # a multimodal wrapper's language model
    if getattr(text, "hidden_size_per_layer_input", None) or getattr(text, "num_kv_shared_layers", None):
        raise InvalidInput(
            f"{user}: model type {text.model_type!r} ({type(model).__name__}) feeds its decoder layers per-layer "
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
    configs = {id(model.config): config, id(model.config.get_text_config(decoder=True)): text}

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
