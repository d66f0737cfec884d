"""A model worker: holds its data-parallel rank of every model role placed on its training mesh
(allocation_mode; one mesh for all roles unless roles get their own), its dataset shard (the
actor's mesh only), and the samples it produced; runs MFCs the master asks for, fetching inputs it
lacks from peers (on any mesh) through the data plane.

Main loop: take a request, dispatch by command, reply. Socket I/O runs on the control and data
threads; the master's silence for longer than the heartbeat deadline ends the worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import traceback
from types import SimpleNamespace

import torch.distributed as dist

from realcore.api.alloc import mesh_of_worker, parse_allocation_mode
from realcore.api.config import ExperimentConfig
from realcore.api.data import SequenceSample
from realcore.api.registry import dataset_keys, lookup, mfc_spec, workflow_keys
from realcore.backends.fsdp_engine import FSDPEngine
from realcore.backends.torch_engine import TorchEngine
from realcore.backends.clients.server_generation import ServerGeneration
from realcore.backends import device
from realcore.transport import rendezvous
from realcore.trainer.evaluation import Evaluator
from realcore.backends.clients import sglang_api
from realcore.backends import lora
from realcore.backends.clients.registry import client_for
from realcore.backends.models import load_tokenizer
from realcore.dfg.graph import build_graph
from realcore.mfc.generate import sequence_lengths
from realcore.transport import addresses, drops, wire
from realcore.api.registry import source_keys
from realcore.transport.control import ControlServer
from realcore.transport.data_plane import DataClient, DataServer, Storage
from realcore.transport.name_resolve import make_name_resolver
from realcore.transport.protocol import (BroadcastWeights, Clear, Configure, Configured, Evaluate, Evaluated, Exit, Fetch,
                                      Fetched, MFCDone, Pause, Published, PublishWeights, RunMFC, Save, SaveState, Start,
                                      Status)
from realcore.trainer import worker_state
from realcore.data.sampler import EpochSampler
from realcore.api.versions import drop_bound, update_mode
from realcore.transport.stream import TrajectoryStream
from realcore.weights.sync import server_addresses

log = logging.getLogger("realcore.model_worker")


def optimizer_steps(cfg: ExperimentConfig, role: str) -> int:
    """Optimizer steps of `role` over the run: where its LR schedule ends. A step makes as many as
    the role's training MFC that makes the most per call (its MFCSpec.optimizer_steps, e.g.
    ppo_update: ppo_n_minibatches x ppo_epochs)."""
    per_step = [mfc_spec(m.type).steps_per_call(cfg, m) for m in cfg.mfcs
                if m.model == role and mfc_spec(m.type).trains]
    return cfg.trainer.total_steps * max(per_step, default=1)


def _add_size(reply: Fetched | MFCDone, key: str, sequences) -> None:
    """Append a sample's `key` (its sequences, tensors) to `reply` as the master sees it: its tokens
    and its number of sequences (protocol.MFCDone)."""
    reply.tokens[key].append(sum(int(t.numel()) for t in sequences))
    reply.seqs[key].append(len(sequences))


class ModelWorker:
    def __init__(self, cfg: ExperimentConfig, index: int, world: int, secret: bytes):
        self.cfg, self.index, self.world = cfg, index, world
        self.alloc = parse_allocation_mode(cfg.allocation_mode)
        # This worker's training mesh: the roles it holds, and its rank within the mesh.
        meshes = self.alloc.meshes(cfg.roles())
        self.my_mesh = mesh_of_worker(meshes, index)
        self.mesh_index = meshes.index(self.my_mesh)
        self.mesh, self.rank = self.my_mesh.dims, index - self.my_mesh.first
        self.policy = cfg.policy_role()
        self.on_policy_mesh = self.policy in self.my_mesh.roles  # the dataset, the stream, generation
        # Ranks of one data-parallel replica (a TP x PP group) work on the same samples; its head
        # holds them, fetches them, and answers for the replica.
        self.dp_rank, self.head = self.mesh.dp_rank(self.rank), self.mesh.is_dp_head(self.rank)
        self.dfg = build_graph(cfg, source_keys(cfg))
        self.state = "created"
        self.storage = Storage()
        self.resolver = make_name_resolver(cfg.system.name_resolve, secret)
        host, name, limits = cfg.system.host, f"model_worker/{index}", wire.Limits.of(cfg.system)
        drops.set_log_interval(cfg.system.drop_log_interval_s)
        self.control = ControlServer(host, secret, self._status, name=name, limits=limits, relay=True)
        self.data = DataServer(host, secret, self.storage, name=name, limits=limits)
        self.client = DataClient(secret, cfg.system.request_timeout_s, name=name, limits=limits)
        self.peers: dict[int, str] = {}
        self.engines: dict = {}
        self.mfcs = {name: lookup("mfc", n.type)(cfg, next(m for m in cfg.mfcs if m.name == name))
                     for name, n in self.dfg.nodes.items()}
        self.dataset: list = []
        self.sampler: EpochSampler | None = None  # sync mode, replica heads: the shard's position
        self.stream = (TrajectoryStream(host, secret, workflow_keys(cfg.rollout.workflow), name=name, limits=limits)
                       if cfg.mode == "async" and self.head and self.on_policy_mesh else None)
        self.generator = None  # sync mode with generation servers: where `generate` MFCs sample
        self.evaluator = None  # worker 0, when eval.freq_steps is set: made at the first EVALUATE
        self.sender = None  # worker 0, weight_update=nccl: its weight-update group with the servers
        addresses.publish_model_worker(self.resolver, cfg, index, addresses.ModelWorkerAddress(
            self.control.address, self.data.address, os.getpid(), self.stream.address if self.stream is not None else None))
        self.state = "ready"

    def _status(self) -> Status:
        return Status(self.state, os.getpid(), info={"stored": len(self.storage)})

    # --- commands -------------------------------------------------------------------------

    def configure(self, msg: Configure) -> Configured:
        cfg = self.cfg
        self._init_process_group()
        roles = cfg.roles()
        for role in self.my_mesh.roles:
            rcfg, path = roles[role], cfg.role_model_path(role)
            if rcfg.backend == "megatron":
                from realcore.backends.megatron.engine import MegatronEngine  # why: megatron-core (optional, slow to import) only for its roles

                self.engines[role] = MegatronEngine(path, rcfg, self.mesh, total_steps=optimizer_steps(cfg, role),
                                                    seed=cfg.seed, role_name=role)
            elif rcfg.backend == "fsdp":
                self.engines[role] = FSDPEngine(path, rcfg, total_steps=optimizer_steps(cfg, role), seed=cfg.seed)
            else:
                self.engines[role] = TorchEngine(path, rcfg, total_steps=optimizer_steps(cfg, role), seed=cfg.seed)
        policy = self.engines.get(self.policy)
        tokenizer = (policy.tokenizer if policy is not None else None) or load_tokenizer(cfg.model.path)
        self.no_model = SimpleNamespace(tokenizer=tokenizer)
        counts = Configured()
        # The dataset shards over the actor's mesh's replicas (the master's batch source asks its heads);
        # in async mode the rollout workers hold it.
        if cfg.mode == "sync" and self.head and self.on_policy_mesh:
            loaded = lookup("dataset", cfg.dataset.type)(
                cfg.dataset, tokenizer, rank=self.dp_rank, world=self.mesh.dp, use_chat_template=cfg.model.use_chat_template
            )
            self.dataset = loaded.samples
            self.sampler = EpochSampler(len(self.dataset), cfg.dataset.seed, self.dp_rank)
            counts = Configured(loaded.n_rows, len(self.dataset), loaded.skipped)
        if cfg.mode == "sync" and self.alloc.gen is not None and self.head and self.on_policy_mesh:
            self.generator = self._server_generation(tokenizer)
        for i in range(self.world):
            if i != self.index:
                self.peers[i] = addresses.read_model_worker(self.resolver, cfg, i).data
        if msg.recover_from is not None:
            worker_state.load(self._state_parts(), msg.recover_from)
        self.state = "running"
        return counts

    def _server_generation(self, tokenizer):
        timeout = self.cfg.system.startup_timeout_s
        server = addresses.read_gen_server(self.resolver, self.cfg, self.dp_rank % self.alloc.gen.dp, timeout_s=timeout)
        r = self.cfg.rollout
        return ServerGeneration(self.alloc.backend, server.http, tokenizer, token=r.server_token,
                                timeout_s=r.request_timeout_s, ready_timeout_s=timeout)

    def _init_process_group(self) -> None:
        """This rank's device first (its GPU becomes the current one), then the mesh's group on it."""
        self.device = device.select_device()
        log.info("model worker %d computes on %s", self.index, self.device)
        rendezvous.init_mesh(self.cfg, self.resolver, self.rank, self.mesh.world_size, self.device,
                             mesh=self.mesh_index)

    def fetch(self, msg: Fetch) -> Fetched:
        """Samples for the master's ids: the next of this dataset shard (sync), or up to `n`
        trajectories that rollout workers streamed here (async; possibly none yet). A sample's uid
        names its prompt across restarts: "d{shard}:{seq}" (dataset) or "r{worker}:{seq}" (stream)."""
        if self.stream is not None:
            return self._take_stream(msg)
        ids = list(range(msg.first_id, msg.first_id + msg.n))
        names = sorted(dataset_keys(self.cfg.dataset))
        out = Fetched(ids, {k: [] for k in names}, {k: [] for k in names}, [])
        for sid in ids:
            seq, index = self.sampler.next()
            sample = self.dataset[index]
            out.uids.append(f"d{self.dp_rank}:{seq}")
            for k in names:
                self.storage.put(sid, k, sample[k])
                _add_size(out, k, sample[k])
        return out

    def _take_stream(self, msg: Fetch) -> Fetched:
        groups, dropped = self.stream.take(msg.n, current_version=msg.version,
                                           max_head_offpolicyness=drop_bound(self.cfg.rollout))
        keys = self.stream.keys
        out = Fetched([], {k: [] for k in keys}, {k: [] for k in keys}, [], dropped=dropped)
        for k, group in enumerate(groups):
            sid, sample = msg.first_id + k, group.sample
            for key in keys:
                self.storage.put(sid, key, sample[key])
                _add_size(out, key, sample[key])
            out.ids.append(sid)
            out.uids.append(group.uid)
            out.grants.append(group.grant)
            out.version_start.append([int(t) for t in sample["version_start"]])
            out.version_end.append([int(t) for t in sample["version_end"]])
            out.rewards.append([float(r) for r in sample["rewards"]])
            prompt_lens, response_lens = sequence_lengths(sample["loss_mask"])
            out.prompt_lens.append(prompt_lens)
            out.response_lens.append(response_lens)
        return out

    def evaluate(self, msg: Evaluate) -> Evaluated:
        """eval/* metrics of the current policy (realcore.trainer.evaluation): on the generation
        servers when the run has them, else on this worker's actor engine."""
        if self.evaluator is None:
            self.evaluator = Evaluator(self.cfg, self.no_model.tokenizer)
        if self.alloc.gen is not None:
            # The step-0 evaluation can come before a server has published its address.
            servers = server_addresses(self.cfg, self.alloc.gen.dp, "http", timeout_s=self.cfg.system.startup_timeout_s)
            return Evaluated(self.evaluator.run(msg.version, servers=servers))
        return Evaluated(self.evaluator.run(msg.version, model=self.engines[self.policy]))

    def run_mfc(self, msg: RunMFC) -> MFCDone:
        t0 = time.perf_counter()
        done = self._run_one(msg)
        done.seconds = time.perf_counter() - t0
        done.then = [self.run_mfc(m) for m in msg.then]  # chained MFCs read what this one stored
        return done

    def _run_one(self, msg: RunMFC) -> MFCDone:
        node = self.dfg.nodes[msg.mfc]
        ids = msg.ids
        samples = self._gather(ids, node.inputs, msg.owners)
        batch = SequenceSample(ids, [{node.input_remap.get(k, k): s[k] for k in node.inputs} for s in samples])
        model = self.engines[node.model] if node.model else self.no_model
        if self.generator is not None and mfc_spec(node.type).generates:
            model = self.generator
        result = self.mfcs[node.name].run(model, batch)
        out, stats = (result if isinstance(result, tuple) else (result, {}))
        if isinstance(out, dict):
            out, stats = None, out
        done = MFCDone(ids, {}, {}, {}, 0)
        expected = set(node.mfc_outputs())
        got = out.keys() if out is not None else set()
        if set(got) != expected:
            raise ValueError(f"MFC {node.name!r} returned keys {sorted(got)}, declared outputs {sorted(expected)}")
        if out is not None and self.head:  # other ranks of the replica computed the same outputs
            for name in expected:
                key = node.output_remap.get(name, name)
                done.tokens[key], done.seqs[key] = [], []
                for sid, s in zip(out.ids, out.samples):
                    self.storage.put(sid, key, s[name])
                    _add_size(done, key, s[name])
        done.n = sum(len(s[node.input_remap.get(k, k)]) for s in batch.samples for k in node.inputs[:1])
        # An int stat is a count (the master sums it over workers); anything else is a mean.
        done.stats = {k: v if isinstance(v, int) else float(v) for k, v in stats.items()}
        return done

    def _gather(self, ids: list[int], keys: tuple[str, ...], owners: dict[str, list[int]]) -> list[dict]:
        """Inputs of the call: local ones from storage, the rest fetched from their owners."""
        remote: dict[str, list[tuple[int, str]]] = {}
        for k in keys:
            for sid, owner in zip(ids, owners[k]):
                if owner != self.index:
                    remote.setdefault(self.peers[owner], []).append((sid, k))
        fetched = self.client.fetch(remote) if remote else {}
        return [
            {k: fetched[(sid, k)] if owners[k][i] != self.index else self.storage.get(sid, k) for k in keys}
            for i, sid in enumerate(ids)
        ]

    def _sharded(self, role: str) -> bool:
        """A Megatron or FSDP role: every rank takes part in gathering its weights (rank 0 writes)."""
        return self.cfg.roles()[role].backend in ("megatron", "fsdp")

    def save(self, msg: Save) -> None:
        """Each trainable role in HF format (the policy at the path itself), written by its mesh's rank 0."""
        for role, engine in self.engines.items():
            if self.cfg.roles()[role].trainable and (self.rank == 0 or self._sharded(role)):
                engine.save_hf(msg.path if role == self.policy else os.path.join(msg.path, role))

    def save_state(self, msg: SaveState) -> None:
        worker_state.save(self._state_parts(), msg.path)

    def _state_parts(self) -> worker_state.StateParts:
        """What this worker's part of a recover checkpoint holds (worker_state.py)."""
        roles = self.cfg.roles()
        return worker_state.StateParts(
            self.index, engines={role: e for role, e in self.engines.items() if roles[role].trainable},
            collective={role for role in self.engines if roles[role].backend == "megatron"}, sampler=self.sampler, stream=self.stream)

    def publish_weights(self, msg: PublishWeights) -> Published | None:
        """Hand the actor's weights to the generation servers: as an HF directory they load
        (`path`; in sync mode rank 0 then tells the servers in `http`), or pushed over the
        authenticated wire to their update sockets (`servers`)."""
        if self.policy not in self.engines:  # a mesh without the policy has nothing to publish
            return Published()
        engine, sharded = self.engines[self.policy], self._sharded(self.policy)
        if msg.servers:
            # Megatron, FSDP: every rank joins the gather. Torch: rank 0's. With LoRA the adapter alone.
            lora_cfg, adapter = self.cfg.roles()[self.policy].lora, None
            if lora_cfg is not None:
                state = engine.adapter_state() if sharded or self.index == 0 else None
                adapter = {"name": lora.LORA_NAME, "config": lora.adapter_config(lora_cfg)}
            else:
                state = engine.hf_state_dict() if sharded or self.index == 0 else None
            if state is not None and self.index == 0:  # to the host once for every server, not once each
                state = {k: t.detach().cpu() for k, t in state.items()}
            failed = []
            for address in msg.servers if self.index == 0 else []:
                try:  # a server that died is caught up after its restart; the others get the weights now
                    # Not paused: the server decodes while the tensors travel, then ends its running
                    # requests (rollout workers resubmit them) and swaps in one step; or, in flight,
                    # swaps under them and ends only those too stale to be trained.
                    sglang_api.push_weights(address, self.control.secret, str(msg.version), state, self.cfg.system.request_timeout_s,
                                 limits=wire.Limits.of(self.cfg.system), lora=adapter,
                                 **update_mode(self.cfg, msg.version))
                except (ConnectionError, TimeoutError) as e:
                    log.warning("weights not pushed to %s: %s", address, e)
                    failed.append(address)
            return Published(failed)
        if self.index == 0 or sharded:
            if self.cfg.roles()[self.policy].lora is not None:  # servers load the adapter alone: no merged export
                engine.save_hf(msg.path, merged=False)
            else:
                engine.save_hf(msg.path)
        if self.index == 0 and msg.http:
            asyncio.run(self._servers_load(msg.http, msg.path, msg.version))

    def broadcast_weights(self, msg: BroadcastWeights) -> Published:
        """rollout.weight_update=nccl: rank 0 broadcasts the actor's weights to the servers over its
        weight-update group (realcore.weights.broadcast); a Megatron or FSDP role's ranks first
        gather them to rank 0 (with LoRA: base + adapter merged). Published.failed: the servers it did
        not update."""
        if self.policy not in self.engines:  # a mesh without the policy has nothing to send
            return Published()
        engine = self.engines[self.policy]
        state = engine.hf_state_dict() if self._sharded(self.policy) or self.index == 0 else None
        if self.index != 0:
            return Published()
        if self.sender is None:
            from realcore.weights.broadcast import WeightSender  # why: its aiohttp clients only in nccl runs

            self.sender = WeightSender(self.cfg, engine=self.alloc.backend, tp=self.alloc.gen.world_size // self.alloc.gen.dp)  # ranks per server
        # In flight (the servers hold their requests, paused): the last bucket ends the stale ones.
        cut = update_mode(self.cfg, msg.version).get("abort_started_before")
        failed = self.sender.send(state, msg.version, msg.servers, abort_started_before=cut)
        if failed:
            log.warning("weights v%d not broadcast to %s", msg.version, ", ".join(failed))
        return Published(failed)

    async def _servers_load(self, urls: list[str], path: str, version: int) -> None:
        r = self.cfg.rollout
        clients = [client_for(self.alloc.backend, u, token=r.server_token, timeout_s=r.request_timeout_s) for u in urls]
        try:
            await asyncio.gather(*(c.update_weights_from_disk(path, version) for c in clients))
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    # --- loop -----------------------------------------------------------------------------

    def handle(self, msg):
        if isinstance(msg, (Fetch, RunMFC)) and msg.clear:  # the master's release of finished samples
            self.storage.drop(msg.clear)
        handlers = {Configure: self.configure, Fetch: self.fetch, RunMFC: self.run_mfc, Save: self.save,
                    SaveState: self.save_state, PublishWeights: self.publish_weights, Evaluate: self.evaluate,
                    BroadcastWeights: self.broadcast_weights,
                    Clear: lambda m: self.storage.drop(m.ids)}
        if type(msg) not in handlers:
            raise ValueError(f"unexpected command {msg.CMD.name}")
        return handlers[type(msg)](msg)

    def run(self) -> None:
        held: list = []  # requests that arrived while paused, replayed in order on START
        sys_cfg = self.cfg.system
        while True:
            if held and self.state != "paused":
                peer, rid, msg = held.pop(0)
            else:
                req = self.control.next_request(startup_timeout_s=sys_cfg.startup_timeout_s,
                                                heartbeat_timeout_s=sys_cfg.heartbeat_timeout_s, who=f"model_worker/{self.index}")
                if req is None:
                    continue
                peer, rid, msg = req
            if isinstance(msg, Exit):
                self.control.send_reply(peer, rid)
                return
            if isinstance(msg, (Pause, Start)):
                self.state = "paused" if isinstance(msg, Pause) else "running"
                self.control.send_reply(peer, rid)
            elif self.state == "paused":
                held.append((peer, rid, msg))
            else:
                self._execute(peer, rid, msg)

    def _execute(self, peer: wire.Peer, rid: int, msg) -> None:
        try:
            self.control.send_reply(peer, rid, self.handle(msg))
        except Exception as e:
            log.error("%s failed:\n%s", msg.CMD.name, traceback.format_exc())
            self.control.send_reply(peer, rid, error=f"{msg.CMD.name}: {type(e).__name__}: {e}")

    def close(self) -> None:
        self.control.close()
        self.data.close()
        self.client.close()
        if self.stream is not None:
            self.stream.close()
        if self.evaluator is not None:
            self.evaluator.close()
        if dist.is_initialized():
            dist.destroy_process_group()
