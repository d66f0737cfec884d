"""The generation-server manager: admits rollouts under the staleness bound, routes them to
servers, and moves every server onto each new policy version with interruption.

Rollout workers ask ALLOCATE before a rollout and say FINISH after it; the master says
UPDATE_WEIGHTS after each training step. A weight update pauses every server with `abort` (running
requests return their partial output; rollout workers resubmit prefix + output, which the servers
hold until they continue), loads the new weights, and continues.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import time
import traceback

from realcore.api.alloc import parse_allocation_mode
from realcore.api.config import ExperimentConfig
from realcore.system.control import ControlServer
from realcore.system.name_resolve import make_name_resolver, scoped_key
from realcore.system.protocol import Cmd
from realcore.system.staleness import StalenessController

log = logging.getLogger("realcore.gserver_manager")


def gen_server_key(cfg: ExperimentConfig, index: int) -> str:
    return scoped_key(cfg.experiment_name, cfg.trial_name, "gen_server", str(index))


class GServerManager:
    def __init__(self, cfg: ExperimentConfig, secret: bytes, n_servers: int):
        from realcore.system.master import manager_key

        self.cfg = cfg
        resolver = make_name_resolver(cfg.system.name_resolve)
        self.servers = [json.loads(resolver.wait(gen_server_key(cfg, i), timeout_s=cfg.system.startup_timeout_s))["http"]
                        for i in range(n_servers)]
        self.engine = parse_allocation_mode(cfg.allocation_mode).backend
        asyncio.run(self._on_all(lambda c: c.wait_ready(cfg.system.startup_timeout_s)))
        self.load = {s: 0 for s in self.servers}  # rollouts in flight per server
        self._rr = itertools.cycle(self.servers)
        r = cfg.rollout
        self.staleness = StalenessController(cfg.trainer.batch_size, r.max_head_offpolicyness, r.max_concurrent_rollouts)
        self.control = ControlServer(cfg.system.host, secret, self._status)
        resolver.put(manager_key(cfg), self.control.address, replace=True)
        log.info("managing %d servers: %s", n_servers, ", ".join(self.servers))

    def _status(self) -> dict:
        s = self.staleness
        return {"state": "running", "pid": os.getpid(), "version": s.version, "running": s.running, "trained": s.trained}

    def route(self) -> str:
        if self.cfg.rollout.routing == "round_robin":
            return next(self._rr)
        return min(self.servers, key=lambda s: self.load[s])

    def allocate(self, body: dict) -> dict:
        if not self.staleness.try_allocate():
            return {"ok": False, "version": self.staleness.version}
        server = self.route()
        self.load[server] += 1
        return {"ok": True, "server": server, "version": self.staleness.version}

    def finish(self, body: dict) -> dict:
        self.staleness.finish(bool(body["accepted"]))
        self.load[body["server"]] -= 1
        return {}

    def drop(self, body: dict) -> dict:
        self.staleness.drop(int(body["n"]))
        return {}

    def pause(self, body: dict) -> dict:
        """Interrupt every server (running requests return; new ones wait) before an in-memory push."""
        asyncio.run(self._on_all(lambda c: c.pause("abort")))
        return {}

    def update_weights(self, body: dict) -> dict:
        """Disk: pause, load `path`, continue. In memory (`path` None): the trainer has pushed the
        tensors to the paused servers already; continue."""
        t0 = time.perf_counter()
        path, version = body.get("path"), str(body["version"])
        if path is not None:
            asyncio.run(self._on_all(lambda c: c.pause("abort")))
            asyncio.run(self._on_all(lambda c: c.update_weights_from_disk(path, version)))
        asyncio.run(self._on_all(lambda c: c.resume()))
        self.staleness.version = int(body["version"])
        return {"seconds": time.perf_counter() - t0}

    async def _on_all(self, call) -> None:
        from realcore.backends.server_launch import client_for

        r = self.cfg.rollout
        clients = [client_for(self.engine, s, token=r.server_token, timeout_s=r.request_timeout_s) for s in self.servers]
        try:
            await asyncio.gather(*(call(c) for c in clients))
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    def run(self) -> None:
        handlers = {Cmd.ALLOCATE: self.allocate, Cmd.FINISH: self.finish, Cmd.UPDATE_WEIGHTS: self.update_weights, Cmd.PAUSE: self.pause,
                    Cmd.DROP: self.drop}
        sys_cfg = self.cfg.system
        while True:
            req = self.control.next_request(startup_timeout_s=sys_cfg.startup_timeout_s,
                                            heartbeat_timeout_s=sys_cfg.heartbeat_timeout_s, who="gserver_manager")
            if req is None:
                continue
            identity, cmd, rid, body = req
            if cmd == Cmd.EXIT:
                self.control.send_reply(identity, rid, {})
                return
            try:
                if cmd not in handlers:
                    raise ValueError(f"unexpected command {cmd.name}")
                self.control.send_reply(identity, rid, handlers[cmd](body))
            except Exception as e:
                log.error("%s failed:\n%s", cmd.name, traceback.format_exc())
                self.control.send_reply(identity, rid, error=f"{cmd.name}: {type(e).__name__}: {e}")

    def close(self) -> None:
        self.control.close()
