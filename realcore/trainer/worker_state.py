"""A model worker's part of a recover checkpoint, saved and loaded by the same code.

Under the checkpoint folder, model worker I writes `model_worker-I/`: `worker.json` (WorkerState:
its dataset position in sync mode, the names and sizes of the trajectory groups waiting in its
stream in async mode), `stream.safetensors` (those groups' tensors) and one folder per trainable
role with the engine's own state (`Engine.save_state`). A Megatron role is saved collectively by
all ranks of its mesh into one shared folder, `megatron-ROLE/`, through megatron-core's own
distributed checkpointing.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from safetensors.torch import load_file, save_file

from realcore.transport.stream import Group


@dataclass
class WorkerState:
    sampler_seq: int | None = None  # sync mode, replica heads: samples handed out by this shard
    stream_uids: list[str] = field(default_factory=list)  # async mode, heads: groups waiting, in order
    stream_grants: list[int] = field(default_factory=list)  # the admission of each
    stream_sizes: list[int] = field(default_factory=list)  # sequences per group


def _folder(path: str, index: int) -> str:
    return os.path.join(path, f"model_worker-{index}")


def _role_folder(worker, path: str, role: str) -> str:
    if worker.cfg.roles()[role].backend == "megatron":
        return os.path.join(path, f"megatron-{role}")
    return os.path.join(_folder(path, worker.index), role)


def save(worker, path: str) -> None:
    mine = _folder(path, worker.index)
    os.makedirs(mine)
    state = WorkerState()
    if getattr(worker, "sampler", None) is not None:
        state.sampler_seq = worker.sampler.seq
    if worker.stream is not None:
        groups = worker.stream.snapshot()
        tensors = {f"{i}/{key}/{j}": t.contiguous() for i, g in enumerate(groups)
                   for key in worker.stream.keys for j, t in enumerate(g.sample[key])}
        save_file(tensors, os.path.join(mine, "stream.safetensors"))
        state.stream_uids = [g.uid for g in groups]
        state.stream_grants = [g.grant for g in groups]
        state.stream_sizes = [len(g.sample["input_ids"]) for g in groups]
    with open(os.path.join(mine, "worker.json"), "w") as f:
        json.dump(asdict(state), f)
    for role, engine in worker.engines.items():
        if worker.cfg.roles()[role].trainable:
            folder = _role_folder(worker, path, role)
            os.makedirs(folder, exist_ok=True)  # a Megatron folder is shared by the mesh's ranks
            engine.save_state(folder)


def load(worker, path: str) -> None:
    mine = _folder(path, worker.index)
    if not os.path.isdir(mine):
        raise ValueError(f"recover checkpoint {path} has no state for model worker {worker.index}")
    with open(os.path.join(mine, "worker.json")) as f:
        state = WorkerState(**json.load(f))
    if state.sampler_seq is not None:
        worker.sampler.seq = state.sampler_seq
    if worker.stream is not None and state.stream_uids:
        tensors = load_file(os.path.join(mine, "stream.safetensors"))
        groups = [Group(uid, grant, {key: [tensors[f"{i}/{key}/{j}"] for j in range(n)] for key in worker.stream.keys})
                  for i, (uid, grant, n) in enumerate(zip(state.stream_uids, state.stream_grants, state.stream_sizes))]
        worker.stream.restore(groups)
    for role, engine in worker.engines.items():
        if worker.cfg.roles()[role].trainable:
            engine.load_state(_role_folder(worker, path, role))
