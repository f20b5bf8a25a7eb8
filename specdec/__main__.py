"""`specdec-run` / `python -m specdec`: the Hydra app over `conf/`.

    python -m specdec                                   # the default experiment on the embedded model
    python -m specdec experiment=quick method.num_speculative_tokens=8
    python -m specdec -m method.num_speculative_tokens=1,2,4,8 generation.temperature=0,0.7
    python -m specdec --cfg job                         # print the composed config and exit

The job body is `specdec.experiment.run`; the schema and checks are in `specdec.config`.
"""

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from specdec.config import register

register()  # the schema must be in the ConfigStore before Hydra composes `conf/config.yaml`


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Run one job; returns the method's speedup (what a sweeper such as Optuna would optimise)."""
    from specdec.experiment import run  # imported here so `--help` and `--cfg` stay fast

    result = run(cfg, HydraConfig.get().runtime.output_dir)
    return result.summary["speedup"]


if __name__ == "__main__":
    main()
