"""What each process of a run publishes in the name store, typed: one dataclass per kind of
process, and one pair of functions per kind, to publish it and to read it (under keys.py's keys).

    model worker i     ModelWorkerAddress(control, data, pid, stream)   publish_model_worker / read_model_worker
    gserver manager    ManagerAddress(control, pid)                     publish_manager / read_manager
    generation server  GenServerAddress(http, weights)                  publish_gen_server / read_gen_server(s)

A value is a JSON object of the dataclass's fields (tools and tests read it as such), MAC'd by the
resolver. The training mesh's rendezvous address (keys.dist_init) is a plain "tcp://host:port" of
rendezvous.py's own. The master, the rollout workers and the launcher publish nothing.

A restarted process publishes again under the same key (replace=True): `manager_moved` is how the
master and the rollout workers notice a restarted manager and follow it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from realcore.api.config import ExperimentConfig
from realcore.transport import keys


@dataclass(frozen=True)
class ModelWorkerAddress:
    control: str  # its ControlServer (the master's requests)
    data: str  # its DataServer (other workers fetch its samples' tensors)
    pid: int
    stream: str | None = None  # its TrajectoryStream: a data-parallel head in async mode, else None

    OMIT_NONE: ClassVar[tuple[str, ...]] = ("stream",)  # left out of the JSON when None


@dataclass(frozen=True)
class ManagerAddress:
    control: str  # its ControlServer (the master's and the rollout workers' requests)
    pid: int | None = None

    OMIT_NONE: ClassVar[tuple[str, ...]] = ()


@dataclass(frozen=True)
class GenServerAddress:
    http: str  # "http://host:port"
    weights: str | None = None  # the built-in server's in-memory weight-update socket, or None (null in the JSON)

    OMIT_NONE: ClassVar[tuple[str, ...]] = ()


Address = TypeVar("Address", ModelWorkerAddress, ManagerAddress, GenServerAddress)


def to_json(address: ModelWorkerAddress | ManagerAddress | GenServerAddress) -> str:
    return json.dumps({k: v for k, v in dataclasses.asdict(address).items()
                       if not (v is None and k in address.OMIT_NONE)})


def from_json(kind: type[Address], value: str, key: str = "") -> Address:
    """`value` (published under `key`) as a `kind`; ValueError if it is not one."""
    try:
        fields = json.loads(value)
        names = {f.name for f in dataclasses.fields(kind)}
        return kind(**{k: v for k, v in fields.items() if k in names})
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{key or kind.__name__}: the published {value!r:.200} is not a {kind.__name__}: {e}") from None


def _read(resolver, key: str, kind: type[Address], timeout_s: float | None) -> Address:
    """Read `key` now (KeyError if nothing is published), or wait up to `timeout_s` for it."""
    value = resolver.get(key) if timeout_s is None else resolver.wait(key, timeout_s=timeout_s)
    return from_json(kind, value, key)


# --- model workers ---


def publish_model_worker(resolver, cfg: ExperimentConfig, index: int, address: ModelWorkerAddress) -> None:
    resolver.put(keys.model_worker(cfg, index), to_json(address), replace=True)


def read_model_worker(resolver, cfg: ExperimentConfig, index: int, *, timeout_s: float | None = None) -> ModelWorkerAddress:
    return _read(resolver, keys.model_worker(cfg, index), ModelWorkerAddress, timeout_s)


# --- the gserver manager ---


def publish_manager(resolver, cfg: ExperimentConfig, address: ManagerAddress) -> None:
    resolver.put(keys.manager(cfg), to_json(address), replace=True)


def read_manager(resolver, cfg: ExperimentConfig, *, timeout_s: float | None = None) -> ManagerAddress:
    return _read(resolver, keys.manager(cfg), ManagerAddress, timeout_s)


def manager_moved(resolver, cfg: ExperimentConfig, current: str | None) -> str | None:
    """The manager's control address if it differs from `current` (the one its caller talks to):
    a restarted manager has published a new one. None while it is the same, or nothing is
    published. Cheap enough to call every heartbeat interval while waiting on a silent manager:
    a dead one never answers, and its successor should be reached within that interval, not
    after the heartbeat deadline."""
    try:
        address = read_manager(resolver, cfg).control
    except KeyError:
        return None
    return None if address == current else address


# --- generation servers ---


def publish_gen_server(resolver, cfg: ExperimentConfig, index: int, address: GenServerAddress) -> None:
    resolver.put(keys.gen_server(cfg, index), to_json(address), replace=True)


def read_gen_server(resolver, cfg: ExperimentConfig, index: int, *, timeout_s: float | None = None) -> GenServerAddress:
    return _read(resolver, keys.gen_server(cfg, index), GenServerAddress, timeout_s)


def read_gen_servers(resolver, cfg: ExperimentConfig) -> dict[int, GenServerAddress]:
    """Every generation server published so far, by index."""
    return {int(key.rsplit("/", 1)[1]): from_json(GenServerAddress, value, key)
            for key, value in resolver.find(keys.gen_servers(cfg)).items()}
