"""Every job of a sweep is checked before the first one runs.

Hydra composes each job's config as it launches it, and `specdec.study.config.validate` checks a config
when its job starts: a value that cannot work in the last job of a sweep (`k=2,0`) would otherwise
be found only after every job before it has run, hours later. `SweepCheck`, a Hydra callback listed
first in `conf/config.yaml`, expands the basic sweeper's jobs as it will (the command line's sweeps
and `hydra.sweeper.params`), composes each job's config and validates it, before any folder is
made; the first that fails stops the sweep with one `Error:` line naming the job. Other sweepers
(Optuna, ...) choose their jobs as they go, so theirs are checked as they start.
"""

from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def job_overrides(config: DictConfig) -> list[list[str]]:
    """The overrides of every job the basic sweeper will launch for `config` (the sweep's own config,
    with its `hydra` node), in its order."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = config.hydra.sweeper.get("params") or {}
    arguments = [f"{key}={value}" for key, value in params.items()]
    arguments += list(OmegaConf.to_container(config.hydra.overrides.task))
    loader = GlobalHydra.instance().config_loader() if GlobalHydra.instance().is_initialized() else None
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(arguments)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def check_jobs(config: DictConfig) -> None:
    """Compose and validate every job of the sweep; SystemExit with `Error: job N (...)` at the first
    that cannot work."""
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig

    from specdec.core.errors import InputError
    from specdec.study.config import validate
    from specdec.study.variants import expand

    hydra_overrides = list(OmegaConf.to_container(config.hydra.overrides.hydra))  # hydra.searchpath, ...
    before = HydraConfig.instance().cfg
    try:
        for num, overrides in enumerate(job_overrides(config)):
            job = compose(config.hydra.job.config_name, overrides=[*hydra_overrides, *overrides],
                          return_hydra_config=True)
            HydraConfig.instance().set_config(job)  # what the job will see: its search path, for parts' names
            try:
                validate(expand(job))  # a job's grid too: every variant of every job
            except InputError as err:
                raise SystemExit(f"Error: sweep job {num} ({' '.join(overrides)}): {err}; no job has run") from None
    finally:
        HydraConfig.instance().cfg = before


class SweepCheck(Callback):
    """Hydra callback: every job of a basic sweep is validated before the first one runs."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.sweeper.get("_target_") == BASIC_SWEEPER:
            check_jobs(config)
