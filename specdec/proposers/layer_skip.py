"""Self-speculation by layer skipping (the draft half of LayerSkip, Elhoushi et al. 2024; Draft &
Verify, Zhang et al. 2024): the draft is the target's own first `exit_layer` decoder layers followed
by the target's final norm and lm_head.

No weights are copied and no second model is loaded: `early_exit_view` builds a shallow module tree
whose decoder list holds the target's first layers, so every parameter is the target's own tensor
(after `Engine` has moved the target, so the view shares the device and dtype). The view has its own
KV cache (`CachedModel`), of `exit_layer` layers; the drafting loop is `DraftModelProposer`'s, and
under compile=on the view's passes compile like a draft model's (a graph of its own: it has fewer
layers than the target; the greedy chain included).

Not done here: LayerSkip's reuse of the draft's KV entries and exit hidden state when verifying (the
target recomputes the first layers), and models trained for early exit. A target not trained for it
gives a weak draft from its early layers; how weak is measured in experiments/strategies.
"""

from __future__ import annotations

import copy

import torch

from specdec.compiled import CompiledForward
from specdec.engine import CachedModel, Engine
from specdec.proposers.draft_model import DraftModelProposer


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object holding the same parameters, buffers and children; its own registries,
    so replacing a child of the copy leaves the original untouched."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    out._parameters = dict(module._parameters)
    out._buffers = dict(module._buffers)
    return out


def early_exit_view(model: torch.nn.Module, exit_layer: int) -> torch.nn.Module:
    """A causal LM that runs `model`'s embeddings, its first `exit_layer` decoder layers, its final
    norm and its head, sharing all of `model`'s parameters. Needs the Llama-like layout
    `model.model.layers` (a ModuleList), `model.model.norm` and an output head (Llama, Mistral, Qwen2,
    Gemma, SmolLM, Phi-3, ...)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or getattr(inner, "norm", None) is None \
            or model.get_output_embeddings() is None:
        raise ValueError(
            f"method=layer_skip needs a Llama-like causal LM (model.model.layers, model.model.norm, an "
            f"lm_head); {type(model).__name__} has another layout"
        )
    n = len(layers)
    if not 1 <= exit_layer < n:
        raise ValueError(f"method.proposer.exit_layer must be in [1, {n - 1}] for a {n}-layer target, got {exit_layer}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = exit_layer
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:exit_layer]
    view_inner = _shallow(inner)
    view_inner.layers = torch.nn.ModuleList(list(layers)[:exit_layer])
    view_inner.config = config
    view = _shallow(model)
    view.model = view_inner
    view.config = config
    return view


class LayerSkipProposer(DraftModelProposer):
    """Drafts with the target's first `exit_layer` layers (+ final norm + head); needs no draft model."""

    name = "layer_skip"

    def __init__(self, engine: Engine, exit_layer: int = 4):
        self.engine, self.exit_layer = engine, exit_layer
        self.draft = CachedModel(early_exit_view(engine.target.model, exit_layer), f"draft(layers 0..{exit_layer - 1})")
        engine.add_model(self.draft)
        if engine.target.compiled is not None:  # compile=on: the draft's passes compile too, as the target's do
            self.draft.compiled = CompiledForward(self.draft, **engine.target.compiled.options())
            engine.compiled_modules[self.draft.name] = self.draft.compiled
