"""The trainer's side of rollout.weight_update=nccl: rank 0 of the training mesh owns a
weight-update group with the generation servers and broadcasts each new version into it, bucket
by bucket (realcore.backends.weight_group holds the protocol; the servers speak SGLang's HTTP API).

The group's members are a set of servers. A call for a different set (a server restarted at a new
address, or a catch-up of only the servers that restarted) tears the group down and builds a new
one, under a new name, from the servers that answer /health: NCCL and gloo groups cannot add or
drop a member. A failed broadcast drops the group and is tried once more in a new group (a member
that died fails /health and is left out). Servers it did not update keep their old version, and
the gserver manager lists them as behind.

Every wait has a deadline: the rendezvous `system.startup_timeout_s`, HTTP calls
`rollout.request_timeout_s`, each bucket's broadcast `system.request_timeout_s`. The group's own
timeout (NCCL's watchdog) is the longer of the two, so it never ends a bucket its caller still
waits for; a timed-out NCCL broadcast raises here (weight_group.nccl_errors_raise) and drops the group.

The tensors travel in the servers' dtype (their /get_server_info "dtype": the built-in server's
weights, SGLang's --dtype), cast on the trainer's device before the broadcast: a bf16 server gets
bf16, half the bytes of the trainer's float32. A server that reports none (or "auto") gets the
trainer's own dtype.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from datetime import timedelta

import torch

from realcore.backends import weight_group
from realcore.backends.clients.registry import client_for
from realcore.transport.rendezvous import serve_store

log = logging.getLogger("realcore.weight_broadcast")
HEALTH_TIMEOUT_S = 5.0
JOIN_ATTEMPTS = 2  # a second one without the servers whose join failed


async def _all_or_first_failure(aws: list, timeout_s: float) -> list:
    """Await `aws` together: their results, or the first exception at once (the rest cancelled): a
    peer that refused a collective leaves the others waiting for it until their deadlines."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    done, pending = await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
    for t in pending:
        t.cancel()
    failed = [t.exception() for t in done if t.exception() is not None]
    if failed:
        raise failed[0]
    if pending:
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    return [t.result() for t in tasks]


class WeightSender:
    def __init__(self, cfg, *, engine: str, tp: int):
        self.engine, self.tp = engine, tp  # tp: ranks per server (rank_offset of server k = 1 + k * tp)
        self.host = cfg.system.host
        self.token, self.http_timeout_s = cfg.rollout.server_token, cfg.rollout.request_timeout_s
        self.join_timeout = timedelta(seconds=cfg.system.startup_timeout_s)
        self.timeout = timedelta(seconds=cfg.system.request_timeout_s)
        self.group_timeout = max(self.join_timeout, self.timeout)  # never shorter than a bucket's wait
        self.bucket_bytes = max(1, int(cfg.rollout.weight_bucket_mb * 2**20))
        self.backend = weight_group.default_backend()  # new_group binds gloo to self.host
        self.device = weight_group.device_of(self.backend)
        self.members: tuple[str, ...] = ()
        self.group = None
        self._store = None  # the group's TCPStore: it lives as long as the group
        self.group_name = ""
        self.dtype: torch.dtype | None = None  # the members' weights (None: send the trainer's dtype)
        self.n_groups = 0
        self.tag = f"{os.getpid()}-{secrets.token_hex(3)}"  # group names are unique per process and sender
        self.stats: dict[str, float] = {}  # of the last send: seconds to (re)build the group, to broadcast

    def send(self, state: dict[str, torch.Tensor], version: int, servers: list[str], *,
             abort_started_before: int | None = None) -> list[str]:
        """Broadcast `state` to `servers` (http addresses) as `version`; the servers not updated.
        `abort_started_before` goes with the last bucket (built-in servers, in-flight updates)."""
        return asyncio.run(self._send(state, version, list(servers), abort_started_before))

    async def _send(self, state, version: int, servers: list[str], abort_started_before: int | None) -> list[str]:
        # The current members too: a group they leave is destroyed on them.
        clients = {u: client_for(self.engine, u, token=self.token, timeout_s=self.http_timeout_s)
                   for u in dict.fromkeys([*servers, *self.members])}
        try:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            updated: list[str] = []
            join_s = 0.0
            for _ in range(2):  # once more after a failure: a new group, without the servers that died
                t1 = loop.time()
                if self.group is None or self.members != tuple(servers):
                    await self._rebuild(clients, servers)
                join_s += loop.time() - t1
                if self.group is None:
                    break
                updated = await self._broadcast(clients, state, version, abort_started_before)
                if updated:
                    break
            self.stats = {"join_s": join_s, "broadcast_s": loop.time() - t0 - join_s}
            return [u for u in servers if u not in updated]
        finally:
            await asyncio.gather(*(c.close() for c in clients.values()), return_exceptions=True)

    async def _rebuild(self, clients: dict, servers: list[str]) -> None:
        await self._drop(clients)
        health = await asyncio.gather(*(clients[u].health(timeout_s=HEALTH_TIMEOUT_S) for u in servers))
        live = [u for u, ok in zip(servers, health) if ok]
        for _ in range(JOIN_ATTEMPTS):
            if not live:
                return
            joined = await self._join({u: clients[u] for u in live})
            if joined == live:
                return
            live = joined  # the join failed everywhere: try once more without those that refused it
        log.warning("weight-update group: no group formed with %s", ", ".join(live))

    async def _drop(self, clients: dict) -> None:
        """Forget the current group, here and (best effort, briefly) on its members."""
        if self.group is None:
            return
        old, name, members = self.group, self.group_name, [clients[u] for u in self.members]
        self.group, self._store, self.members = None, None, ()
        weight_group.close_group(old)
        if members:
            await asyncio.gather(*(asyncio.wait_for(c.destroy_weights_update_group(name), HEALTH_TIMEOUT_S)
                                   for c in members), return_exceptions=True)

    async def _join(self, clients: dict) -> list[str]:
        """Build a group of rank 0 + `clients`: all of them when it formed, else those that did not
        refuse (for a second attempt without the others)."""
        self.n_groups += 1
        name = f"realcore-weights-{self.tag}-{self.n_groups}"
        world = 1 + self.tp * len(clients)
        store = serve_store(self.host, world, self.join_timeout)
        refused: dict[str, BaseException] = {}

        async def init(k: int, url: str) -> None:
            try:
                await clients[url].init_weights_update_group(self.host, store.port, 1 + k * self.tp, world, name,
                                                             self.backend)
            except Exception as e:
                refused[url] = e
                raise

        own = weight_group.in_thread(weight_group.new_group, self.backend, store, 0, world, name, host=self.host,
                                     timeout=self.group_timeout)
        try:
            group, *_ = await _all_or_first_failure([own, *(init(k, u) for k, u in enumerate(clients))],
                                                    self.join_timeout.total_seconds())
        except Exception as e:
            for u, why in refused.items():
                log.warning("weight-update group %s: %s did not join: %s", name, u, why)
            if not refused:
                log.warning("weight-update group %s did not form: %s", name, e)
            return [u for u in clients if u not in refused]
        self.group, self._store, self.group_name, self.members = group, store, name, tuple(clients)
        self.dtype = await _servers_dtype(clients)
        log.info("weight-update group %s: %d servers, %s, in %s", name, len(clients), self.backend,
                 weight_group.dtype_name(self.dtype) if self.dtype is not None else "the trainer's dtype")
        return list(clients)

    async def _broadcast(self, clients: dict, state: dict[str, torch.Tensor], version: int,
                         abort_started_before: int | None = None) -> list[str]:
        """Every bucket to every member; the version goes with the last. On any failure the
        update stops and the group is dropped: the servers then hold a partial update under their
        old version, and are caught up (the manager lists them as behind)."""
        members = {u: clients[u] for u in self.members}
        order = weight_group.buckets(state, self.bucket_bytes)
        try:  # SGLang takes buckets only inside a weight-update session
            await _all_or_first_failure([_begin_session(c) for c in members.values()], self.timeout.total_seconds())
        except Exception as e:
            log.warning("weight-update group %s: begin_weight_update failed (%s); dropping the group", self.group_name, e)
            await self._fail(clients, members)
            return []
        for i, names in enumerate(order):
            tensors = [wire_tensor(state[n], self.device, self.dtype) for n in names]
            dtypes = [weight_group.dtype_name(t.dtype) for t in tensors]
            shapes = [list(t.shape) for t in tensors]
            last = i == len(order) - 1
            calls = [c.update_weights_from_distributed(names, dtypes, shapes, self.group_name, version if last else None,
                                                       abort_started_before=abort_started_before if last else None)
                     for c in members.values()]
            try:
                await _all_or_first_failure([weight_group.in_thread(weight_group.send, self.group, tensors, self.timeout), *calls],
                                            self.timeout.total_seconds())
            except Exception as e:
                log.warning("weight-update group %s: bucket %d of version %d failed (%s); dropping the group",
                            self.group_name, i, version, e)
                await self._fail(clients, members)
                return []
        ended = await asyncio.gather(*(asyncio.wait_for(c.end_weight_update(), self.timeout.total_seconds())
                                       for c in members.values()), return_exceptions=True)
        for u, r in zip(members, ended):
            if isinstance(r, BaseException):  # the weights are in; the next begin closes the session first
                log.warning("weight-update group %s: end_weight_update on %s failed: %s", self.group_name, u, r)
        return list(members)

    async def _fail(self, clients: dict, members: dict) -> None:
        """After a failed update: close the members' sessions (best effort, briefly) and drop the group."""
        await asyncio.gather(*(asyncio.wait_for(c.end_weight_update(), HEALTH_TIMEOUT_S) for c in members.values()),
                             return_exceptions=True)
        await self._drop(clients)


def wire_tensor(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    """A weight as it is broadcast: on the group's device, then cast there (a GPU casts a bucket in
    microseconds; floating-point tensors only), contiguous."""
    t = t.detach().to(device)
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.contiguous()


def dtype_of_servers(reported: list) -> torch.dtype | None:
    """The dtype every server reported (/get_server_info "dtype"), or None when one reported none,
    "auto", or something else than the others."""
    names = {r if isinstance(r, str) else None for r in reported}
    if len(names) != 1:
        return None
    name = {"half": "float16", "float": "float32", "bf16": "bfloat16"}.get(*names, *names)
    dtype = weight_group.DTYPES.get(name)
    return dtype if dtype is not None and dtype.is_floating_point else None


async def _servers_dtype(clients: dict) -> torch.dtype | None:
    infos = await asyncio.gather(*(asyncio.wait_for(c.server_info(), HEALTH_TIMEOUT_S) for c in clients.values()),
                                 return_exceptions=True)
    dtype = dtype_of_servers([i.get("dtype") if isinstance(i, dict) else None for i in infos])
    if dtype is None:
        log.warning("weight-update group: the servers reported no common dtype (%s); sending the trainer's",
                    [i.get("dtype") if isinstance(i, dict) else repr(i) for i in infos])
    return dtype


async def _begin_session(client) -> None:
    """begin_weight_update; a session left open (an update that failed before its end) is ended first."""
    try:
        await client.begin_weight_update()
    except RuntimeError as e:
        if "already open" not in str(e):
            raise
        await client.end_weight_update()
        await client.begin_weight_update()
