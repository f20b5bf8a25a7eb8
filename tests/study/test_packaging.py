"""The package carries what a run needs: configs (conf/ shipped as `specdec.conf`), the built-in and
Spec-Bench prompts, every subpackage; `specdec-run` works from a wheel installed elsewhere, from any
folder, and configs of one's own still plug in through Hydra's search path."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _setuptools() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_subpackage_and_config_ships():
    setuptools = _setuptools()
    packages = set(setuptools["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "specdec").rglob("*.py")
             if "__pycache__" not in p.parts}
    assert found <= packages, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(found - packages)}"
    assert setuptools["package-dir"]["specdec.conf"] == "conf" and "specdec.conf" in packages
    patterns = setuptools["package-data"]["specdec.conf"]
    configs = {p.relative_to(REPO / "conf") for p in (REPO / "conf").rglob("*.yaml")}
    shipped = {p.relative_to(REPO / "conf") for pattern in patterns for p in (REPO / "conf").glob(pattern)}
    assert configs and configs == shipped
    data = setuptools["package-data"]["specdec"]
    assert "data/spec_bench/*" in data and "data/*.jsonl" in data


def test_the_app_reads_the_packaged_configs():
    """Installed (editable here), the app's configs are the package's `specdec.conf`: conf/ itself."""
    from hydra import compose, initialize_config_module

    from specdec.__main__ import config_path

    assert config_path() == "pkg://specdec.conf"
    with initialize_config_module(config_module="specdec.conf", version_base="1.3"):
        cfg = compose("config", overrides=["experiment=spec_bench_greedy"])
    assert cfg.data.source == "spec_bench" and cfg.data.path is None and cfg.target.path == "embedded"


def test_a_clone_on_pythonpath_reads_its_own_configs(tmp_path):
    """With another checkout installed editable, a clone run with PYTHONPATH=<clone> finds that
    checkout's `specdec.conf` through the install: it must read its own conf/ (an experiment added
    there is found), not the installed one."""
    clone = tmp_path / "clone"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("specdec", "conf"):
        shutil.copytree(REPO / name, clone / name, ignore=ignore)
    env = {**os.environ, "PYTHONPATH": str(clone)}
    code = "from specdec.__main__ import config_path; import specdec; print(specdec.__file__); print(config_path())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    imported, path = out.stdout.split()
    assert Path(imported).resolve().is_relative_to(clone.resolve()) and Path(path) == clone.resolve() / "conf"


@pytest.mark.slow
def test_a_wheel_installed_elsewhere_runs_from_any_folder(tmp_path):
    """Build a wheel from the repository's files alone, install it into a fresh virtual environment, and
    run `specdec-run` from an unrelated folder: the packaged configs and Spec-Bench prompts, plus an
    experiment of the user's own through hydra.searchpath."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("specdec", "conf"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            str(src), "-w", str(tmp_path / "dist")], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (tmp_path / "dist").glob("specdec-*.whl")
    venv = tmp_path / "venv"
    # --system-site-packages: torch, transformers, hydra... come from this environment; specdec does not
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    pip = subprocess.run([venv / "bin" / "pip", "install", "-q", "--no-deps", str(wheel)],
                         capture_output=True, text=True)
    assert pip.returncode == 0, pip.stdout + pip.stderr

    mine = tmp_path / "my_configs" / "experiment"
    mine.mkdir(parents=True)
    (mine / "mine.yaml").write_text(
        "# @package _global_\n"
        "defaults:\n  - override /target: tiny_random\n  - override /draft: tiny_random\n"
        "  - override /data: spec_bench\n"
        "data:\n  limit: 1\n  categories: [qa, translation]\ngeneration:\n  max_new_tokens: 3\n"
        "dtype: float32\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    where = subprocess.run([venv / "bin" / "python", "-c", "import specdec; print(specdec.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True).stdout
    assert Path(where.strip()).is_relative_to(venv), where  # the wheel's copy, not the repository's
    run = subprocess.run([venv / "bin" / "specdec-run", "experiment=mine", "logger=none", "warmup=false",
                          "plots=false", "threads=1", f"hydra.searchpath=[file://{mine.parent}]",
                          "hydra.run.dir=out"], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((elsewhere / "out" / "summary.json").read_text())
    assert summary["data"] == "spec_bench" and summary["max_new_tokens"] == 3 and summary["complete"] is True
    assert set(summary["categories"]) == {"qa", "translation"}
