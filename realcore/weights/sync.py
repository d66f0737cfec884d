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
"""

from __future__ import annotations

import logging
import os
import shutil
import time

from realcore.transport import addresses
from realcore.transport.name_resolve import make_name_resolver
from realcore.transport.protocol import BroadcastWeights, Pause, PublishWeights, UpdateWeights

log = logging.getLogger("realcore.weight_sync")
RETRY_PUSH_S = 30.0  # a catch-up push the manager still reports as missing after this is sent again


def server_addresses(cfg, n_servers: int, kind: str, *, timeout_s: float | None = None) -> list[str]:
    """Every generation server's `http` or in-memory `weights` address, as it published them;
    with `timeout_s`, waiting up to that long for servers that are still starting."""
    resolver = make_name_resolver(cfg.system.name_resolve)
    return [getattr(addresses.read_gen_server(resolver, cfg, i, timeout_s=timeout_s), kind) for i in range(n_servers)]


class DiskWeights:
    def __init__(self, master):
        self.m = master
        self.path: str | None = None  # the current version's folder (a restarted server loads it)

    def publish(self, version: int):
        m = self.m
        path = os.path.join(m.cfg.output_dir, "weights", f"v{version}")
        reply = None
        if m.async_mode:
            m.call_all(PublishWeights(version, path=path), "publish weights")
            reply = m.call_manager(UpdateWeights(version, path=path), "update weights")
        else:  # no manager: the trainer's rank 0 tells the idle servers
            http = server_addresses(m.cfg, m.alloc.gen.dp, "http")
            m.call_all(PublishWeights(version, path=path, http=http), "publish weights")
        self.path = path
        shutil.rmtree(os.path.join(m.cfg.output_dir, "weights", f"v{version - 2}"), ignore_errors=True)
        return reply

    def catch_up(self, servers: list[int]) -> None:
        """Nothing to do: the manager loads `path` into a restarted server itself."""


class MemoryWeights:
    ADDRESS = "weights"  # which of a server's published addresses the trainer sends to
    # A built-in server ends its requests as a push lands (abort_all_requests): no pause before it.
    PAUSE_FIRST = False

    def __init__(self, master):
        self.m = master
        self.pushed: dict[str, tuple[int, float]] = {}  # server -> (version, when) of the last catch-up push

    def message(self, version: int, servers: list[str]):
        return PublishWeights(version, servers=servers)

    def push(self, version: int, servers: list[str]) -> None:
        replies = self.m.call_all(self.message(version, servers), "push weights")
        failed = {a for r in replies.values() for a in r.failed}
        if failed:  # servers that died: each is caught up after its restart (manager: "behind")
            log.warning("weights v%d did not reach %s", version, ", ".join(sorted(failed)))

    def publish(self, version: int):
        m = self.m
        servers = server_addresses(m.cfg, m.alloc.gen.dp, self.ADDRESS)
        if not m.async_mode:
            self.push(version, servers)
            return None
        if self.PAUSE_FIRST:
            m.call_manager(Pause(), "pause")
        self.push(version, servers)
        return m.call_manager(UpdateWeights(version), "update weights")

    def catch_up(self, servers: list[int]) -> None:
        """Push the current weights to servers that restarted (only the trainer holds them); once
        per server and version, again only if the manager still lists it after a while."""
        m, now = self.m, time.monotonic()
        addresses = server_addresses(m.cfg, m.alloc.gen.dp, self.ADDRESS)
        todo = [a for a in (addresses[i] for i in servers)
                if self.pushed.get(a, (-1, 0.0))[0] != m.version or now - self.pushed[a][1] > RETRY_PUSH_S]
        if todo:
            self.push(m.version, todo)
            self.pushed.update({a: (m.version, now) for a in todo})


class CollectiveWeights(MemoryWeights):
    """nccl: as memory, but rank 0 broadcasts to the servers' http addresses over its weight-update
    group. A catch-up names only the servers that restarted: rank 0 builds a group of those, and the
    next update a group of all again (realcore.weights.broadcast)."""

    ADDRESS = "http"
    PAUSE_FIRST = True  # paused before the broadcast: abort, or hold in flight (the manager's pause)

    def message(self, version: int, servers: list[str]):
        return BroadcastWeights(version, servers)


def make_weight_sync(master):
    kind = master.cfg.rollout.weight_update
    return {"memory": MemoryWeights, "nccl": CollectiveWeights}.get(kind, DiskWeights)(master)
