"""Every config key says what it does: a `Field(description=...)` on every field of every model
reachable from ExperimentConfig (the only place a user reads what a key means)."""

import subprocess
import sys

from realcore.api.config import config_keys, config_sections


def test_the_walk_reaches_nested_and_optional_keys():
    keys = config_keys()
    for key in ("trainer.total_steps", "actor.optimizer.lr", "ref.megatron.moe_token_dispatcher", "mfcs.name",
                "eval.dataset.seed", "system.name_resolve.timeout_s", "model.tiny.family"):
        assert key in keys, key
    assert len(keys) > 150


def test_every_config_key_has_a_description():
    missing = sorted(k for k, d in config_keys().items() if not (d and d.strip()))
    assert not missing, f"config keys without Field(description=...) in realcore/api/config.py: {missing}"


def test_every_config_section_has_a_docstring():
    for model in config_sections():
        assert (model.__doc__ or "").strip(), f"{model.__name__} has no docstring"


def test_help_prints_the_keys_under_a_prefix():
    out = subprocess.run([sys.executable, "-m", "realcore.launch", "--help", "trainer"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "trainer.total_steps" in out.stdout and config_keys()["trainer.batch_size"] in out.stdout
    assert "actor.optimizer.lr" not in out.stdout
