"""Every config key says what it does: a `Field(description=...)` on every field of every model
reachable from ExperimentConfig (the only place a user reads what a key means)."""

import typing

from pydantic import BaseModel

from realcore.api.config import ExperimentConfig


def _models(annotation) -> list[type[BaseModel]]:
    """The pydantic models inside an annotation (`X`, `X | None`, `list[X]`, `dict[str, X]`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def config_keys(model: type[BaseModel] = ExperimentConfig, prefix: str = "") -> dict[str, str | None]:
    """Dotted key -> its description, recursively (`mfcs.name` for the items of a list)."""
    out = {}
    for name, field in model.model_fields.items():
        key = prefix + name
        out[key] = field.description
        for sub in _models(field.annotation):
            out.update(config_keys(sub, key + "."))
    return out


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
    seen, todo = set(), [ExperimentConfig]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        assert (model.__doc__ or "").strip(), f"{model.__name__} has no docstring"
        todo += [m for f in model.model_fields.values() for m in _models(f.annotation)]
