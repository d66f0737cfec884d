"""A rollout worker: holds a shard of the dataset, runs the agent on admitted prompts against the
generation servers, and pushes finished groups into the model workers' trajectory stream.

The event loop: while the manager admits, start a rollout; each rollout is one task (agent ->
push -> FINISH). A failed rollout fails the worker loudly (the launcher stops the run).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging

import torch
import zmq
import zmq.asyncio

from realcore.api.alloc import parse_allocation_mode
from realcore.api.config import ExperimentConfig
from realcore.api.data import tensor_to_text
from realcore.api.registry import lookup
from realcore.system import wire
from realcore.system.master import manager_key, model_worker_key
from realcore.system.name_resolve import make_name_resolver
from realcore.system.protocol import Cmd, RemoteError, request
from realcore.system.sampler import EpochSampler
from realcore.system.stream import encode_group

log = logging.getLogger("realcore.rollout_worker")


class ManagerClient:
    """Request/reply to the gserver manager from asyncio (one DEALER, replies matched by id)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, secret: bytes, timeout_s: float):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.secret, self.timeout_s = secret, timeout_s
        self._rids = itertools.count(1)
        self._lock = asyncio.Lock()

    async def call(self, cmd: Cmd, body: dict | None = None) -> dict:
        async with self._lock:  # one request in flight: replies come back in order
            rid = next(self._rids)
            await self.sock.send_multipart(wire.encode(request(cmd, rid, body or {}), [], self.secret))
            while True:
                frames = await asyncio.wait_for(self.sock.recv_multipart(copy=False), self.timeout_s)
                header, _ = wire.decode(frames, self.secret)
                if header.get("rid") == rid:
                    break
        if not header.get("ok"):
            raise RemoteError(f"gserver_manager: {header.get('error')}")
        return header["body"]


def keep_group(rewards: list[float], filter_equal_rewards: bool) -> bool:
    """Dynamic filtering (DAPO, AReaL): a group whose rewards are all equal has zero advantage
    everywhere, so it teaches nothing; drop it when asked."""
    return not (filter_equal_rewards and len(set(rewards)) <= 1)


def trajectory_sample(prompt_ids: list[int], results) -> dict:
    """A group of (Trajectory, reward) -> a stream sample (see realcore.system.stream)."""
    p = len(prompt_ids)
    out = {k: [] for k in ("input_ids", "loss_mask", "behav_logprobs", "rewards", "version_start", "version_end")}
    for t, reward in results:
        o = len(t.output_ids)
        out["input_ids"].append(torch.tensor(prompt_ids + list(t.output_ids), dtype=torch.int64))
        out["loss_mask"].append(torch.cat([torch.zeros(p, dtype=torch.int64), torch.ones(o, dtype=torch.int64)]))
        out["behav_logprobs"].append(torch.cat([torch.zeros(p), torch.tensor(t.output_logprobs, dtype=torch.float32)]))
        out["rewards"].append(torch.tensor([float(reward)]))
        out["version_start"].append(torch.tensor([t.version_start], dtype=torch.int64))
        out["version_end"].append(torch.tensor([t.version_end], dtype=torch.int64))
    return out


class RolloutWorker:
    def __init__(self, cfg: ExperimentConfig, index: int, secret: bytes):
        from realcore.backends.models import load_tokenizer

        self.cfg, self.index, self.secret = cfg, index, secret
        self.tokenizer = load_tokenizer(cfg.model.path)
        loaded = lookup("dataset", cfg.dataset.type)(
            cfg.dataset, self.tokenizer, rank=index, world=cfg.rollout.n_workers, use_chat_template=cfg.model.use_chat_template
        )
        self.samples = loaded.samples
        self.sampler = EpochSampler(len(self.samples), cfg.dataset.seed, index)
        self.agent = lookup("agent", cfg.rollout.agent)
        self.reward_fn = lookup("reward", cfg.reward.type)
        resolver = make_name_resolver(cfg.system.name_resolve)
        timeout = cfg.system.startup_timeout_s
        self.manager_address = resolver.wait(manager_key(cfg), timeout_s=timeout)
        # Trajectories go to the head of each data-parallel replica of the training mesh.
        mesh = parse_allocation_mode(cfg.allocation_mode).train
        self.streams = [json.loads(resolver.wait(model_worker_key(cfg, mesh.dp_head(d)), timeout_s=timeout))["stream"]
                        for d in range(mesh.dp)]
        self.clients: dict = {}
        self._count = itertools.count()
        log.info("rollout worker %d: %d prompts (skipped %s)", index, len(self.samples), loaded.skipped or "none")

    def client(self, server: str):
        from realcore.backends.server_launch import client_for

        if server not in self.clients:
            r, engine = self.cfg.rollout, parse_allocation_mode(self.cfg.allocation_mode).backend
            self.clients[server] = client_for(engine, server, token=r.server_token, timeout_s=r.request_timeout_s)
        return self.clients[server]

    async def rollout(self, manager: ManagerClient, push: zmq.asyncio.Socket, server: str) -> None:
        sample = self.samples[self.sampler.next()]
        prompt_ids = sample["prompt_ids"][0].tolist()
        results = await self.agent(
            prompt_ids, tensor_to_text(sample["answer"][0]), client=self.client(server), gconfig=self.cfg.generation,
            tokenizer=self.tokenizer, reward_fn=self.reward_fn, rid=f"r{self.index}-{next(self._count)}",
        )
        accepted = keep_group([r for _, r in results], self.cfg.rollout.filter_equal_reward_groups)
        if accepted:
            header, tensors = encode_group(trajectory_sample(prompt_ids, results))
            await push.send_multipart(wire.encode(header, tensors, self.secret))
        await manager.call(Cmd.FINISH, {"accepted": accepted, "server": server})

    async def main(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        manager = ManagerClient(ctx, self.manager_address, self.secret, self.cfg.system.request_timeout_s)
        push = ctx.socket(zmq.PUSH)  # round robin over the model workers' streams
        push.setsockopt(zmq.LINGER, 0)
        for address in self.streams:
            push.connect(address)
        tasks: set[asyncio.Task] = set()
        while True:
            for t in [t for t in tasks if t.done()]:
                tasks.discard(t)
                t.result()  # a failed rollout fails the worker
            if len(tasks) < self.cfg.rollout.max_concurrent_rollouts:
                grant = await manager.call(Cmd.ALLOCATE)
                if grant["ok"]:
                    tasks.add(asyncio.create_task(self.rollout(manager, push, grant["server"])))
                    continue
            await asyncio.wait(tasks, timeout=0.05) if tasks else await asyncio.sleep(0.05)
