"""How new weights reach the generation servers after a training step: as an HF folder the servers
load (disk: what SGLang and vLLM read), as tensors pushed over the authenticated wire to the
built-in servers' update sockets (memory), or broadcast by trainer rank 0 over a weight-update
group, NCCL on GPUs and gloo on CPU (nccl: SGLang's /update_weights_from_distributed, which the
built-in server speaks too; docs/weight-update.md). With a gserver manager (async mode) the
running requests are interrupted (abort: they return their output so far and are resubmitted):
a built-in server decodes until the new weights are read or received, then aborts and swaps in
one step (`abort_all_requests`), or, with rollout.inflight_weight_update, swaps under the running
requests and ends only those too stale to be trained; SGLang and vLLM servers are paused, updated
and continued by the manager. Without a manager (sync mode) the servers are idle and rank 0 of the trainer tells them.

None keeps recovery state: after a restart the master publishes the current version again
before any rollout starts (the servers restarted with the initial weights).

A plan sees only the ports the master hands it (WeightPorts): call every model worker, call the
gserver manager, look up the servers' addresses; never the master itself.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from realcore.transport import addresses
from realcore.transport.name_resolve import make_name_resolver
from realcore.transport.protocol import BroadcastWeights, Pause, PublishWeights, UpdateWeights

log = logging.getLogger("realcore.weight_sync")
RETRY_PUSH_S = 30.0  # a catch-up push the manager still reports as missing after this is sent again


# A typed request (transport.protocol) to every model worker of the trainer: their replies, by worker.
WorkerCalls = Callable[[Any, str], dict[str, Any]]
# A typed request to the gserver manager (surviving its restart): its reply.
ManagerCalls = Callable[[Any, str], Any]
# Every generation server's published `http` or in-memory `weights` address, in server order.
ServerAddresses = Callable[[str], list[str]]


@dataclass(frozen=True)
class WeightPorts:
    """What a weight plan may do, handed in by the master."""

    call_workers: WorkerCalls
    call_manager: ManagerCalls | None  # None: no manager (sync mode): the trainer's rank 0 tells the idle servers
    server_addresses: ServerAddresses
    weights_dir: str  # where each version's HF folder goes (disk): output_dir/weights


def server_addresses(cfg, n_servers: int, kind: str, *, timeout_s: float | None = None) -> list[str]:
    """Every generation server's `http` or in-memory `weights` address, as it published them;
    with `timeout_s`, waiting up to that long for servers that are still starting."""
    resolver = make_name_resolver(cfg.system.name_resolve)
    return [getattr(addresses.read_gen_server(resolver, cfg, i, timeout_s=timeout_s), kind) for i in range(n_servers)]


class DiskWeights:
    def __init__(self, ports: WeightPorts):
        self.ports = ports
        self.path: str | None = None  # the current version's folder (a restarted server loads it)

    def publish(self, version: int):
        p = self.ports
        path = os.path.join(p.weights_dir, f"v{version}")
        reply = None
        if p.call_manager is not None:
            p.call_workers(PublishWeights(version, path=path), "publish weights")
            reply = p.call_manager(UpdateWeights(version, path=path), "update weights")
        else:  # no manager: the trainer's rank 0 tells the idle servers
            p.call_workers(PublishWeights(version, path=path, http=p.server_addresses("http")), "publish weights")
        self.path = path
        shutil.rmtree(os.path.join(p.weights_dir, f"v{version - 2}"), ignore_errors=True)
        return reply

    def catch_up(self, servers: list[int], version: int) -> None:
        """Nothing to do: the manager loads `path` into a restarted server itself."""


class MemoryWeights:
    ADDRESS = "weights"  # which of a server's published addresses the trainer sends to
    # A built-in server ends its requests as a push lands (abort_all_requests): no pause before it.
    PAUSE_FIRST = False

    def __init__(self, ports: WeightPorts):
        self.ports = ports
        self.pushed: dict[str, tuple[int, float]] = {}  # server -> (version, when) of the last catch-up push

    def message(self, version: int, servers: list[str]):
        return PublishWeights(version, servers=servers)

    def push(self, version: int, servers: list[str]) -> None:
        replies = self.ports.call_workers(self.message(version, servers), "push weights")
        failed = {a for r in replies.values() for a in r.failed}
        if failed:  # servers that died: each is caught up after its restart (manager: "behind")
            log.warning("weights v%d did not reach %s", version, ", ".join(sorted(failed)))

    def publish(self, version: int):
        p = self.ports
        servers = p.server_addresses(self.ADDRESS)
        if p.call_manager is None:
            self.push(version, servers)
            return None
        if self.PAUSE_FIRST:
            p.call_manager(Pause(), "pause")
        self.push(version, servers)
        return p.call_manager(UpdateWeights(version), "update weights")

    def catch_up(self, servers: list[int], version: int) -> None:
        """Push the current weights (`version`) to servers that restarted (only the trainer holds
        them); once per server and version, again only if the manager still lists it after a while."""
        now = time.monotonic()
        addresses = self.ports.server_addresses(self.ADDRESS)
        todo = [a for a in (addresses[i] for i in servers)
                if self.pushed.get(a, (-1, 0.0))[0] != version or now - self.pushed[a][1] > RETRY_PUSH_S]
        if todo:
            self.push(version, todo)
            self.pushed.update({a: (version, now) for a in todo})


class CollectiveWeights(MemoryWeights):
    """nccl: as memory, but rank 0 broadcasts to the servers' http addresses over its weight-update
    group. A catch-up names only the servers that restarted: rank 0 builds a group of those, and the
    next update a group of all again (realcore.weights.broadcast)."""

    ADDRESS = "http"
    PAUSE_FIRST = True  # paused before the broadcast: abort, or hold in flight (the manager's pause)

    def message(self, version: int, servers: list[str]):
        return BroadcastWeights(version, servers)


def make_weight_sync(weight_update: str, ports: WeightPorts):
    """The plan for rollout.weight_update (`weight_update`): disk, memory or nccl."""
    return {"memory": MemoryWeights, "nccl": CollectiveWeights}.get(weight_update, DiskWeights)(ports)
