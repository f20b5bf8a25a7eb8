"""Writing a file whole: a checkpoint or a results file is either the old one or the new one,
never a half-written one (an interrupted run, a full disk)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["write_whole"]


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` into a temporary file beside `path`, then `os.replace` it onto `path`: an interrupted
    or failed write leaves `path` as it was (and no temporary file), never cut short."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
