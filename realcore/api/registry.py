"""Registries at the user extension points: MFCs, rewards, datasets, rollout workflows, environments,
generation engines.

A user module listed in the experiment's `imports:` registers its own entries with these decorators;
the graph is built after those imports, so YAML can name them.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from realcore.api.generation import Availability, Capabilities, EngineEntry, ServerCommand
from realcore.api.workflow import TRAJECTORY_KEYS

_REGISTRIES: dict[str, dict[str, Any]] = {"mfc": {}, "reward": {}, "dataset": {}, "workflow": {}, "env": {},
                                          "engine": {}}


def _register(kind: str, name: str, obj: Any) -> Any:
    reg = _REGISTRIES[kind]
    if name in reg and reg[name] is not obj:
        raise ValueError(f"{kind} {name!r} is registered twice ({reg[name]!r} and {obj!r})")
    reg[name] = obj
    return obj


def lookup(kind: str, name: str) -> Any:
    reg = _REGISTRIES[kind]
    if name not in reg:
        raise KeyError(f"unknown {kind} {name!r}; registered: {sorted(reg)}")
    return reg[name]


def registered(kind: str) -> list[str]:
    return sorted(_REGISTRIES[kind])


@dataclass(frozen=True)
class MFCSpec:
    """What an MFC class is, declared as its `spec` class attribute (read by the graph, the master
    and the model worker).

    needs_model     it runs on a model role (False: on the master's data only, e.g. a rule reward)
    trains          a call updates its role's weights (the role must be trainable)
    generates       it only samples: with generation servers its `model` is a client of them
    micro_batches   it passes `mfc.max_tokens_per_mb` to the engine (else setting that key is an error)
    head            the head its role must have (policy, value, score); None: any
    optimizer_steps optimizer steps one call makes (int, or fn(cfg, mfc) -> int): sizes the
                    role's LR schedule to the run (total_steps x the largest of its training MFCs)
    optional_inputs inputs it reads only when something provides them: listed in the experiment and
                    provided by neither the data source nor an MFC, they are dropped from its inputs
                    (generate's `question` and `fields`: a user's dataset may have neither)
    """

    needs_model: bool = True
    trains: bool = False
    generates: bool = False
    micro_batches: bool = False
    head: str | None = None
    optimizer_steps: int | Callable[[Any, Any], int] = 1
    optional_inputs: tuple[str, ...] = ()

    def steps_per_call(self, cfg: Any, mfc: Any) -> int:
        n = self.optimizer_steps(cfg, mfc) if callable(self.optimizer_steps) else self.optimizer_steps
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"MFCSpec.optimizer_steps must be an int >= 1, got {n!r}")
        return n


def mfc_spec(name: str) -> MFCSpec:
    """The spec of the registered MFC type `name` (its class's `spec`; a default spec if it has none)."""
    spec = getattr(lookup("mfc", name), "spec", None)
    if spec is None:
        return MFCSpec()
    if not isinstance(spec, MFCSpec):
        raise TypeError(f"MFC {name!r}: spec must be a realcore.api.registry.MFCSpec, got {spec!r}")
    return spec


def register_mfc(name: str) -> Callable:
    """Class decorator. The class has `__init__(self, cfg: ExperimentConfig, mfc: MFCConfig)` and
    `run(self, model, batch: SequenceSample) -> SequenceSample | dict[str, float] | (SequenceSample, dict)`.
    `model` is the role's Engine; for a model-free MFC it only has `.tokenizer` (the actor's).
    `batch` holds the MFC's inputs under the names it reads (after `input_remap`); it returns its
    declared outputs under the names it writes. Class attribute `spec = MFCSpec(...)` says what it is
    (needs a model, trains, generates, micro-batches, the head its role must have, optimizer steps
    per call: see MFCSpec; none: MFCSpec()); optional `Args` (a pydantic model of its `args:`);
    optional classmethod `check_config(cfg, mfc)` raising ValueError, called when the graph is built."""
    return lambda cls: _register("mfc", name, cls)


def register_reward(name: str) -> Callable:
    """Function decorator: `fn(prompt, completion, prompt_ids, completion_ids, **data) -> float`, or
    an `async def` of the same shape (AReaL's signature). `prompt`/`completion` are text, the ids
    lists of ints, `data` the dataset row: `answer`, `question` and its other fields by their names
    (JSON values: a built-in dataset's `fields`; in sync mode the `generate` MFC reads those it lists
    in its inputs); accept `**data` to ignore the fields you do not use. It runs in a child process with a deadline (`reward.timeout_s`)."""
    return lambda fn: _register("reward", name, fn)


def register_dataset(name: str, keys: tuple[str, ...] | Callable[[Any], tuple[str, ...]]) -> Callable:
    """Function decorator: `fn(cfg: DatasetConfig, tokenizer, *, rank, world, use_chat_template) -> LoadedDataset`
    (see realcore.data.datasets).
    `keys` declares the buffer keys its samples carry (or a function of the DatasetConfig), so the
    graph can check every MFC input has a producer."""

    def deco(fn: Callable) -> Callable:
        fn.dataset_keys = keys
        return _register("dataset", name, fn)

    return deco


def dataset_keys(cfg: Any) -> tuple[str, ...]:
    fn = lookup("dataset", cfg.type)
    keys = fn.dataset_keys
    return tuple(keys(cfg) if callable(keys) else keys)


def register_workflow(name: str, keys: tuple[str, ...] | None = None) -> Callable:
    """Decorator of a rollout workflow: an async function `fn(engine, data, **kwargs)` or a class
    with `async arun_episode(self, engine, data)` (see realcore.api.workflow). `keys`: what its
    trajectories carry; None: `TRAJECTORY_KEYS`. Extra keys must be per token or per sequence."""
    declared = tuple(keys) if keys is not None else TRAJECTORY_KEYS
    missing = [k for k in TRAJECTORY_KEYS if k not in declared]
    if missing or len(set(declared)) != len(declared):
        raise ValueError(f"workflow {name!r}: keys {list(declared)} must hold each of {list(TRAJECTORY_KEYS)} once"
                         f"{f' (missing {missing})' if missing else ''}")

    def deco(obj: Any) -> Any:
        obj.workflow_keys = declared
        return _register("workflow", name, obj)

    return deco


def workflow_keys(name: str) -> tuple[str, ...]:
    return tuple(lookup("workflow", name).workflow_keys)


def make_workflow(name: str, kwargs: dict[str, Any]) -> Callable:
    """The registered workflow as `async episode(engine, data)`."""
    obj = lookup("workflow", name)
    if inspect.isclass(obj):
        return obj(**kwargs).arun_episode
    if not inspect.iscoroutinefunction(obj):
        raise TypeError(f"workflow {name!r} is neither an async function nor a class with arun_episode")
    inspect.signature(obj).bind(None, None, **kwargs)  # a keyword it does not take: TypeError now, not per episode
    return functools.partial(obj, **kwargs)


def register_env(name: str) -> Callable:
    """Class decorator of an environment (realcore.api.workflow.Env: `async reset(data) -> str`,
    `async step(action) -> (observation, reward, done, info)`), made by workflows with
    `lookup("env", name)(**kwargs)`."""
    return lambda cls: _register("env", name, cls)


def register_engine(name: str, *, command: ServerCommand | None = None,
                    available: Availability | None = None) -> Callable:
    """Class decorator of a generation engine's client (realcore.api.generation.GenerationClient,
    with a `capabilities` class attribute), named by `allocation_mode=NAME.dN...+...`.
    `command(spec: ServerSpec) -> (argv, env)` starts one of its servers; None only for an engine
    realcore's own gen_server worker serves (`capabilities.own_worker`). `available(python) -> str |
    None`: why interpreter `python` cannot start it (None: it can). `lookup("engine", name)` gives
    the EngineEntry."""

    def deco(cls: type) -> type:
        caps = getattr(cls, "capabilities", None)
        if not isinstance(caps, Capabilities):
            raise TypeError(f"engine {name!r}: {cls.__name__}.capabilities must be a Capabilities, got {caps!r}")
        if (command is None) != caps.own_worker:
            raise ValueError(f"engine {name!r}: give a server command unless capabilities.own_worker "
                             "(the built-in server's worker serves it)")
        reg = _REGISTRIES["engine"]
        entry = EngineEntry(name, cls, command, available)
        if name in reg and reg[name] != entry:
            raise ValueError(f"engine {name!r} is registered twice ({reg[name].client!r} and {cls!r})")
        reg[name] = entry
        return cls

    return deco


def source_keys(cfg: Any) -> tuple[str, ...]:
    """What feeds the graph: the dataset (sync) or the rollout workers' trajectory stream (async:
    the keys the rollout workflow declares)."""
    return workflow_keys(cfg.rollout.workflow) if cfg.mode == "async" else dataset_keys(cfg.dataset)
