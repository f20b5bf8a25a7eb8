"""One way to name an implementation (specdec.study.registry): a verifier, schedule, data source or tracker is
a `_target_` node or the name of a file holding one, the valid names are the files found (the package's
and those of any folder on hydra.searchpath), and a new one added from a folder of its own (a module on
sys.path plus one YAML) runs in the checks, the app and a sweep with no other edit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from specdec.adaptive.schedules import CostAwareSchedule
from specdec.core.sampling import SamplingParams
from specdec.core.schedules import make_schedule
from specdec.core.verify import BlockVerifier, GreedyVerifier, TypicalVerifier, make_verifier
from specdec.study import experiment, registry
from specdec.study.config import ConfigError, validate
from specdec.study.tracking import make_tracker

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"

PARTS = '''
from specdec.core.schedules import ConstantSchedule
from specdec.study.tracking import Tracker
from specdec.core.verify import GreedyVerifier


class StrictGreedy(GreedyVerifier):
    name = "strict_greedy"

    def __init__(self, margin: float = 0.0):
        self.margin = margin


class Halving(ConstantSchedule):
    name = "halving"

    def __init__(self, num_speculative_tokens, divisor: int = 2):
        super().__init__(num_speculative_tokens)
        self.divisor = divisor

    def next_k(self, state):
        return max(1, self.k_max // self.divisor)

    def report(self):
        return {"name": self.name, "divisor": self.divisor}


def questions(path=None, n: int = 2):
    from specdec.study.data import Prompt

    return [Prompt(f"q{i}", "made_up", (f"What is {i} + {i}?",)) for i in range(n)]


class Notebook(Tracker):
    def __init__(self, project: str = "x", tags=()):
        self.project, self.tags = project, list(tags)
'''


@pytest.fixture
def own_folder(tmp_path, monkeypatch):
    """A folder of one's own: `my_parts.py` (a verifier and a schedule) and their two YAML files."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "my_parts.py").write_text(PARTS)
    for group, name, text in (("method/verifier", "strict", "_target_: my_parts.StrictGreedy\nmargin: 0.5\n"),
                              ("method/schedule", "halving", "_target_: my_parts.Halving\n"),
                              ("data/source", "made_up", "_target_: my_parts.questions\n"),
                              ("logger/kind", "notebook", "_target_: my_parts.Notebook\n")):
        folder = tmp_path / "conf" / group
        folder.mkdir(parents=True)
        (folder / f"{name}.yaml").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    return tmp_path


@pytest.fixture
def in_job():
    """Compose as the app does and make it the running job's config (HydraConfig), then undo that."""
    def enter(overrides: list[str]):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        return cfg

    yield enter
    HydraConfig.instance().cfg = None


def test_the_options_are_the_files():
    for folder in ("method/verifier", "method/schedule", "data/source", "logger/kind"):
        assert registry.options(folder) == sorted(p.stem for p in (CONF / folder).glob("*.yaml"))
    assert {"auto", "greedy", "speculative_sampling", "block", "typical", "forced"} <= set(
        registry.options("method/verifier"))
    with pytest.raises(ValueError, match="unknown verifier 'oracle'; choose one of: auto, block, forced"):
        make_verifier("oracle", SamplingParams())


def test_names_nodes_and_objects_build_the_same_parts():
    greedy, sampling = SamplingParams(0.0), SamplingParams(0.8)
    assert type(make_verifier("auto", greedy)) is GreedyVerifier
    assert type(make_verifier("block", sampling)) is BlockVerifier
    node = {"_target_": "specdec.core.verify.TypicalVerifier", "epsilon": 0.2}
    typical = make_verifier(registry.build_verifier(OmegaConf.create(node), {"delta": 0.4}), sampling)  # a node + args
    assert isinstance(typical, TypicalVerifier) and (typical.epsilon, typical.delta) == (0.2, 0.4)
    same = GreedyVerifier()
    assert make_verifier(same, greedy) is same
    schedule = make_schedule("cost_aware", 6, min_k=1)
    assert isinstance(schedule, CostAwareSchedule) and schedule.k_max == 6 and schedule.min_k == 1
    assert make_schedule(schedule, 3) is schedule


def test_arguments_are_checked_against_what_the_part_takes():
    with pytest.raises(ValueError, match=r"verifier=typical takes no verifier_args \['eps'\]; it takes: epsilon, delta"):
        make_verifier("typical", SamplingParams(0.7), eps=0.1)
    with pytest.raises(ValueError, match="verifier=forced needs verifier_args.acceptance"):
        make_verifier("forced", SamplingParams())
    with pytest.raises(ValueError, match=r"schedule=constant takes no schedule_args \['num_speculative_tokens'\]"):
        # k has one name, method.num_speculative_tokens: schedule_args cannot set it a second time
        registry.build("method/schedule", "constant", "schedule", {"num_speculative_tokens": 2}, num_speculative_tokens=4)
    with pytest.raises(ValueError, match="verifier=greedy needs generation.temperature=0"):
        make_verifier("greedy", SamplingParams(0.7))


def test_a_new_verifier_and_schedule_from_a_folder_of_ones_own(own_folder, in_job):
    search = f"hydra.searchpath=[file://{own_folder / 'conf'}]"
    cfg = in_job(["experiment=tiny_smoke", search, "method.verifier=strict", "method.schedule=halving",
                  "+method.schedule_args.divisor=4", "+method.verifier_args.margin=0.25"])
    assert "strict" in registry.options("method/verifier") and "halving" in registry.options("method/schedule")
    validate(cfg)
    verifier = make_verifier(registry.build_verifier(cfg.method.verifier, cfg.method.verifier_args), SamplingParams())
    assert (verifier.name, verifier.margin) == ("strict_greedy", 0.25)
    assert registry.build_schedule(cfg.method.schedule, 8, cfg.method.schedule_args).next_k(None) == 2
    cfg.method.schedule_args = {"divide": 4}
    with pytest.raises(ConfigError, match=r"method.schedule: schedule=halving takes no schedule_args \['divide'\]; "
                                          "it takes: divisor"):
        validate(cfg)
    cfg.method.schedule = "halfing"
    with pytest.raises(ConfigError, match="method.schedule: unknown schedule 'halfing'; choose one of: .*halving"):
        validate(cfg)


def test_a_new_data_source_and_tracker_from_a_folder_of_ones_own(own_folder, in_job):
    search = f"hydra.searchpath=[file://{own_folder / 'conf'}]"
    cfg = in_job(["experiment=tiny_smoke", search, "data.source=made_up", "+data.source_args.n=3",
                  "logger.kind=notebook", "logger.project=p"])
    validate(cfg)
    prompts = experiment.load_data(cfg)  # data.limit=1 per category of tiny_smoke
    assert [(p.prompt_id, p.category) for p in prompts] == [("q0", "made_up")]
    cfg.data.limit = None
    assert len(experiment.load_data(cfg)) == 3
    tracker = make_tracker(cfg.logger.kind, project=cfg.logger.project, entity=None, tags=["a"], init_timeout=1.0)
    assert (type(tracker).__name__, tracker.project, tracker.tags) == ("Notebook", "p", ["a"])
    cfg.data.source_args = {"m": 3}
    with pytest.raises(ConfigError, match=r"data.source: data.source=made_up takes no data.source_args \['m'\]; "
                                          "it takes: n"):
        validate(cfg)
    cfg.data.source_args, cfg.logger.kind = {}, "tensorboard"
    with pytest.raises(ConfigError, match="logger.kind: unknown logger.kind 'tensorboard'; choose one of: none, "
                                          "notebook, wandb"):
        validate(cfg)


def test_without_the_folder_the_name_is_refused_before_models_load(in_job):
    cfg = in_job(["experiment=tiny_smoke", "method.verifier=strict"])
    with pytest.raises(ConfigError, match="method.verifier: unknown verifier 'strict'; choose one of: auto, "):
        validate(cfg)


def _app(args: list[str], folder: Path, multirun: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder / "mods"), str(ROOT)])}
    search = f"hydra.searchpath=[file://{folder / 'conf'}]"
    return subprocess.run([sys.executable, "-m", "specdec", *(["-m"] if multirun else []), "experiment=tiny_smoke", search, *args],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=600)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_new_parts_run_in_the_app_and_in_a_sweep(own_folder):
    run = own_folder / "run"
    done = _app(["method.verifier=strict", "method.schedule=halving", "+method.schedule_args.divisor=4",
                 f"hydra.run.dir={run}"], own_folder)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in _rows(run) if r["method"] == "draft"]
    assert rows and all(r["verifier"] == "strict_greedy" and r["lossless"] for r in rows)
    # k = 4 // 4 every step, but a turn's last ones, which draft no more than can still be emitted less one
    assert all(1 in r["draft_lengths"] and set(r["draft_lengths"]) <= {0, 1} for r in rows)
    assert rows[0]["reports"][0]["schedule"] == {"name": "halving", "divisor": 4}

    sweep = own_folder / "sweep"
    done = _app(["method.verifier=strict,auto", "method.schedule=halving", f"hydra.sweep.dir={sweep}"],
                own_folder, multirun=True)
    assert done.returncode == 0, done.stderr[-3000:]
    verifiers = {json.loads((sweep / job / "summary.json").read_text())["verifier"] for job in ("0", "1")}
    assert verifiers == {"strict_greedy", "greedy"}
    for job in ("0", "1"):
        assert all(2 in r["draft_lengths"] and set(r["draft_lengths"]) <= {0, 1, 2}
                   for r in _rows(sweep / job) if r["method"] == "draft")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_core_names_and_the_shipped_files_build_the_same_parts(temperature):
    """The core names its built-in verifiers and schedules in plain dicts; conf/method/ ships a file for
    each. The two lists are twins: a name must build the same part either way, so they cannot drift."""
    from specdec.core.schedules import SCHEDULES
    from specdec.core.verify import VERIFIERS

    params = SamplingParams(temperature)
    assert set(VERIFIERS) == set(registry.options("method/verifier"))
    assert set(SCHEDULES) == set(registry.options("method/schedule"))
    args = {"forced": {"acceptance": 0.5}}
    for name in VERIFIERS:
        try:
            core = make_verifier(name, params, **args.get(name, {}))
        except ValueError as err:  # a rule that does not serve this temperature refuses it either way
            with pytest.raises(ValueError, match=str(err).split(";")[0]):
                make_verifier(registry.build_verifier(name, args.get(name)), params)
            continue
        built = make_verifier(registry.build_verifier(name, args.get(name)), params)
        assert type(core) is type(built) and vars(core).keys() == vars(built).keys(), name
    for name in SCHEDULES:
        assert type(make_schedule(name, 4)) is type(registry.build_schedule(name, 4)), name
