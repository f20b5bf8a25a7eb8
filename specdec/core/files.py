"""Writing a file whole: a checkpoint or a results file is either the old one or the new one,
never a half-written one (an interrupted run, a full disk); and with the modes the umask allows.

safetensors writes its files 0600 whatever the umask says, so a checkpoint or a saved model written
through it would be unreadable to the rest of a team that shares the folder, while every other file
the project writes (and the converted-model cache) is 0644 under umask 022. `umask_modes` gives such
files the modes a plain `open()` would have given them."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["umask_modes", "write_whole"]


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` into a temporary file beside `path`, then `os.replace` it onto `path`: an interrupted
    or failed write leaves `path` as it was (and no temporary file), never cut short. The file gets the
    modes the umask allows (`umask_modes`)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        umask_modes(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def umask_modes(path: Path) -> None:
    """Give `path` (a file, or a folder and everything in it) the modes the umask allows: 0644 for
    files and 0755 for folders under umask 022."""
    umask = os.umask(0)
    os.umask(umask)
    path = Path(path)
    if not path.is_dir():
        os.chmod(path, 0o666 & ~umask)
        return
    for root, dirs, files in os.walk(path):
        os.chmod(root, 0o777 & ~umask)
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777 & ~umask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o666 & ~umask)
