"""`python -m specdec.study.dashboard`, offline: the workspace and the report build and validate, every key
their panels name is one a real (tiny, offline) run logs to W&B, a misspelt key fails that check, and
the definition is written to a file. W&B's network API is replaced by one that fails the test if called."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from specdec.study import dashboard, experiment
from specdec.study.data import load_prompts

wr = dashboard.wr
ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
K = 3


def _no_network(*args, **kwargs):
    raise AssertionError("the dashboard tried to reach W&B")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setattr(wandb, "Api", _no_network)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A real run logged to W&B offline: tiny random target drafting for itself (every position up to k
    is reached), built-in prompts. Returns (summary, W&B run folder, the keys it logged)."""
    out = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_ERROR_REPORTING", "false")
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=[
                "experiment=tiny_smoke", "logger=wandb", "draft=self", f"method.num_speculative_tokens={K}",
                "generation.max_new_tokens=8", "plots=false", "warmup=false"])
        result = experiment.run(cfg, out)
    assert result.wandb_run_dir is not None
    return result.summary, result.wandb_run_dir, dashboard.logged_keys(result.wandb_run_dir)


def _build(kind: str, summary: dict, **kwargs):
    return dashboard.build(kind, "specdec", entity="me", categories=summary["categories"], k_max=K, **kwargs)


@pytest.mark.parametrize("kind", dashboard.KINDS)
def test_every_key_a_panel_names_is_logged_by_a_real_run(kind, tiny_run):
    summary, _, logged = tiny_run
    definition = _build(kind, summary, group="sweep-1")
    dashboard.validate(definition)
    refs = dashboard.named_metrics(definition)
    names = {r.name for r in refs}
    # the panels the study needs are there, under the keys the tracker logs
    assert {"speedup", "tokens_per_s", "baseline_tokens_per_s", "mean_accepted_length", "acceptance_rate",
            "predicted_speedup", "ttft_s", "lossless", "matches_baseline", "method.name",
            "method.num_speculative_tokens", "prompt/speedup"} <= names
    assert {f"per_position_acceptance/{i}" for i in range(1, K + 1)} <= names
    assert {f"per_category/{c}/speedup" for c in summary["categories"]} <= names
    assert {r.kind for r in refs} == {"summary", "history", "config"}
    assert dashboard.missing_metrics(definition, logged) == []


def test_a_misspelt_key_fails_the_check(tiny_run):
    summary, _, logged = tiny_run
    definition = _build("workspace", summary)
    definition.sections[0].panels += [wr.BarPlot(title="typo", metrics=["speedpu"]),
                                      wr.ScatterPlot(title="typo", x=wr.Config("method.num_speculative_token"),
                                                     y=wr.SummaryMetric("speedup")),
                                      wr.LinePlot(title="typo", x="prompt/index", y=["prompt/sped"])]
    missing = dashboard.missing_metrics(definition, logged)
    assert [(r.kind, r.name) for r in missing] == [
        ("summary", "speedpu"), ("config", "method.num_speculative_token"), ("history", "prompt/sped")]
    # a history key is not a config key, nor the reverse: the kind matters
    definition = _build("workspace", summary)
    definition.sections[0].panels.append(wr.LinePlot(title="wrong kind", x="prompt/index", y=["speedup"]))
    assert [r.name for r in dashboard.missing_metrics(definition, logged)] == ["speedup"]


def test_check_from_the_command_line(tiny_run, tmp_path, monkeypatch, capsys):
    summary, run_dir, logged = tiny_run
    argv = ["--project", "specdec", "--offline", "--check", str(run_dir), "--k-max", str(K),
            "--categories", ",".join(summary["categories"]), "--out", str(tmp_path / "d.json")]
    assert dashboard.main(argv) == 0
    assert "every key the workspace names is logged" in capsys.readouterr().out
    real = dashboard.sections

    def misspelt(*args, **kwargs):
        out = real(*args, **kwargs)
        out[1].panels[0] = wr.BarPlot(title="tau", metrics=["mean_acceptance_length"])
        return out

    monkeypatch.setattr(dashboard, "sections", misspelt)
    monkeypatch.setattr(dashboard, "logged_keys", lambda run: logged)  # read above already; saves seconds
    assert dashboard.main(argv) == 1
    assert "summary key 'mean_acceptance_length' (BarPlot tau)" in capsys.readouterr().err


@pytest.mark.parametrize("kind, suffix", [("workspace", ".json"), ("report", ".yaml")])
def test_offline_writes_the_definition(kind, suffix, tmp_path, capsys):
    path = tmp_path / f"dash{suffix}"
    assert dashboard.main(["--project", "specdec", "--kind", kind, "--group", "sweep-1", "--out", str(path)]) == 0
    assert "not saved to W&B (--out)" in capsys.readouterr().out
    text = path.read_text()
    data = yaml.safe_load(text) if suffix == ".yaml" else json.loads(text)
    assert data["kind"] == kind and data["definition"]["project"] == "specdec"
    assert "per_category/multi_turn/speedup" in data["metrics"]["summary"]
    assert f"per_position_acceptance/{dashboard.DEFAULT_K_MAX}" in data["metrics"]["summary"]
    assert "sweep-1" in text  # the group filter


def test_without_credentials_nothing_is_sent(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("NETRC", raising=False)
    assert dashboard.offline_reason(False, None).startswith("no W&B credentials")
    monkeypatch.chdir(tmp_path)
    assert dashboard.main(["--project", "specdec", "--kind", "report"]) == 0
    assert json.loads((tmp_path / "specdec_report.json").read_text())["kind"] == "report"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert dashboard.offline_reason(False, None) is None
    assert dashboard.offline_reason(True, None) == "--offline"


def test_validate_refuses_panels_that_name_nothing_or_are_unknown():
    definition = dashboard.build_workspace("specdec")
    definition.sections[0].panels.append(wr.BarPlot(title="empty", metrics=[]))
    with pytest.raises(ValueError, match="'empty' names no metric"):
        dashboard.validate(definition)
    definition = dashboard.build_workspace("specdec")
    definition.sections[0].panels.append(wr.RunComparer())
    with pytest.raises(TypeError, match="RunComparer"):
        dashboard.named_metrics(definition)


def test_default_categories_are_those_of_the_shipped_prompt_sets(monkeypatch):
    monkeypatch.chdir(ROOT)  # data paths in conf/ resolve against the directory a command runs from
    builtin = {p.category for p in load_prompts("builtin")}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["data=spec_bench", "data.limit=1"])
    spec_bench = {p.category for p in experiment.load_data(cfg)}
    assert set(dashboard.DEFAULT_CATEGORIES) == builtin | spec_bench
