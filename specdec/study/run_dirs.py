"""Every run writes into a folder of its own: it never overwrites, or mixes its files with, another run's.

- The default folder names carry the start time to the microsecond (`conf/config.yaml`), so runs
  started in the same second get folders of their own.
- A folder is claimed before anything is written into it, atomically, by creating what Hydra is about
  to write there: `.hydra/` for a run, `multirun.yaml` for a sweep. A run that finds it there already
  (another run's, or one started in the very same microsecond) stops before writing a byte and says
  what to do. Hydra writes `.hydra/` before the job's function starts, so the claim is a Hydra
  callback (`RunFolders`, listed in `conf/config.yaml`), which runs before that.
- A folder given with `hydra.run.dir=` may exist (made in advance, say), but not hold another run.
- A sweep's job folders are unique when `hydra.sweep.subdir` names the job (`${hydra.job.num}`, the
  default); a sweep whose jobs would share folders is refused before its first job.
- `experiment.run`, which the Python API calls directly, refuses a folder that holds results.
- A run refused before it began (a config value, a missing prompt file) takes back what Hydra wrote
  into its folder (`release_run_dir`).
- A folder that cannot be made (a file in its way, a read-only file system, /proc) stops the command
  with one `Error:` line naming the setting, before Hydra or any model touches it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

RESULT_FILES = ("results.jsonl", "summary.json", "table.md")
HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")  # what Hydra writes into `.hydra/`
_made: set[Path] = set()  # the run folders `claim_run_dir` created (and their new parents), not made in advance
JOB_KEYS = ("hydra.job.num", "hydra.job.id")  # what makes a job's subdir its own


class FolderInUseError(RuntimeError):
    """The folder a run would write into holds (or is claimed by) another run."""


def check_no_results(folder: str | Path, key: str) -> None:
    """Refuse `folder` if it holds the results files of a run; `key` names the setting that chose it."""
    folder = Path(folder)
    found = [name for name in RESULT_FILES if (folder / name).exists()]
    if found:
        raise FolderInUseError(
            f"{key}={folder} already holds the results of another run ({', '.join(found)}); a run never "
            f"overwrites them. Pick another {key} (the default is new for every run), or delete {folder} "
            "if you no longer need it."
        )


def claim_run_dir(folder: str | Path, output_subdir: str | None = ".hydra") -> Path:
    """Make `folder` this run's, before Hydra writes into it; raise FolderInUseError if it is taken."""
    folder = Path(folder)
    check_no_results(folder, "hydra.run.dir")
    _made.update(p.resolve() for p in (folder, *folder.parents) if not p.exists())  # outputs/<date> too
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / (output_subdir or ".hydra")
    try:
        marker.mkdir()  # atomic: of two runs started on one folder, exactly one gets here
    except FileExistsError:
        raise FolderInUseError(
            f"hydra.run.dir={folder} already holds another run (its {marker.name}/); a run never writes "
            f"into another's folder. Pick another hydra.run.dir (the default is new for every run), or "
            f"delete {folder} if you no longer need it."
        ) from None
    return folder


def release_run_dir(folder: str | Path) -> None:
    """Remove what Hydra wrote into the folder of a job refused before it began: its `.hydra/` files and
    its empty job log, then the folder if the run made it (`claim_run_dir`, or Hydra for a sweep's job)
    and that leaves it empty; a folder made in advance is kept. The refusal was printed and nothing ran,
    so nothing is lost; kept, the folder would be listed as a failed run by `specdec.study.compare`, one more
    for every mistyped value. A folder holding anything else Hydra would not write (a non-empty log,
    more files in `.hydra/`) is left as it is, and so is any folder other than the Hydra job's own."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    folder = Path(folder)
    hc = HydraConfig.instance().cfg
    output_dir = OmegaConf.select(hc, "hydra.runtime.output_dir", default=None) if hc is not None else None
    if output_dir is None or Path(output_dir).resolve() != folder.resolve():
        return
    subdir = folder / (hc.hydra.output_subdir or ".hydra")
    ours = [subdir / name for name in HYDRA_FILES] if hc.hydra.output_subdir else []
    log = folder / f"{hc.hydra.job.name}.log"
    if log.is_file():
        if log.stat().st_size:
            return
        ours.append(log)
    if subdir.is_dir() and {p.name for p in subdir.iterdir()} - set(HYDRA_FILES):
        return
    for path in ours:
        path.unlink(missing_ok=True)
    made = folder.resolve() in _made or hc.hydra.mode == RunMode.MULTIRUN
    # then the folders above it that the run made (a new outputs/<date>/), as far as they are empty
    above = [p for p in folder.resolve().parents if p in _made] if made else []
    for path in (subdir, folder, *above) if made else (subdir,):
        try:
            path.rmdir()
        except FileNotFoundError:  # no `.hydra/` (hydra.output_subdir=null)
            continue
        except OSError:  # not empty: files of the user's own, another run's folder
            break


def claim_sweep_dir(folder: str | Path) -> Path:
    """Make `folder` this sweep's, before Hydra writes multirun.yaml; raise FolderInUseError if it holds
    a run or a sweep (its files, or job folders with theirs)."""
    folder = Path(folder)
    taken = [f"{p.relative_to(folder)}" for name in (*RESULT_FILES, ".hydra", "multirun.yaml")
             for p in (*folder.glob(name), *folder.glob(f"*/{name}"))]
    folder.mkdir(parents=True, exist_ok=True)
    if not taken:
        try:  # atomic: of two sweeps started on one folder, exactly one creates it
            os.close(os.open(folder / "multirun.yaml", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        except FileExistsError:
            taken = ["multirun.yaml"]
    if taken:
        raise FolderInUseError(
            f"hydra.sweep.dir={folder} already holds another run or sweep ({', '.join(sorted(taken)[:4])}"
            f"{', ...' if len(taken) > 4 else ''}); a sweep never writes into another's folder. Pick another "
            f"hydra.sweep.dir (the default is new for every sweep), or delete {folder} if you no longer need it."
        )
    return folder


def check_sweep_subdir(hydra_cfg: DictConfig) -> None:
    """A sweep's job folders must differ from job to job: `hydra.sweep.subdir` has to name the job."""
    raw = OmegaConf.to_container(hydra_cfg.sweep, resolve=False).get("subdir")
    if raw is None or not any(key in str(raw) for key in JOB_KEYS):
        raise FolderInUseError(
            f"hydra.sweep.subdir={raw} would give several jobs of the sweep one folder, where each would "
            "overwrite the others' results; include ${hydra.job.num} in it (the default is ${hydra.job.num})."
        )


def cannot_create(key: str, folder: Any, err: OSError) -> str:
    """The one-line refusal of a `key` folder that the OS would not make, with the OS's reason."""
    why = "a file of that name is in the way" if isinstance(err, FileExistsError) else err.strerror
    return f"Error: {key}={folder}: cannot create it ({why}); pick a writable folder"


class RunFolders(Callback):
    """Claims the run's or the sweep's folder before Hydra writes into it (see the module docstring).

    Hydra turns an exception raised in a callback into a warning and goes on to write into the folder;
    SystemExit is not an Exception, so a refusal stops the command there, printing the message, status 1.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            claim_run_dir(config.hydra.run.dir, config.hydra.output_subdir)
        except FolderInUseError as err:
            raise SystemExit(f"Error: {err}") from None
        except OSError as err:
            raise SystemExit(cannot_create("hydra.run.dir", config.hydra.run.dir, err)) from None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_sweep_subdir(config.hydra)
            claim_sweep_dir(config.hydra.sweep.dir)
        except FolderInUseError as err:
            raise SystemExit(f"Error: {err}") from None
        except OSError as err:
            raise SystemExit(cannot_create("hydra.sweep.dir", config.hydra.sweep.dir, err)) from None
