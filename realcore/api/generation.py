"""The generation-client contract: what the manager, the rollout workers, the weight senders and
the model workers call on a client of one generation server, the capabilities record each engine's
client carries, and what an engine's server command is given.

An engine is registered with `realcore.api.registry.register_engine` (its client class, which
carries `capabilities`, and the command that starts its server); validation, the manager and the
rollout workers read the capabilities, never the engine's name (docs/engines.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Protocol

WEIGHT_UPDATES = ("disk", "memory", "nccl")  # rollout.weight_update's values


@dataclass(frozen=True)
class Capabilities:
    """What an engine's servers can do, as the run's checks and workers need to know it."""

    # rollout.weight_update methods the servers take: "disk" (HF safetensors they load), "memory"
    # (tensors over the run's wire, `push_weights`), "nccl" (a weight-update group, SGLang's
    # /init_weights_update_group + /update_weights_from_distributed, NCCL or gloo).
    weight_updates: frozenset[str] = frozenset({"disk"})
    # Replies carry the weight version that sampled them. False: the client stamps each reply with
    # the version it was told (`assume_version`), and the rollout worker tells it.
    reports_versions: bool = True
    lora: bool = False  # serves actor.lora's adapter
    names_adapter: bool = False  # a LoRA run's requests name the adapter (SGLang's lora_path); else merged
    # Takes new weights while it decodes (`abort_all_requests` / `abort_started_before`), no pause:
    # rollout.inflight_weight_update, and the disk update without an idle load.
    inflight_weight_update: bool = False
    reports_drops: bool = False  # server_info() holds "drops" (socket/reason -> n), summed for the master
    # The server is realcore's own gen_server worker (the built-in server: data parallel only, one
    # GPU or none, watched by heartbeat); False: the engine's command starts it on tp*pp GPUs.
    own_worker: bool = False

    def __post_init__(self):
        unknown = set(self.weight_updates) - set(WEIGHT_UPDATES)
        if unknown or "disk" not in self.weight_updates:
            raise ValueError(f"Capabilities.weight_updates: {sorted(self.weight_updates)} must hold 'disk' and only "
                             f"{list(WEIGHT_UPDATES)}")


@dataclass(frozen=True)
class ServerSpec:
    """What an engine's server command is given: one server of the run."""

    model_path: str
    host: str
    port: int
    tp: int
    pp: int
    seed: int
    max_batch_size: int
    cuda: bool  # the server has GPUs (the plan's, not the launcher's own torch)
    api_key: str | None  # the bearer token it must require; keep it off the command line
    private_dir: str | None  # a mode-0700 folder for files that hold secrets (a key file)
    python: str | None  # rollout.server_python; None: realcore's own interpreter
    lora: Any = None  # actor.lora (a LoraConfig) or None
    mem_fraction: float | None = None  # on GPUs: the share of each GPU it takes (None: the engine's default)
    dtype: str = "auto"  # generation.dtype
    write_files: bool = True  # False (a dry run): files are named on the command line, not written


# (argv, env on top of the caller's environment) that start one server.
ServerCommand = Callable[[ServerSpec], "tuple[list[str], dict[str, str]]"]
# None if the engine's server can be started by interpreter `python` (None: this one), else why not.
Availability = Callable[["str | None"], "str | None"]


class GenerationClient(Protocol):
    """One server, from one event loop. Errors: TimeoutError for a missed deadline, RuntimeError
    for an HTTP error or an answer that breaks the API, ValueError for bad arguments. Replies are
    `realcore.backends.clients.sglang_api.GenReply`s (token ids, log-probs, finish reason
    stop|length|abort, weight version). Weight calls an engine does not take (its capabilities say
    which) may raise."""

    capabilities: ClassVar[Capabilities]

    def __init__(self, base_url: str, *, token: str | None = None, timeout_s: float = 600.0,
                 lora: bool = False) -> None: ...

    async def generate(self, input_ids: list[int], sampling_params: dict, *, rid: str,
                       return_logprob: bool = True) -> Any: ...

    async def abort(self, rid: str | None = None) -> None: ...

    async def pause(self, mode: str = "abort") -> None: ...

    async def resume(self) -> None: ...

    async def update_weights_from_disk(self, path: str, version, **abort) -> None: ...

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None: ...

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, version=None, flush_cache: bool = True,
                                              **abort) -> None: ...

    async def begin_weight_update(self) -> None: ...

    async def end_weight_update(self) -> None: ...

    async def destroy_weights_update_group(self, group_name: str) -> None: ...

    async def weight_version(self) -> Any: ...

    def assume_version(self, version: int) -> None:
        """Only where `capabilities.reports_versions` is False: the server runs `version` or newer."""

    async def server_info(self) -> dict: ...

    async def health(self, timeout_s: float = ...) -> bool: ...

    async def wait_ready(self, timeout_s: float) -> None: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class EngineEntry:
    """A registered generation engine: its client class and how its server starts."""

    name: str
    client: type  # a GenerationClient with `capabilities`
    command: ServerCommand | None  # None: realcore's own gen_server worker serves it (capabilities.own_worker)
    available: Availability | None = None  # None: always startable

    @property
    def capabilities(self) -> Capabilities:
        return self.client.capabilities
