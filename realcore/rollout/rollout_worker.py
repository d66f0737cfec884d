"""A rollout worker: holds a shard of the dataset, runs the rollout workflow (realcore.api.workflow)
on admitted prompts against the generation servers, and pushes finished groups into the model
workers' trajectory stream.

The event loop: while the manager admits, start a rollout; each rollout is one task (workflow
episode -> push -> FINISH). The manager's grant names the prompt (`seq`: the position in this shard's
deterministic order), so a restarted worker picks up exactly where the dead one was: the manager
hands it the rollouts that died with its predecessor first.

Failures stay small: a request to a server that stops answering (an error, or no health answer
for `system.heartbeat_timeout_s`) runs again on another server; an agent episode that fails is
retried `rollout.episode_retries` times, then its group is dropped and counted; a manager that
restarts is found again at its new address and told what this worker is still running. An episode
whose workflow returns None is rejected (counted in rollout/rejected_episodes, nothing trained). A
rollout that a weight update leaves certain to be dropped as too stale at take
(staleness.doomed) is not resubmitted: its requests stop and it is counted in
rollout/stale_cancelled, so the servers spend no more decode steps on it. Messages
this worker dropped (realcore.transport.drops) ride along in its FINISH counters to the master's metrics.

Versions: SGLang's and the built-in server's replies carry the weight version that produced them;
vLLM's carry none, so this worker tells each vLLM server's client the version the manager says
the server holds (in each grant and reroute, and after a weight update interrupted a request there),
and the client stamps replies with it (realcore.backends.clients.vllm).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time

import zmq
import zmq.asyncio

from realcore.api.alloc import parse_allocation_mode
from realcore.api.config import ExperimentConfig
from realcore.api.registry import lookup
from realcore.api.workflow import EpisodeOutcome, workflow_data
from realcore.workflows.engines import ServerEngine
from realcore.workflows.episode import reward_fn, run_episode, workflow_of
from realcore.backends.clients.registry import capabilities, client_for
from realcore.backends.clients.sglang_api import version_number
from realcore.backends.models import load_tokenizer
from realcore.workflows.reward_runner import reward_runner_for
from realcore.transport import addresses, drops, wire
from realcore.transport.name_resolve import make_name_resolver
from realcore.transport.protocol import (Allocate, AskServerVersion, Finish, Register, RemoteError, Reroute, parse,
                                      request)
from realcore.data.sampler import EpochSampler
from realcore.api.versions import doomed, drop_bound
from realcore.transport.stream import Group, StreamPusher
from realcore.workflows import sandbox

log = logging.getLogger("realcore.rollout_worker")


class ManagerMoved(Exception):
    """The manager published a new address (it was restarted) while a request waited on the old one."""


class ManagerClient:
    """Request/reply to the gserver manager from asyncio (one DEALER, replies matched by id). When
    the manager stops answering and has published a new address (it was restarted), reconnect,
    re-register (`on_reconnect`) and send again; every manager command is idempotent."""

    def __init__(self, cfg: ExperimentConfig, secret: bytes, on_reconnect, *, name: str = "rollout_worker"):
        self.cfg, self.secret, self.on_reconnect = cfg, secret, on_reconnect
        self.endpoint = wire.Endpoint(secret, name, socket="manager_client", limits=wire.Limits.of(cfg.system))
        self.resolver = make_name_resolver(cfg.system.name_resolve, secret)
        self.ctx = zmq.asyncio.Context.instance()
        self.address = None
        self.sock = None
        self._rids = itertools.count(1)
        self._lock = asyncio.Lock()

    def connect(self, address: str) -> None:
        if self.sock is not None:
            self.sock.close(0)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        wire.set_max_size(self.sock, self.endpoint.limits.max_control_message_bytes)
        wire.secure(self.sock, self.secret, server=False, limits=self.endpoint.limits)
        self.sock.connect(address)
        self.address = address

    async def call(self, msg):
        sys_cfg = self.cfg.system
        deadline = time.monotonic() + sys_cfg.request_timeout_s
        while True:
            try:
                return await self._call_once(msg, sys_cfg.heartbeat_timeout_s)
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gserver manager: no answer to {msg.CMD.name} within {sys_cfg.request_timeout_s:g} s") from None
            except ManagerMoved:
                pass
            if self.follow():
                await self.on_reconnect()

    def follow(self) -> bool:
        """Connect to the manager's published address if it moved (a restarted manager)."""
        published = addresses.manager_moved(self.resolver, self.cfg, self.address)
        if published is None:
            return False
        log.warning("the gserver manager moved to %s; reconnecting", published)
        self.connect(published)
        return True

    async def _call_once(self, msg, timeout_s: float):
        """One request; TimeoutError after timeout_s, ManagerMoved as soon as a restarted manager
        has published its address (checked every heartbeat interval: a dead one never answers)."""
        async with self._lock:  # one request in flight: replies come back in order
            rid = next(self._rids)
            await self.sock.send_multipart(self.endpoint.seal(request(msg, rid), to=self.address))
            end = time.monotonic() + timeout_s
            while True:
                wait = min(end - time.monotonic(), self.cfg.system.heartbeat_interval_s)
                try:
                    frames = await asyncio.wait_for(self.sock.recv_multipart(copy=False), max(0.0, wait))
                except asyncio.TimeoutError:
                    if time.monotonic() >= end:
                        raise TimeoutError from None
                    if addresses.manager_moved(self.resolver, self.cfg, self.address) is not None:
                        raise ManagerMoved from None
                    continue
                try:
                    _, header, _ = self.endpoint.open(frames)
                except wire.BadMessage:
                    continue  # counted by the endpoint; the real reply may still come
                if header.get("rid") == rid:
                    break
        if not header.get("ok"):
            raise RemoteError(f"gserver_manager: {header.get('error')}")
        return parse(msg.REPLY, header["body"])

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)


class ServerLost(RuntimeError):
    """A generation server failed a request or stopped answering."""


class StaleRollout(RuntimeError):
    """The rollout can no longer be trained (staleness.doomed): its requests stop."""


class RoutedClient:
    """The agent's generation client for one rollout: SGLang's `generate` on the server the
    manager chose, moved to another server (by the manager) when that one fails or goes silent.
    The request that failed runs again from the same prefix, so the trajectory loses nothing."""

    def __init__(self, worker: "RolloutWorker", seq: int, server: str):
        self.worker, self.seq, self.server = worker, seq, server
        self.first_version: int | None = None  # the oldest version of any generated token: the group's version_start
        self.stale = False  # doomed: every later request raises StaleRollout

    async def generate(self, input_ids, sampling_params, *, rid: str, return_logprob: bool = True):
        w = self.worker
        if self.stale:
            raise StaleRollout(f"rollout {self.seq}: too stale to be trained")
        for attempt in itertools.count():
            try:
                reply = await w.watched(self.server, w.client(self.server).generate(
                    input_ids, sampling_params, rid=f"{rid}~{attempt}" if attempt else rid, return_logprob=return_logprob))
                break
            except (RuntimeError, TimeoutError, OSError) as e:
                if attempt >= w.cfg.rollout.request_retries:
                    raise
                log.warning("rollout %d: %s (%s); asking for another server", self.seq, self.server, e)
                self.server = await w.reroute(self.seq, self.server, error=" ".join(str(e).split())[:500])
        if reply.finish_reason == "abort" and not capabilities(w.engine).reports_versions:
            await w.ask_version(self.server)  # a weight update interrupted it: learn the new version before it resumes
        version = version_number(reply.weight_version)
        # A reply without tokens (a request still queued when an update aborted everything)
        # generated nothing with its version: the rollout's staleness starts at its first token,
        # as the trajectory's version_start does (counting it cancelled trainable rollouts).
        if reply.output_ids:  # per token: an in-flight update may have changed the weights under it
            first = min(reply.token_versions())
            self.first_version = first if self.first_version is None else min(self.first_version, first)
        if self.first_version is not None and doomed(
                self.first_version, version, aborted=reply.finish_reason == "abort",
                max_head_offpolicyness=drop_bound(w.cfg.rollout)):
            self.stale = True
            if reply.finish_reason == "abort":  # do not resubmit what would be dropped at take
                raise StaleRollout(f"rollout {self.seq}: too stale to be trained (started at version "
                                   f"{self.first_version}, servers past {version})")
        return reply

    def __getattr__(self, name):  # anything else (abort, server_info, ...) goes to the current server
        return getattr(self.worker.client(self.server), name)


def keep_group(rewards: list[float], filter_equal_rewards: bool) -> bool:
    """Dynamic filtering (DAPO, AReaL): a group whose rewards are all equal has zero advantage
    everywhere, so it teaches nothing; drop it when asked."""
    return not (filter_equal_rewards and len(set(rewards)) <= 1)


class RolloutWorker:
    def __init__(self, cfg: ExperimentConfig, index: int, secret: bytes):
        self.cfg, self.index, self.secret = cfg, index, secret
        self.tokenizer = load_tokenizer(cfg.model.path)
        loaded = lookup("dataset", cfg.dataset.type)(
            cfg.dataset, self.tokenizer, rank=index, world=cfg.rollout.n_workers, use_chat_template=cfg.model.use_chat_template
        )
        self.samples = loaded.samples
        self.order = EpochSampler(len(self.samples), cfg.dataset.seed, index)
        self.workflow, self.keys = workflow_of(cfg)
        sandbox.bound_node_calls(sandbox.node_slots_folder(cfg.output_dir), cfg.rollout.max_concurrent_tool_calls)
        self.rewards = reward_runner_for(cfg)
        resolver = make_name_resolver(cfg.system.name_resolve, secret)
        timeout = cfg.system.startup_timeout_s
        self.manager_address = addresses.read_manager(resolver, cfg, timeout_s=timeout).control
        # Trajectories go to the head of each data-parallel replica of the training mesh.
        alloc = parse_allocation_mode(cfg.allocation_mode)
        mesh = alloc.train
        self.streams = [addresses.read_model_worker(resolver, cfg, mesh.dp_head(d), timeout_s=timeout).stream
                        for d in range(mesh.dp)]
        self.engine = alloc.backend
        self.clients: dict = {}
        # vLLM: one AskServerVersion at a time per server, and when the last answered one was sent.
        self.asking: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self.asked_at: dict[str, float] = {}
        self.running: set[int] = set()  # seqs of the rollouts in flight
        self.last_ok: dict[str, float] = {}  # server -> when it last answered /health
        self.active: collections.Counter[str] = collections.Counter()  # server -> requests in flight
        self.manager: ManagerClient | None = None
        self.drops_reported: dict[str, int] = {}  # drops.snapshot() as of the last FINISH
        self.failed_in_a_row, self.ever_ok = 0, False  # every episode failing from the start is a bug: stop
        drops.set_log_interval(cfg.system.drop_log_interval_s)
        log.info("rollout worker %d: %d prompts (skipped %s)", index, len(self.samples), loaded.skipped or "none")

    def client(self, server: str):
        if server not in self.clients:
            r = self.cfg.rollout
            self.clients[server] = client_for(self.engine, server, token=r.server_token, timeout_s=r.request_timeout_s,
                                              lora=self.cfg.actor.lora is not None)
        return self.clients[server]

    def learn_version(self, server: str, version: int) -> None:
        """The manager says `server` holds `version`: a vLLM client stamps the replies to requests
        sent from now with it (vLLM reports no version; SGLang and the built-in server do)."""
        if not capabilities(self.engine).reports_versions:
            self.client(server).assume_version(version)

    async def ask_version(self, server: str) -> None:
        """Ask the manager which version `server` holds (it answers once the update it may be running
        is done) and tell the server's client. Requests that come back aborted together share one
        ask: any answer sent after a request came back is as good for it."""
        came_back = time.monotonic()
        async with self.asking[server]:
            if self.asked_at.get(server, -1.0) >= came_back:
                return
            sent = time.monotonic()
            self.learn_version(server, (await self.manager.call(AskServerVersion(server))).version)
            self.asked_at[server] = sent

    async def watched(self, server: str, call):
        """Await a request to `server`, giving up (ServerLost) when the server has not answered
        /health for system.heartbeat_timeout_s (a stopped or hung process never replies)."""
        task = asyncio.ensure_future(call)
        sys_cfg = self.cfg.system
        if not self.active[server]:  # not probed while idle: its clock starts now
            self.last_ok[server] = time.monotonic()
        self.active[server] += 1
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=sys_cfg.heartbeat_interval_s)
                if done:
                    return task.result()
                if time.monotonic() - self.last_ok[server] > sys_cfg.heartbeat_timeout_s:
                    raise ServerLost(f"{server} did not answer /health for {sys_cfg.heartbeat_timeout_s:g} s")
        finally:
            self.active[server] -= 1
            if not task.done():
                task.cancel()

    async def watch_health(self) -> None:
        """One probe per heartbeat interval of every server this worker has requests on."""
        sys_cfg = self.cfg.system
        while True:
            servers = [s for s, n in self.active.items() if n]
            oks = await asyncio.gather(*(self.client(s).health(timeout_s=sys_cfg.heartbeat_interval_s) for s in servers))
            now = time.monotonic()
            for s, ok in zip(servers, oks):
                if ok:
                    self.last_ok[s] = now
            await asyncio.sleep(sys_cfg.heartbeat_interval_s)

    async def reroute(self, seq: int, failed: str, *, error: str = "") -> str:
        deadline = time.monotonic() + self.cfg.system.request_timeout_s
        for ask in itertools.count():
            r = await self.manager.call(Reroute(self.index, seq, failed, report=ask == 0, error=error))
            if r.server is not None:
                self.learn_version(r.server, r.server_version)
                return r.server
            if time.monotonic() > deadline:
                raise TimeoutError("no healthy generation server")
            await asyncio.sleep(0.5)

    async def register(self) -> None:
        """Tell the manager which rollouts this worker runs (none after a restart: the manager then
        admits the dead worker's rollouts again); waits while the manager is not admitting yet."""
        while True:
            try:
                if (await self.manager._call_once(Register(self.index, sorted(self.running)), self.cfg.system.request_timeout_s)).ok:
                    return
            except ManagerMoved:
                self.manager.follow()
                continue
            await asyncio.sleep(0.2)

    async def episode(self, seq: int, server: str, counters: dict[str, int]):
        """The workflow's group for prompt `seq` ({key: one tensor per sequence}), None when the
        workflow rejected it, EpisodeOutcome.STALE when it became too stale to be trained, or
        EpisodeOutcome.FAILED after `rollout.episode_retries` retries of an episode that raised or
        returned a bad trajectory; with the server it ended on. Reward calls that failed or timed
        out are counted."""
        data = workflow_data(self.samples[self.order.index(seq)])
        client = RoutedClient(self, seq, server)
        score = reward_fn(self.rewards, counters)
        for attempt in range(self.cfg.rollout.episode_retries + 1):
            client.first_version = None  # a retry generates everything again: its staleness starts anew
            engine = ServerEngine(client, self.tokenizer, self.cfg.generation, score, rid=f"r{self.index}-{seq}-{attempt}")
            result = await run_episode(self.workflow, engine, data, self.keys)
            if client.stale:  # a workflow that caught StaleRollout, or raised it: what it returns is dropped at take
                return EpisodeOutcome.STALE, client.server
            if result.outcome is not EpisodeOutcome.FAILED:
                return result.group, client.server  # None: rejected
            e = result.error
            log.warning("rollout %d: episode failed (attempt %d of %d): %s: %s", seq, attempt + 1,
                        self.cfg.rollout.episode_retries + 1, type(e).__name__, e)
        return EpisodeOutcome.FAILED, client.server

    async def rollout(self, push: StreamPusher, seq: int, grant: int, server: str) -> None:
        self.running.add(seq)
        counters: dict[str, int] = {}
        group, server = await self.episode(seq, server, counters)
        failed = group is EpisodeOutcome.FAILED
        self.failed_in_a_row = self.failed_in_a_row + 1 if failed else 0
        self.ever_ok = self.ever_ok or not failed
        if not self.ever_ok and self.failed_in_a_row >= max(8, self.cfg.rollout.max_concurrent_rollouts):
            raise RuntimeError(f"the first {self.failed_in_a_row} episodes of workflow {self.cfg.rollout.workflow!r} all "
                               "failed (see the warnings above): a bug in the workflow, not bad luck; stopping")
        if failed:
            accepted, counters["rollout/failed_episodes"] = False, 1
        elif group is EpisodeOutcome.STALE:
            accepted, counters["rollout/stale_cancelled"] = False, 1
        elif group is None:
            accepted, counters["rollout/rejected_episodes"] = False, 1
        else:
            accepted = keep_group([float(r) for r in group["rewards"]], self.cfg.rollout.filter_equal_reward_groups)
        if accepted:
            await push.push(Group(f"r{self.index}:{seq}", grant, group))
        counters.update(self.new_drops())
        await self.manager.call(Finish(self.index, seq, grant, accepted, server, counters))
        self.running.discard(seq)

    def new_drops(self) -> dict[str, int]:
        """Messages dropped since the last FINISH, as counters
        {"dropped/rollout_worker/<index>/<socket>/<reason>": n} (the master logs their totals)."""
        now, last, me = drops.snapshot(), self.drops_reported, f"dropped/rollout_worker/{self.index}"
        new = {f"{me}/{k}": n - last.get(k, 0) for k, n in now.items() if n > last.get(k, 0)}
        self.drops_reported = now
        return new

    async def main(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        name, limits = f"rollout_worker/{self.index}", wire.Limits.of(self.cfg.system)
        self.manager = ManagerClient(self.cfg, self.secret, self.register, name=name)
        self.manager.connect(self.manager_address)
        push = StreamPusher(ctx, self.streams, self.secret, self.cfg.system.request_timeout_s, name=name, limits=limits)
        await self.register()
        health = asyncio.create_task(self.watch_health())
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                for t in [t for t in tasks if t.done()]:
                    tasks.discard(t)
                    t.result()  # only a broken stream or manager gets here: fail the worker (it is restarted)
                if health.done():
                    health.result()
                if len(tasks) < self.cfg.rollout.max_concurrent_rollouts:
                    grant = await self.manager.call(Allocate(self.index))
                    if grant.ok:
                        self.learn_version(grant.server, grant.server_version)
                        tasks.add(asyncio.create_task(self.rollout(push, grant.seq, grant.grant, grant.server)))
                        continue
                await asyncio.wait(tasks, timeout=0.05) if tasks else await asyncio.sleep(0.05)
        finally:
            health.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*(c.close() for c in self.clients.values()), return_exceptions=True)
            push.close()
            self.manager.close()
            self.rewards.close()
