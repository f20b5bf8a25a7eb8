"""`specdec-run` / `python -m specdec`: the Hydra app over the configs in `conf/`.

    python -m specdec                                   # the default experiment on the embedded model
    python -m specdec experiment=quick method.num_speculative_tokens=8
    python -m specdec -m method.num_speculative_tokens=1,2,4,8 generation.temperature=0,0.7
    python -m specdec --cfg job                         # print the composed config and exit
    specdec-run 'hydra.searchpath=[file:///path/to/my_configs]' experiment=mine   # configs of your own

The configs are `conf/` at the top of the repository, shipped inside the package as `specdec.conf`
(pyproject.toml), so the app reads the same files from a clone, an editable install or a wheel, from
any folder. A clone used without installing it (`PYTHONPATH=.`) has no `specdec.conf` of its own;
the app then reads `conf/` beside the package directly.

The job body is `specdec.study.experiment.run`; the schema and checks are in `specdec.study.config`.
"""

import importlib.util
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from specdec.study.config import override_hints, register

register()  # the schema must be in the ConfigStore before Hydra composes `config.yaml`


def config_path() -> str:
    """Where Hydra reads the configs: the package's `specdec.conf`, or a clone's `conf/` when not
    installed. A `specdec.conf` that is neither inside this `specdec` (a wheel) nor beside it (an
    editable install of this checkout) belongs to another checkout's editable install, found because
    this clone is on PYTHONPATH: this clone's own `conf/` is read instead."""
    package = Path(__file__).resolve().parent
    found = importlib.util.find_spec("specdec.conf")
    where = [Path(p).resolve() for p in (found.submodule_search_locations or [])] if found is not None else []
    if where and where[0] in (package / "conf", package.parent / "conf"):
        return "pkg://specdec.conf"
    return str(package.parent / "conf")


@hydra.main(version_base="1.3", config_path=config_path(), config_name="config")
def main(cfg: DictConfig) -> float:
    """Run one job; returns the method's speedup (what a sweeper such as Optuna would optimise)."""
    from specdec.core.errors import reported
    from specdec.study.experiment import run  # imported here so `--help` and `--cfg` stay fast

    # Bad input (a config value, a prompt file, a model), not a bug: its message says what is wrong
    # and what to do, and a traceback would only bury it.
    with reported():
        result = run(cfg, HydraConfig.get().runtime.output_dir)
    return result.summary["speedup"]


def cli() -> None:
    """The command: Hydra's app; when Hydra refuses the command line (it prints why and exits), the
    settings a misspelt or misplaced key probably meant (`specdec.study.config.override_hints`)."""
    try:
        main()
    except SystemExit as stop:
        if stop.code not in (None, 0):
            for hint in override_hints(sys.argv[1:]):
                print(f"Hint: {hint}", file=sys.stderr)
        raise


if __name__ == "__main__":
    cli()
