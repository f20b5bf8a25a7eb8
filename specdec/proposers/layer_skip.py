"""Self-speculation by layer skipping (the draft half of LayerSkip, Elhoushi et al. 2024; Draft &
Verify, Zhang et al. 2024): the draft is the target's own first `exit_layer` decoder layers followed
by the target's final norm and lm_head.

No weights are copied and no second model is loaded: `early_exit_view` (specdec/core/decoder_stack.py)
builds a shallow module tree whose decoder list holds the target's first layers (Llama's
`model.layers`, GPT-2's and Falcon's `transformer.h`, GPT-NeoX's, a multimodal wrapper's language
model), so every parameter is the target's own tensor (after `Engine` has moved the target, so the
view shares the device and dtype). The view has its own KV cache (`CachedModel`), of `exit_layer`
layers; the drafting loop is `DraftModelProposer`'s, and under compile=on the view's passes compile
like a draft model's (a graph of its own: it has fewer layers than the target; the greedy chain
included).

Not done here: LayerSkip's reuse of the draft's KV entries and exit hidden state when verifying (the
target recomputes the first layers), and models trained for early exit. A target not trained for it
gives a weak draft from its early layers; how weak is measured in experiments/strategies.
"""

from __future__ import annotations

from specdec.core.decoder_stack import early_exit_view
from specdec.core.engine import CachedModel, Engine
from specdec.proposers.draft_model import DraftModelProposer

__all__ = ["LayerSkipProposer", "early_exit_view"]


class LayerSkipProposer(DraftModelProposer):
    """Drafts with the target's first `exit_layer` layers (+ final norm + head); needs no draft model."""

    name = "layer_skip"

    def __init__(self, engine: Engine, exit_layer: int = 4):
        self.engine, self.exit_layer = engine, exit_layer
        self.draft = CachedModel(early_exit_view(engine.target.model, exit_layer), f"draft(layers 0..{exit_layer - 1})")
        engine.add_model(self.draft)
        # Where the engine compiles, the draft's passes compile too, as the target's do (None: eager).
        self.draft.compiled = engine.compiled(self.draft.name, self.draft, "model")
