"""specdec: a speculative-decoding research framework for Hugging Face causal LMs."""

import os as _os

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    _os.environ.setdefault(_var, "1")
