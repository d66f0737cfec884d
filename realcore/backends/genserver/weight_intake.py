"""How new weights reach the built-in generation server's engine thread: from disk (files checked
before they are read), in memory over ZeroMQ, from a trainer's weight-update group (SGLang's
update_weights_from_distributed), and LoRA adapters (SGLang's launch flags and the one loaded at start).

Each arrives as a weights or adapter command (realcore.backends.genserver.commands) queued to the
engine thread (realcore.backends.genserver.engine_loop), which applies it between two decode steps
and keeps the version books. With a `secret`, a ZeroMQ ROUTER thread receives in-memory updates
(realcore.transport.wire: MAC-checked, unauthenticated messages dropped and counted). A
weight-update group (gloo on CPU, NCCL on GPUs: realcore.backends.weight_group) receives bucketed
broadcasts on a worker thread: on the host (gloo) or on the model's GPU (nccl, refused in one line
for a model on the CPU).
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import zmq
from safetensors import SafetensorError

from realcore.backends import lora, safetensors_header, weight_group
from realcore.backends.generation import read_hf_weights
from realcore.backends.genserver.commands import CONTROL_TIMEOUT_S, _Adapter, _Weights
from realcore.backends.genserver.engine_loop import EngineLoop
from realcore.backends.http_schemas import InitWeightsUpdateGroupRequest, UpdateWeightsFromDistributedRequest, one_line
from realcore.transport import wire

WEIGHT_GROUP_TIMEOUT_S = 600.0  # joining the trainer's weight-update group, and each bucket's broadcast


# --- LoRA ---------------------------------------------------------------------------------------


@dataclass
class LoraServing:
    """SGLang's LoRA launch flags (--enable-lora, --max-lora-rank, --lora-target-modules,
    --lora-paths): the bounds an adapter loaded later must keep (None: any), and the adapter loaded
    at start (name, path), if any."""

    max_rank: int | None = None
    target_modules: list[str] | None = None
    initial: tuple[str, str] | None = None

    def check(self, config: dict) -> None:
        if self.max_rank is not None and int(config["r"]) > self.max_rank:
            raise ValueError(f"lora: the adapter's rank {config['r']} is above --max-lora-rank {self.max_rank}")
        targets = config.get("target_modules") or []
        targets = [targets] if isinstance(targets, str) else targets
        if self.target_modules is not None and not set(targets) <= set(self.target_modules):
            raise ValueError(f"lora: the adapter targets {sorted(targets)}, outside --lora-target-modules "
                             f"{sorted(self.target_modules)}")


def load_initial_adapter(core: EngineLoop, serving: LoraServing) -> None:
    """--lora-paths: merge the adapter `serving.initial` before the engine thread starts (ValueError if refused)."""
    name, path = serving.initial
    config, tensors = lora.read_adapter(path)
    serving.check(config)
    failed: list = []
    core._adapter(_Adapter(name, config, tensors, None, lambda r: failed.append(r) if isinstance(r, Exception) else None))
    if failed:
        raise failed[0]


# --- from disk ----------------------------------------------------------------------------------


def read_disk_update(path: str, shapes: dict[str, tuple[int, ...]], params: set[str]) -> dict[str, torch.Tensor]:
    """The tensors of /update_weights_from_disk's `path`; every file's header is checked against the
    model (`shapes`, every name of `params` present) before any tensor is read (ValueError)."""
    safetensors_header.check_dir(path, shapes, params)
    try:
        return read_hf_weights(path)
    except (OSError, SafetensorError) as e:  # changed or unreadable since its header was checked
        raise ValueError(f"weights: {path}: {one_line(e)}") from None


# --- in-memory weight updates over ZeroMQ ---------------------------------------------------------


class WeightsReceiver:
    """A ROUTER socket on its own thread: authenticated {"version", "names"} + one tensor frame per
    name -> a weight update queued to the engine thread; replies {"ok": true} once applied. With
    "abort_all_requests": true the running requests end just before the update (as SGLang's field
    of that name on /update_weights_from_disk), so the server decodes until the tensors are here."""

    def __init__(self, core: EngineLoop, host: str, secret: bytes, limits: wire.Limits | None = None):
        self.core, self.secret = core, secret
        limits = limits or wire.Limits.of()
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        wire.set_max_size(self.sock, limits.max_message_bytes)  # one frame = one weight tensor
        wire.secure(self.sock, secret, server=True, limits=limits, socket="weights")
        self.address = f"tcp://{host}:{self.sock.bind_to_random_port(f'tcp://{host}')}"
        self.endpoint = wire.Endpoint(secret, "gen_server", socket="weights", address=self.address, limits=limits)
        self.dropped = 0  # unauthenticated, unparsable or replayed messages (counted by wire too)
        self.thread = threading.Thread(target=self._run, name="gen_server-weights", daemon=True)

    def _run(self) -> None:
        while not self.core.stopping.is_set():
            try:
                peer, header, tensors = wire.recv(self.sock, endpoint=self.endpoint, router=True, timeout_s=0.1)
            except TimeoutError:
                continue
            except wire.BadMessage:
                self.dropped += 1  # counted and logged (rate-limited) by the endpoint
                continue
            wire.send(self.sock, self._apply(header, tensors), endpoint=self.endpoint, to=peer)
        self.sock.close()

    def _apply(self, header: dict, tensors: list[torch.Tensor]) -> dict:
        names, version = header.get("names"), header.get("version")
        if (not isinstance(names, list) or len(names) != len(tensors) or not all(isinstance(n, str) for n in names)
                or not isinstance(version, str)):
            return {"ok": False, "error": "weights: header needs version (str) and one name (str) per tensor frame"}
        result: concurrent.futures.Future = concurrent.futures.Future()

        def done(value) -> None:  # once: the engine thread may report a failed command a second time
            if not result.done():
                result.set_result(value)

        adapter, abort_all = header.get("lora"), header.get("abort_all_requests", False)
        abort_before = header.get("abort_started_before")
        if not isinstance(abort_all, bool):
            return {"ok": False, "error": "weights: abort_all_requests must be a bool"}
        if abort_before is not None and (type(abort_before) is not int or abort_before < 0):
            return {"ok": False, "error": "weights: abort_started_before must be an int >= 0"}
        try:
            if adapter is not None:  # a LoRA adapter's tensors, loaded as /load_lora_adapter would
                if not isinstance(adapter, dict) or not isinstance(adapter.get("name"), str):
                    return {"ok": False, "error": "weights: lora needs a name (str) and a config"}
                config = lora.check_config(adapter.get("config"))
                self.core.submit(_Adapter(adapter["name"], config, dict(zip(names, tensors)), version, done, abort_all,
                                          abort_before))
            else:
                self.core.submit(_Weights(dict(zip(names, tensors)), version, done, abort_all=abort_all,
                                          abort_before=abort_before))
            outcome = result.result(timeout=CONTROL_TIMEOUT_S)
        except (RuntimeError, TimeoutError, ValueError) as e:
            outcome = e
        if isinstance(outcome, BaseException):
            return {"ok": False, "error": one_line(outcome)}
        return {"ok": True}


# --- weight-update groups (SGLang's update_weights_from_distributed) -------------------------------


def receive_device(backend: str, model_device: torch.device) -> torch.device:
    """Where a bucket of `backend` is received: nccl on the model's GPU (refused, in one line, for a
    model on the CPU), gloo on the CPU. Either way the engine's copy_ moves and casts it into the model."""
    if backend == "nccl":
        if model_device.type != "cuda":
            raise ValueError("backend nccl: this server's model is not on a GPU (use gloo)")
        return model_device
    return torch.device("cpu")


@dataclass
class WeightGroup:
    pg: Any  # ProcessGroupGloo / ProcessGroupNCCL
    store: Any  # the TCPStore client it was built on (kept alive with it)
    device: torch.device
    # One bucket at a time (a cancelled handler's thread runs on); per group, so a receive left
    # waiting in a group the trainer gave up on does not hold up the next group.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        weight_group.close_group(self.pg)


def join_group(body: InitWeightsUpdateGroupRequest, model_device: torch.device, host: str,
               connect_timeout_s: float) -> WeightGroup:
    """Join the trainer's weight-update group as rank `body.rank_offset` (blocking: run it off the
    event loop); `host`: the address gloo's socket binds."""
    device = receive_device(body.backend, model_device)
    if device.type == "cuda":  # this handler's own thread: NCCL binds the group to the current device
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=WEIGHT_GROUP_TIMEOUT_S)
    # It answered wait_listening: connecting takes the connect deadline, the rendezvous the group's.
    store = dist.TCPStore(body.master_address, body.master_port, body.world_size, False,
                          timedelta(seconds=connect_timeout_s))
    store.set_timeout(timeout)
    pg = weight_group.new_group(body.backend, store, body.rank_offset, body.world_size, body.group_name,
                                host=host, timeout=timeout)
    return WeightGroup(pg, store, device)


def check_bucket(body: UpdateWeightsFromDistributedRequest, shapes: dict[str, tuple[int, ...]]) -> None:
    """Checked before receiving (the trainer stops at the first refusal): this also bounds what
    the receive allocates to the model's own sizes."""
    wrong = [n for n, shape in zip(body.names, body.shapes) if shapes.get(n) != tuple(shape)]
    if wrong:
        raise ValueError(f"weights: {len(wrong)} unknown or wrongly shaped parameter(s), e.g. {wrong[:3]}")


def receive_bucket(group: WeightGroup, body: UpdateWeightsFromDistributedRequest) -> list[torch.Tensor]:
    """One bucket broadcast by the trainer (rank 0), blocking: run it off the event loop."""
    if group.device.type == "cuda":
        torch.cuda.set_device(group.device)
    with group.lock:
        return weight_group.receive(group.pg, body.dtypes, body.shapes, group.device,
                                    timedelta(seconds=WEIGHT_GROUP_TIMEOUT_S))
