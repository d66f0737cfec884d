"""A model worker's part of a recover checkpoint, saved and loaded by the same code.

Under the checkpoint folder, model worker I writes `model_worker-I/`: `worker.json` (WorkerState:
its dataset position in sync mode, the names and sizes of the trajectory groups waiting in its
stream in async mode), `stream.safetensors` (those groups' tensors) and one folder per trainable
role with the engine's own state (`Engine.save_state`). A Megatron role is saved collectively by
all ranks of its mesh into one shared folder, `megatron-ROLE/`, through megatron-core's own
distributed checkpointing.

The worker hands in only what is saved (StateParts), never itself.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from safetensors.torch import load_file, save_file

from realcore.data.sampler import EpochSampler
from realcore.transport.stream import Group, TrajectoryStream


@dataclass
class WorkerState:
    sampler_seq: int | None = None  # sync mode, replica heads: samples handed out by this shard
    stream_uids: list[str] = field(default_factory=list)  # async mode, heads: groups waiting, in order
    stream_grants: list[int] = field(default_factory=list)  # the admission of each
    stream_sizes: list[int] = field(default_factory=list)  # sequences per group


@dataclass
class StateParts:
    """What model worker `index` saves and loads, handed in by it."""

    index: int
    engines: dict  # trainable role -> its engine (Engine.save_state, load_state), in role order
    collective: set[str]  # roles whose mesh saves into one shared folder (Megatron)
    sampler: EpochSampler | None = None  # sync mode, replica heads: the dataset position
    stream: TrajectoryStream | None = None  # async mode, heads: the trajectory groups waiting


def _folder(path: str, index: int) -> str:
    return os.path.join(path, f"model_worker-{index}")


def _role_folder(parts: StateParts, path: str, role: str) -> str:
    if role in parts.collective:
        return os.path.join(path, f"megatron-{role}")
    return os.path.join(_folder(path, parts.index), role)


def save(parts: StateParts, path: str) -> None:
    mine = _folder(path, parts.index)
    os.makedirs(mine)
    state = WorkerState()
    if parts.sampler is not None:
        state.sampler_seq = parts.sampler.seq
    if parts.stream is not None:
        groups = parts.stream.snapshot()
        tensors = {f"{i}/{key}/{j}": t.contiguous() for i, g in enumerate(groups)
                   for key in parts.stream.keys for j, t in enumerate(g.sample[key])}
        save_file(tensors, os.path.join(mine, "stream.safetensors"))
        state.stream_uids = [g.uid for g in groups]
        state.stream_grants = [g.grant for g in groups]
        state.stream_sizes = [len(g.sample["input_ids"]) for g in groups]
    with open(os.path.join(mine, "worker.json"), "w") as f:
        json.dump(asdict(state), f)
    for role, engine in parts.engines.items():
        folder = _role_folder(parts, path, role)
        os.makedirs(folder, exist_ok=True)  # a Megatron folder is shared by the mesh's ranks
        engine.save_state(folder)


def load(parts: StateParts, path: str) -> None:
    mine = _folder(path, parts.index)
    if not os.path.isdir(mine):
        raise ValueError(f"recover checkpoint {path} has no state for model worker {parts.index}")
    with open(os.path.join(mine, "worker.json")) as f:
        state = WorkerState(**json.load(f))
    if state.sampler_seq is not None:
        parts.sampler.seq = state.sampler_seq
    stream = parts.stream
    if stream is not None and state.stream_uids:
        tensors = load_file(os.path.join(mine, "stream.safetensors"))
        groups = [Group(uid, grant, {key: [tensors[f"{i}/{key}/{j}"] for j in range(n)] for key in stream.keys})
                  for i, (uid, grant, n) in enumerate(zip(state.stream_uids, state.stream_grants, state.stream_sizes))]
        stream.restore(groups)
    for role, engine in parts.engines.items():
        engine.load_state(_role_folder(parts, path, role))
