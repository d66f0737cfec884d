"""The launcher's command line: `--help` with defaults, the generated configuration reference,
`--print-config`, and `--dry-run` under every scheduler writing nothing into output_dir."""

import importlib.util
import os
import subprocess
import sys

import pytest
from conftest import skip_unless_ci
import yaml

from realcore.api.config import REQUIRED, ExperimentConfig, config_entries
from realcore.launch.cli_help import REGENERATE, format_default, markdown
from realcore.launch.config_loader import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(*argv, timeout=300):
    return subprocess.run([sys.executable, "-m", "realcore.launch", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_help_shows_each_keys_default():
    r = launch("--help", "actor.optimizer")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "  actor.optimizer.lr (default: 1e-05)" in lines
    assert "  actor.optimizer.lr_scheduler (default: cosine)" in lines
    assert not any(x.startswith("  trainer.") for x in lines)  # the prefix filters
    r = launch("--help")
    lines = r.stdout.splitlines()
    assert "  trainer.batch_size (default: 8)" in lines
    assert "  actor.trainable (default: true)" in lines  # the actor's own default, not RoleConfig's
    assert "  ref.trainable (default: false)" in lines
    assert "  ref (default: null)" in lines
    assert "  actor.lora.target_modules (default: [q_proj, k_proj, v_proj, o_proj])" in lines
    assert "  dataset.kwargs (default: {})" in lines
    assert "  experiment_name" in lines and "  mfcs.name" in lines  # required: no default
    assert '  dataset.prompt_template (default: "Question: {question}\\nAnswer:")' in lines
    for flag in ("--dry-run", "--print-config"):
        assert flag in lines[0], lines[0]


def test_every_default_is_shown():
    entries = {e.key: e for e in config_entries()}
    assert entries["experiment_name"].default is REQUIRED and entries["mfcs.type"].default is REQUIRED
    out = launch("--help").stdout
    for e in entries.values():
        if e.default is not REQUIRED and e.section is None:
            assert f"  {e.key} (default: {format_default(e.default)})\n" in out, e.key


def test_the_configuration_reference_is_current():
    """docs/configuration.md is generated; an edit of a config model's description or default must
    regenerate it."""
    with open(os.path.join(REPO, "docs", "configuration.md")) as f:
        page = f.read()
    assert page == markdown(), f"docs/configuration.md is not current: run `{REGENERATE}`"
    assert REGENERATE in page
    assert "- `trainer.total_steps` (default: 10): training steps of the run" in page
    assert "## `actor`" in page and "### `actor.optimizer`" in page


def test_print_config_prints_the_resolved_configuration(tmp_path):
    out = str(tmp_path / "run")
    argv = ["experiment=ppo-math", "trainer.total_steps=3", "ppo.eps_clip=0.3", f"output_dir={out}",
            "rollout.server_token=cli-secret-token"]
    r = launch("--print-config", *argv)
    assert r.returncode == 0, r.stderr
    printed = yaml.safe_load(r.stdout)
    expected = load_config(argv).model_dump(mode="json")
    expected["rollout"]["server_token"] = "<hidden>"  # a secret is not printed
    assert printed == expected and "cli-secret-token" not in r.stdout
    assert printed == ExperimentConfig.model_validate(printed).model_dump(mode="json")
    assert printed["trainer"]["total_steps"] == 3 and printed["ppo"]["eps_clip"] == 0.3
    assert printed["experiment_name"] == "ppo-math" and printed["mfcs"]
    assert not os.path.exists(out)


def test_print_config_shows_the_graph_a_run_gets_and_stdout_stays_yaml(tmp_path):
    """At ppo.kl_coef=0 nothing reads the reference log-probs: the printed config has no ref_inf and
    no ref role (what the run builds), and the launcher's note about it goes to stderr, not into the YAML."""
    r = launch("--print-config", "experiment=ppo-math", "ppo.kl_coef=0", f"output_dir={tmp_path}/run")
    assert r.returncode == 0, r.stderr
    printed = yaml.safe_load(r.stdout)
    assert "realcore" not in printed and printed["ref"] is None, r.stdout[:300]
    assert [m["name"] for m in printed["mfcs"]] == ["actor_gen", "actor_train"]
    assert "ref_inf" in r.stderr


def test_print_config_loads_the_users_imports(tmp_path):
    """A reward registered by a module of `imports:` is valid only once that module is imported."""
    (tmp_path / "cli_user_reward.py").write_text(
        "from realcore.api.registry import register_reward\n\n"
        "@register_reward('cli-user-reward')\n"
        "def reward(prompt, completion, prompt_ids, completion_ids, **data):\n    return 0.0\n")
    argv = ["--print-config", "reward.type=cli-user-reward", f"output_dir={tmp_path}/run"]
    r = subprocess.run([sys.executable, "-m", "realcore.launch", *argv, "imports=[cli_user_reward]"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    printed = yaml.safe_load(r.stdout)
    assert printed["imports"] == ["cli_user_reward"] and printed["reward"]["type"] == "cli-user-reward"
    r = subprocess.run([sys.executable, "-m", "realcore.launch", *argv], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "cli-user-reward" in r.stderr, r.stderr


def test_print_config_errors_are_one_line(tmp_path):
    r = launch("--print-config", "trainer.total_stepz=3", f"output_dir={tmp_path}/run")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["realcore: config error: trainer.total_stepz: unknown key"]
    r = launch("--print-config", "trainer.total_steps=0", f"output_dir={tmp_path}/run")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "trainer.total_steps" in r.stderr
    assert not os.path.exists(tmp_path / "run")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("model-cache"))


@pytest.mark.parametrize("scheduler", ["local", "ray", "slurm"])
def test_a_dry_run_writes_nothing_into_output_dir(tmp_path, cache, scheduler):
    if scheduler == "ray" and importlib.util.find_spec("ray") is None:
        skip_unless_ci("Ray is not installed (pip install -e '.[ray]')")
    fresh, used = tmp_path / "fresh", tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    # An existing folder too under Slurm, whose dry run once wrote .secret, .lock, config.json and the script there.
    for out in (fresh, used) if scheduler == "slurm" else (fresh,):
        r = launch("--dry-run", "experiment=ppo-math", f"model.cache_dir={cache}", f"output_dir={out}",
                   f"scheduler={scheduler}", "trainer.total_steps=2")
        assert r.returncode == 0, r.stderr[-2000:]
        if scheduler == "slurm":
            assert r.stdout.startswith("#!/bin/bash\n#SBATCH"), r.stdout[:200]
            assert "nothing was written" in r.stderr and os.path.join(out, ".secret") in r.stderr, r.stderr
        else:
            assert "realcore: dry run: nothing was started" in r.stdout, r.stdout
    assert not fresh.exists()
    assert sorted(os.listdir(used)) == ["notes.txt"]
