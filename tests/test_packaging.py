"""A built wheel holds the experiment configs, and realcore installed from it (not the source tree)
composes the default experiment from another directory; REALCORE_EXPERIMENTS still wins."""

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    # Built from a copy: setuptools writes build/ and *.egg-info next to setup.py.
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    shutil.copy(REPO / "setup.py", src)
    for folder in ("realcore", "experiments"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp), "."],
                   cwd=src, check=True, capture_output=True, timeout=300)
    (whl,) = tmp.glob("realcore-*.whl")
    return whl


def test_the_wheel_holds_every_experiment_config(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = [p.relative_to(REPO).as_posix() for p in (REPO / "experiments").rglob("*.yaml")]
    assert "experiments/config.yaml" in configs and len([c for c in configs if c.startswith("experiments/experiment/")]) > 10
    missing = [c for c in configs if f"realcore/{c}" not in names]
    assert not missing, f"not in {wheel.name}: {missing}"


def test_installed_wheel_composes_the_default_experiment_from_anywhere(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    script = ("import realcore; from realcore.launch.config_loader import experiments_dir, load_config; "
              "cfg = load_config(['experiment=ppo-math', 'model=tiny']); "
              "print(realcore.__file__); print(experiments_dir()); print(cfg.experiment_name, cfg.model.name)")
    env = {k: v for k, v in os.environ.items() if k != "REALCORE_EXPERIMENTS"}
    p = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env={**env, "PYTHONPATH": str(site)},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    module, configs, composed = p.stdout.strip().splitlines()[-3:]
    assert pathlib.Path(module).is_relative_to(site), module  # the installed copy, not the source tree
    assert pathlib.Path(configs) == site / "realcore" / "experiments"
    assert composed == "ppo-math tiny"

    # REALCORE_EXPERIMENTS overrides the installed tree
    other = tmp_path / "mine"
    shutil.copytree(REPO / "experiments", other)
    (other / "experiment" / "mine.yaml").write_text((REPO / "experiments" / "experiment" / "ppo-math.yaml").read_text()
                                                   .replace("experiment_name: ppo-math", "experiment_name: mine"))
    script = script.replace("experiment=ppo-math", "experiment=mine")
    p = subprocess.run([sys.executable, "-c", script], cwd=tmp_path,
                       env={**env, "PYTHONPATH": str(site), "REALCORE_EXPERIMENTS": str(other)},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-2:] == [str(other), "mine tiny"]
