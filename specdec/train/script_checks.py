"""What a training script checks before it loads a model: its config's values and where its outputs go.

`scripts/train_heads.py` and `scripts/train_draft.py` spend minutes loading a target and generating
training text before they train; a value they cannot work with (a count of 0, a negative learning
rate, an `out` that exists, or is the target's own folder or one of its files) is refused first, as an `InvalidInput`
naming the config key (one `Error:` line on the command line), so that nothing is lost or overwritten.
A refused run takes back the run folder Hydra made for it (`checked`), as the experiment command does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from specdec.core.engine import DTYPE_NAMES
from specdec.core.errors import InvalidInput


def check_at_least(key: str, value, minimum: float, *, integer: bool = True, optional: bool = False,
                   strict: bool = False) -> None:
    """`value` (the config's `key`) must be an int (a number when not `integer`) >= `minimum` (> when
    `strict`), or None when `optional`; else InvalidInput naming the key, before any model loads."""
    if value is None and optional:
        return
    kind = "an integer" if integer else "a number"
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool):
        raise InvalidInput(f"{key}={value!r}: must be {kind}{' or null' if optional else ''}")
    if value < minimum or (strict and value == minimum):
        raise InvalidInput(f"{key}={value!r}: must be {'>' if strict else '>='} {minimum}")


def check_choice(key: str, value, choices: Iterable) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise InvalidInput(f"{key}={value!r}: must be one of {', '.join(map(str, choices))}")


def _writable_folder(key: str, folder: Path) -> None:
    """The nearest existing folder of `folder` must be a writable directory (`folder` is made later)."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise InvalidInput(f"{key}: {probe} is a file, not a folder; choose an {key} in a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise InvalidInput(f"{key}: cannot write in {probe}; choose an {key} in a writable folder")


def check_out_file(out: Path, suffix: str, overwrite: bool, companion: str | None = None) -> None:
    """A checkpoint file the run will write (and `companion` beside it): the right suffix, not a
    folder, in a writable folder, and not there already unless `overwrite`."""
    if out.suffix != suffix:
        raise InvalidInput(f"out={out}: must end in {suffix}, e.g. out={out.with_suffix(suffix)}")
    if out.is_dir():
        raise InvalidInput(f"out={out} is a folder; give the checkpoint's file name, e.g. out={out / ('heads' + suffix)}")
    _writable_folder("out", out.parent)
    if out.exists() and not overwrite:
        raise InvalidInput(f"out={out} exists; pass overwrite=true to replace it"
                           f"{f' (and its {companion})' if companion else ''}, or choose another out")


def check_out_spares_target(out: Path, target: Path | None, companions: Iterable[str] = (),
                            ours: Callable[[Path], bool] = lambda path: False) -> None:
    """A file the run writes, `out` and `out` with each suffix in `companions` (its report), must not
    replace a file of the target's own folder `target` (its weights, config, tokenizer), even under
    overwrite=true; unless `ours(out)` says that `out` is an earlier output of the same script, whose
    companions are then its own too."""
    if target is None or not target.is_dir() or out.parent.resolve() != target.resolve():
        return
    if out.is_file() and ours(out):
        return
    for path in (out, *(out.with_suffix(suffix) for suffix in companions)):
        if path.exists():
            raise InvalidInput(f"out={out}: {path.name} is a file of the target's own folder {target}; writing "
                               "there would replace it: choose another out (a file of the run's own, as the default "
                               "outputs/heads/<kind>.safetensors)")


def check_out_dir(out: Path, overwrite: bool, keep: Path | None = None) -> None:
    """A model folder the run will write: not a file, never the folder `keep` (the target) or a folder
    that holds it, in a writable folder, and not a non-empty folder already unless `overwrite`."""
    if out.exists() and not out.is_dir():
        raise InvalidInput(f"out={out} is a file; the draft is a folder: choose another out")
    if keep is not None and keep.exists() and out.exists() and out.resolve() == keep.resolve():
        raise InvalidInput(f"out={out} is the target's own folder; saving the draft there would replace "
                           "the target: choose another out")
    if keep is not None and keep.exists() and out.exists() and out.resolve() in keep.resolve().parents:
        raise InvalidInput(f"out={out} holds the target ({keep}); saving the draft there would delete the "
                           "target with everything else in it: choose another out")
    _writable_folder("out", out.parent)
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise InvalidInput(f"out={out} exists and is not empty; pass overwrite=true to replace it, "
                           "or choose another out")


def check_cache_folder(folder: Path) -> None:
    """The continuation cache's folder must be creatable, before any continuation is generated."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InvalidInput(f"generation.cache: cannot create {folder} ({err.strerror or err}): set SPECDEC_CACHE "
                           "to a writable folder, or generation.cache=false") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidInput(f"generation.cache: cannot write in {folder}: set SPECDEC_CACHE to a writable "
                           "folder, or generation.cache=false")


def check_dtype(key: str, value) -> None:
    """A dtype name `specdec.core.engine.resolve_dtype` takes: auto, float32, bfloat16, float16, float64."""
    check_choice(key, value, ("auto", *DTYPE_NAMES))



def checked(check: Callable[[Any], None], cfg: Any) -> None:
    """Run a script's config `check` on `cfg`; if it refuses, first remove what Hydra wrote into the
    run's folder (`specdec.study.run_dirs.release_run_dir`): nothing ran, and a folder per mistyped value
    would pile up beside the real runs. Outside a Hydra run (the Python API) it only checks."""
    try:
        check(cfg)
    except InvalidInput:
        from hydra.core.hydra_config import HydraConfig

        from specdec.study.run_dirs import release_run_dir

        if HydraConfig.initialized():
            release_run_dir(HydraConfig.get().runtime.output_dir)
        raise
