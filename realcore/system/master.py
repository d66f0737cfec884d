"""The master worker: schedules the dataflow graph's MFCs onto model workers, moves only metadata.

One step: take `batch_size` new samples from the dataset shards, then run every MFC whose inputs
are ready on `n_seqs` samples (independent MFCs concurrently; each worker executes requests in
arrival order, so collectives line up), then release the samples, log, and checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import threading
import time
from concurrent.futures import Future

from realcore.api.alloc import parse_allocation_mode
from realcore.api.config import ExperimentConfig
from realcore.api.registry import dataset_keys, lookup
from realcore.dfg.graph import DataFlowGraph, MFCNode, build_graph
from realcore.system.buffer import SampleBuffer, split_balanced
from realcore.system.control import WorkerPool, wait_all
from realcore.system.metrics import MetricsWriter
from realcore.system.name_resolve import make_name_resolver, scoped_key
from realcore.system.protocol import Cmd
from realcore.system.stream import STREAM_KEYS

log = logging.getLogger("realcore.master")


def model_worker_key(cfg: ExperimentConfig, index: int) -> str:
    return scoped_key(cfg.experiment_name, cfg.trial_name, "model_worker", str(index))


MANAGER = "gserver_manager"


def manager_key(cfg: ExperimentConfig) -> str:
    return scoped_key(cfg.experiment_name, cfg.trial_name, MANAGER)


def source_keys(cfg: ExperimentConfig) -> tuple[str, ...]:
    """What feeds the graph: the dataset (sync) or the rollout workers' trajectory stream (async)."""
    return STREAM_KEYS if cfg.mode == "async" else dataset_keys(cfg.dataset)


def _report_when_done(name: str, futs: dict[str, Future], events: queue.Queue) -> None:
    """Put (name, None) on `events` when every future is done, or (name, error) at the first failure."""
    left = [len(futs)]
    lock = threading.Lock()

    def done(f: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if f.exception() is not None:
            events.put((name, f.exception()))
        elif last:
            events.put((name, None))

    for f in futs.values():
        f.add_done_callback(done)


def merge_stats(replies: list[dict], into: dict) -> None:
    """Average each stat over workers, weighted by how many sequences each processed."""
    total = sum(r.get("n", 0) for r in replies) or 1
    keys = {k for r in replies for k in r.get("stats", {})}
    for k in keys:
        into[k] = sum(r["stats"].get(k, 0.0) * r.get("n", 0) for r in replies) / total


class Master:
    def __init__(self, cfg: ExperimentConfig, secret: bytes, n_workers: int):
        self.cfg = cfg
        self.n_workers = n_workers
        self.dfg: DataFlowGraph = build_graph(cfg, source_keys(cfg))
        self.nodes = [self.dfg.nodes[n] for n in self.dfg.order()]
        self.buffer = SampleBuffer(self.nodes)
        self.names = [f"model_worker/{i}" for i in range(n_workers)]
        self.alloc = parse_allocation_mode(cfg.allocation_mode)
        self.mesh = self.alloc.train
        # One head per data-parallel replica holds the replica's samples and answers for it.
        self.heads = [self.mesh.dp_head(d) for d in range(self.mesh.dp)]
        resolver = make_name_resolver(cfg.system.name_resolve)
        timeout = cfg.system.startup_timeout_s
        addrs = {n: json.loads(resolver.wait(model_worker_key(cfg, i), timeout_s=timeout))["control"]
                 for i, n in enumerate(self.names)}
        if cfg.mode == "async":
            addrs[MANAGER] = resolver.wait(manager_key(cfg), timeout_s=timeout)
        self.pool = WorkerPool(
            addrs, secret,
            heartbeat_interval_s=cfg.system.heartbeat_interval_s, heartbeat_timeout_s=cfg.system.heartbeat_timeout_s,
        )
        self.next_id = 0
        self.version = 0

    def to_workers(self, cmd: Cmd, body: dict | None = None) -> dict[str, Future]:
        return {n: self.pool.request(n, cmd, body) for n in self.names}

    def configure(self) -> None:
        replies = wait_all(self.to_workers(Cmd.CONFIGURE), self.cfg.system.startup_timeout_s, "configure")
        if self.cfg.mode == "async":
            return
        rows = sum(r["n_rows"] for r in replies.values())
        skipped: dict[str, int] = {}
        for r in replies.values():
            for why, n in r["skipped"].items():
                skipped[why] = skipped.get(why, 0) + n
        log.info("dataset: %d rows, %d usable, skipped %s", rows, sum(r["n_samples"] for r in replies.values()), skipped or "none")

    def fetch_batch(self, metrics: dict) -> None:
        """New samples: batch_size split evenly over the dataset shards (sync), or the first
        batch_size trajectories the rollout workers streamed to any model worker (async)."""
        n, w, timeout = self.cfg.trainer.batch_size, len(self.heads), self.cfg.system.request_timeout_s
        if self.cfg.mode == "sync":
            futs = {}
            for d, head in enumerate(self.heads):
                name = self.names[head]
                k = n // w + (1 if d < n % w else 0)
                if k:
                    futs[name] = self.pool.request(name, Cmd.FETCH, {"first_id": self.next_id, "n": k})
                    self.next_id += k
            for name, r in wait_all(futs, timeout, "dataset fetch").items():
                self.buffer.add(self.names.index(name), r["ids"], r["seqlens"])
            return
        got, versions, rewards, dropped, t0 = 0, [], [], 0, time.monotonic()
        deadline = t0 + timeout
        while got < n:
            for i in self.heads:
                name = self.names[i]
                body = {"first_id": self.next_id, "n": n - got, "version": self.version}
                r = wait_all({name: self.pool.request(name, Cmd.FETCH, body)}, timeout, "stream fetch")[name]
                if r["dropped"]:  # the manager must stop counting them, or admission would stall
                    wait_all({MANAGER: self.pool.request(MANAGER, Cmd.DROP, {"n": r["dropped"]})}, timeout, "drop")
                    dropped += r["dropped"]
                self.buffer.add(i, r["ids"], r["seqlens"])
                self.next_id += len(r["ids"])
                got += len(r["ids"])
                versions += r["versions"]
                rewards += r["rewards"]  # scalars: metadata, like lengths
                if got == n:
                    break
            if got < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"stream: {got} of {n} trajectories within {timeout:g} s; are the rollout workers and servers alive?")
                time.sleep(0.05)
        metrics["time/stream_wait_s"] = time.monotonic() - t0
        metrics["staleness/dropped"] = dropped
        metrics["reward/mean"] = sum(rewards) / len(rewards)
        # Staleness of this batch against the policy that trains on it (AReaL's head/tail offpolicyness).
        metrics["staleness/head"] = self.version - min(v[0] for v in versions)
        metrics["staleness/tail"] = self.version - max(v[0] for v in versions)
        metrics["staleness/interrupted_frac"] = sum(v[0] != v[1] for v in versions) / len(versions)

    def publish_weights(self) -> None:
        """Move every generation server onto the new version (async: interrupting generation)."""
        timeout = self.cfg.system.request_timeout_s
        if self.cfg.mode == "sync":  # no manager: the trainer updates the idle servers itself
            return self.publish_weights_sync(timeout)
        manager = lambda cmd, body: wait_all({MANAGER: self.pool.request(MANAGER, cmd, body)}, timeout, f"manager {cmd.name}")
        if self.cfg.rollout.weight_update == "memory":
            manager(Cmd.PAUSE, {})
            body = {"servers": self.server_weight_addresses(), "version": self.version}
            wait_all(self.to_workers(Cmd.PUBLISH_WEIGHTS, body), timeout, "push weights")
            manager(Cmd.UPDATE_WEIGHTS, {"path": None, "version": self.version})
            return
        path = os.path.join(self.cfg.output_dir, "weights", f"v{self.version}")
        wait_all(self.to_workers(Cmd.PUBLISH_WEIGHTS, {"path": path}), timeout, "publish weights")
        manager(Cmd.UPDATE_WEIGHTS, {"path": path, "version": self.version})
        shutil.rmtree(os.path.join(self.cfg.output_dir, "weights", f"v{self.version - 2}"), ignore_errors=True)

    def publish_weights_sync(self, timeout: float) -> None:
        if self.cfg.rollout.weight_update == "memory":
            body = {"servers": self.server_addresses("weights"), "version": self.version}
        else:
            path = os.path.join(self.cfg.output_dir, "weights", f"v{self.version}")
            body = {"path": path, "http": self.server_addresses("http"), "version": self.version}
        wait_all(self.to_workers(Cmd.PUBLISH_WEIGHTS, body), timeout, "publish weights")
        shutil.rmtree(os.path.join(self.cfg.output_dir, "weights", f"v{self.version - 2}"), ignore_errors=True)

    def server_weight_addresses(self) -> list[str]:
        return self.server_addresses("weights")

    def server_addresses(self, kind: str) -> list[str]:
        """Every generation server's `http` or in-memory `weights` address, as it published them."""
        from realcore.system.gserver_manager import gen_server_key

        resolver = make_name_resolver(self.cfg.system.name_resolve)
        return [json.loads(resolver.get(gen_server_key(self.cfg, i)))[kind] for i in range(self.alloc.gen.dp)]

    def collective(self, node: MFCNode) -> bool:
        """Runs on every rank of each replica (a Megatron role's forward/backward), or on heads only."""
        if node.model is None or self.cfg.roles()[node.model].backend != "megatron":
            return False
        return not (self.alloc.gen is not None and getattr(lookup("mfc", node.type), "generates", False))

    def dispatch(self, node: MFCNode, ids: list[int]) -> dict[str, Future]:
        costs = [self.buffer.tokens(sid, node.inputs) for sid in ids]
        parts = split_balanced(ids, costs, self.mesh.dp)
        self.buffer.start(node, ids)
        ranks = range(self.n_workers) if self.collective(node) else self.heads
        return {
            self.names[i]: self.pool.request(self.names[i], Cmd.RUN_MFC, {
                "mfc": node.name, "ids": parts[self.mesh.dp_rank(i)],
                "owners": self.buffer.owners(parts[self.mesh.dp_rank(i)], node.inputs)})
            for i in ranks
        }

    def run_step(self, step: int, metrics: dict, writer: MetricsWriter) -> None:
        running: dict[str, tuple[MFCNode, list[int], dict[str, Future], float]] = {}
        # Each MFC reports once, when all its workers replied (or at the first failure): O(workers)
        # per MFC, where waking up on every reply and re-scanning every future was O(workers^2).
        events: queue.Queue = queue.Queue()
        while True:
            for node in self.nodes:
                if node.name in running:
                    continue
                ids = self.buffer.ready(node)
                if ids is not None:
                    futs = self.dispatch(node, ids)
                    running[node.name] = (node, ids, futs, time.perf_counter())
                    _report_when_done(node.name, futs, events)
            if not running:
                break
            writer.live(step, "running " + ", ".join(running))
            try:
                name, error = events.get(timeout=self.cfg.system.request_timeout_s)
            except queue.Empty:
                raise TimeoutError(f"MFCs {', '.join(running)}: no reply within {self.cfg.system.request_timeout_s:g} s") from None
            if error is not None:  # a worker failed or was lost: the run cannot go on
                raise error
            node, ids, futs, t0 = running.pop(name)
            replies = {w: r for w, r in wait_all(futs, 0, f"MFC {name}").items()
                       if self.names.index(w) in self.heads}  # the rest of a replica echoes its head
            for wname, r in replies.items():
                self.buffer.add(self.names.index(wname), r["ids"], r["outputs"])
            self.buffer.finish(node, ids)
            merge_stats(list(replies.values()), metrics)
            metrics[f"time/{name}_s"] = metrics.get(f"time/{name}_s", 0.0) + time.perf_counter() - t0
            if node.trains:
                self.version += 1

    def release(self) -> None:
        ids = self.buffer.completed()
        wait_all(self.to_workers(Cmd.CLEAR, {"ids": ids}), self.cfg.system.request_timeout_s, "release")
        self.buffer.release(ids)

    def save(self, step: int) -> None:
        path = os.path.join(self.cfg.output_dir, "checkpoints", f"step_{step}")
        wait_all(self.to_workers(Cmd.SAVE, {"path": path}), self.cfg.system.request_timeout_s, "checkpoint")
        log.info("saved %s", path)

    def run(self) -> None:
        cfg = self.cfg
        self.configure()
        writer = MetricsWriter(cfg.output_dir, cfg.trainer.total_steps)
        rewards: list[float] = []
        try:
            for step in range(1, cfg.trainer.total_steps + 1):
                t0 = time.perf_counter()
                metrics: dict = {"step": step}
                self.fetch_batch(metrics)
                version = self.version
                self.run_step(step, metrics, writer)
                self.release()
                if self.alloc.gen is not None and self.version != version:
                    t1 = time.perf_counter()
                    self.publish_weights()
                    metrics["time/weight_update_s"] = time.perf_counter() - t1
                metrics["version"] = self.version
                metrics["time/step_s"] = time.perf_counter() - t0
                writer.write(metrics)
                if "reward/mean" in metrics:
                    rewards.append(metrics["reward/mean"])
                freq = cfg.trainer.save_freq_steps
                if step == cfg.trainer.total_steps or (freq and step % freq == 0):
                    self.save(step)
        finally:
            writer.close()
        if rewards:
            k = max(1, min(5, len(rewards) // 2))
            first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
            print(f"reward/mean: first {k} steps {first:.3f}, last {k} steps {last:.3f} ({last - first:+.3f})", flush=True)

    def shutdown(self) -> None:
        """Ask every live worker to exit (best effort, bounded), then close sockets."""
        try:
            futs = {n: self.pool.request(n, Cmd.EXIT) for n in self.pool.names if n not in self.pool.lost}
            wait_all(futs, self.cfg.system.shutdown_timeout_s, "exit")
        except Exception as e:  # workers may already be gone; the launcher kills leftovers
            log.warning("shutdown: %s", e)
        self.pool.close()
