"""specdec: a speculative-decoding research framework for Hugging Face causal LMs.

The hub is never contacted: offline mode is set before `transformers` or `datasets` is imported.
"""

import os as _os

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    _os.environ.setdefault(_var, "1")

# The adaptive wing registers its named schedule (`cost_aware`) with the core's `SCHEDULES`.
import specdec.adaptive.schedules  # noqa: E402, F401, I001
from specdec.core.decoding import Generation, SpeculativeDecoder, TextStreamer  # noqa: E402
from specdec.core.engine import CachedModel, Engine  # noqa: E402
from specdec.core.sampling import SamplingParams  # noqa: E402
from specdec.models import ModelSpec, load_model, tiny_random_model  # noqa: E402
from specdec.proposers.draft_model import DraftModelProposer  # noqa: E402

__all__ = [
    "CachedModel", "DraftModelProposer", "Engine", "Generation", "ModelSpec", "SamplingParams",
    "SpeculativeDecoder", "TextStreamer", "load_model", "tiny_random_model",
]
