"""Compose the experiment config with hydra and validate it with pydantic.

Hydra stays here; everything else receives a typed `ExperimentConfig`. Any problem becomes one
`ConfigError` line that names the full key path and the reason.
"""

from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path

import pydantic

from realcore.api.config import ExperimentConfig
from realcore.launch.plugins import load_plugins


class ConfigError(ValueError):
    """A user error in the experiment config; the launcher prints it on one line and exits 2."""


def experiments_dir() -> Path:
    """The hydra config tree: $REALCORE_EXPERIMENTS, else the one installed with the package
    (setup.py installs experiments/ as realcore/experiments), else a source checkout's
    experiments/ (realcore imported from the checkout: PYTHONPATH or an editable install)."""
    env = os.environ.get("REALCORE_EXPERIMENTS")
    installed = Path(str(resources.files("realcore") / "experiments"))
    if env:
        path = Path(env)
    elif (installed / "config.yaml").exists():
        path = installed
    else:
        path = Path(__file__).resolve().parents[2] / "experiments"
    if not (path / "config.yaml").exists():
        raise ConfigError(f"experiment configs not found at {path} (set REALCORE_EXPERIMENTS)")
    return path


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def format_validation_error(err: pydantic.ValidationError) -> str:
    parts = []
    for e in err.errors():
        where = _loc(e["loc"]) or "config"
        if e["type"] == "extra_forbidden":
            parts.append(f"{where}: unknown key")
        elif e["type"] == "missing":
            parts.append(f"{where}: required key is missing")
        else:
            got = e.get("input")
            shown = f" (got {got!r})" if got is not None and not isinstance(got, (dict, list)) else ""
            parts.append(f"{where}: {e['msg']}{shown}")
    return "; ".join(parts)


def _hydra_error_line(err: Exception) -> str:
    text = " ".join(str(err).split())
    if text.startswith("Could not override '"):  # a key that the config does not have
        key = text.split("'", 2)[1]
        inner = re.search(r"Key '([^']+)' is not in struct", text)
        if inner and inner.group(1) != key.rsplit(".", 1)[-1]:  # a new key inside a mapping value
            return f"{key}: unknown key {inner.group(1)!r} (use ++{key}.{inner.group(1)}=... to add it)"
        return f"{key}: unknown key"
    m = re.search(r"Could not find '([^/']+)/([^']+)' Available options in '[^']+': (.*?)(?: Config search path.*)?$", text)
    if m:
        group, choice, options = m.groups()
        return f"{group}={choice}: no such {group} config (available: {', '.join(options.split())})"
    return text


FREE_FORM = ("rollout.workflow_kwargs", "dataset.kwargs", "dataset.task_kwargs")


def _defaults() -> dict:
    """Every key with a default, from the pydantic models: the base of the hydra tree, so that any
    existing key can be overridden on the command line and a misspelt one is refused."""
    out = {}
    for name, field in ExperimentConfig.model_fields.items():
        if field.is_required():
            continue
        value = field.get_default(call_default_factory=True)
        out[field.alias or name] = value.model_dump() if isinstance(value, pydantic.BaseModel) else value
    return out


# Optional sub-configs (None by default) that an experiment may set: `KEY={...}` on the command line
# gives the whole new value, as it does when the experiment leaves KEY unset (hydra would merge it
# into the experiment's mapping, keeping keys the user did not write, or refuse a key it lacks).
REPLACED_WHOLE = ("eval.dataset", "ref")


def _replace_whole(overrides: list[str]) -> list[str]:
    """`KEY={...}` -> `~KEY`, `+KEY={...}` where KEY is one of REPLACED_WHOLE and the composition
    without those overrides already holds a mapping there."""
    def whole(o: str) -> bool:
        key, _, value = o.partition("=")
        return key in REPLACED_WHOLE and value.lstrip().startswith("{")

    if not any(whole(o) for o in overrides):
        return overrides
    base = _compose([o for o in overrides if not whole(o)])
    out = []
    for o in overrides:
        key = o.partition("=")[0]
        node = base
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        out += [f"~{key}", f"+{o}"] if whole(o) and isinstance(node, dict) else [o]
    return out


def _quote_allocation(overrides: list[str]) -> list[str]:
    """`allocation_mode=actor:d1,ref:d1` as one string (hydra reads an unquoted comma as a sweep)."""
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+") == "allocation_mode" and "," in value and value[:1] not in "'\"":
            o = f"{key}='{value}'"
        out.append(o)
    return out


def compose(overrides: list[str]) -> dict:
    """Hydra composition of `experiments/` with command-line overrides, resolved to a plain dict."""
    return _compose(_replace_whole(_quote_allocation(overrides)))


def _compose(overrides: list[str]) -> dict:
    # hydra and omegaconf: ~0.2 s, only for composing; --help and the workers never compose
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    GlobalHydra.instance().clear()
    defaults = OmegaConf.create(_defaults())
    for key in FREE_FORM:  # keyword arguments of user code: any key may be added from the command line
        OmegaConf.set_struct(OmegaConf.select(defaults, key), False)
    ConfigStore.instance().store(name="realcore_defaults", node=defaults)
    try:
        with initialize_config_dir(config_dir=str(experiments_dir()), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=overrides)
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except ConfigError:
        raise
    except Exception as e:  # hydra / omegaconf raise many types; the user needs one line
        raise ConfigError(_hydra_error_line(e)) from None


def load_config(overrides: list[str]) -> ExperimentConfig:
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"argument {bad[0]!r}: expected key=value")
    raw = compose(overrides)
    try:
        return ExperimentConfig.model_validate(raw)
    except pydantic.ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


def import_user_modules(cfg: ExperimentConfig) -> None:
    try:
        load_plugins(cfg.imports)
    except ValueError as e:
        raise ConfigError(str(e)) from None
