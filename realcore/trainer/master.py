"""The master worker: schedules the dataflow graph's MFCs onto model workers, moves only metadata.

One step: take `batch_size` new samples from the batch source (dataset shards or the trajectory
stream), then run every MFC whose inputs are ready on `n_seqs` samples, on the workers of its
role's training mesh (a model-free MFC on the actor's): MFCs on different meshes run at the same
time, MFCs on one mesh one after another (a worker runs one request at a time, so `time/NAME_s`
is each MFC's own wall time; an MFC that waits only for the one being sent, on the same mesh,
goes in its request, Master.chain), then release the samples
(each worker drops them with its next request), publish the new weights to the generation
servers, log, and checkpoint.
A recover checkpoint (recover.py) lets a restarted run continue from the step it was written at.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import itertools
import logging
import os
import queue
import signal
import time

from realcore.api.alloc import Mesh, parse_allocation_mode
from realcore.api.config import ExperimentConfig
from realcore.api.registry import mfc_spec
from realcore.dfg.graph import DataFlowGraph, MFCNode, build_graph
from realcore.transport import addresses, drops, keys, wire
from realcore.trainer import recover
from realcore.api.registry import source_keys
from realcore.trainer.batch_source import DatasetSource, Group, SourcePorts, StreamSource, ledger_rows
from realcore.trainer.consistency import drift_warnings
from realcore.trainer.buffer import SampleBuffer, spans_of, split_balanced, take
from realcore.transport.columns import merged_stats
from realcore.transport.pool import Columns, Gathered, WorkerPool
from realcore.transport.relay_tree import relay_groups, relay_tops, replica_groups
from realcore.transport.reply import Reply, wait_all, when_all_done
from realcore.trainer.ledger import Ledger
from realcore.trainer.metrics import MetricsWriter, add_throughput, print_reward_summary, wandb_init_kwargs
from realcore.transport.name_resolve import make_name_resolver
from realcore.transport.protocol import (Clear, Configure, Evaluate, Exit, Fetch, ManagerState, RemoteError, Restore, RunMFC, Save,
                                      SaveState, Snapshot, WorkerLost, parse)
from realcore.weights.sync import WeightPorts, make_weight_sync, server_addresses

log = logging.getLogger("realcore.master")
MANAGER = keys.MANAGER


class Preempted(Exception):
    """SIGTERM arrived: a recover checkpoint was written; the run should be started again later."""


def _report_when_done(name: str, futs: dict[str, Reply], events: queue.Queue) -> None:
    """Put (name, None) on `events` when every future is done, or (name, error) at the first failure."""
    if futs:
        when_all_done(futs, lambda error: events.put((name, error)))
    else:
        events.put((name, None))


def merge_stats(replies: list, into: dict) -> None:
    """Counts (int stats) are summed over workers; means are averaged, weighted by how many
    sequences each worker processed (columns.merged_stats; a relay's reply is merged already)."""
    into.update(merged_stats([(r.stats, r.n) for r in replies]))


@dataclasses.dataclass(frozen=True)
class MeshView:
    """A training mesh as the master addresses it: its replicas' heads (global worker indices) and
    which of them travel as one request (one relay's)."""

    index: int
    mesh: Mesh
    heads: list[int]
    groups: list[list[int]]  # replicas (indices into heads)


def calm_collector() -> None:
    """The master makes ~75k small containers a step at 1000 workers (metadata per sample); with
    Python's default thresholds the cyclic collector then ran ~5 full collections a step over all
    that setup left alive (torch, transformers, the registries): ~40% of the master's CPU
    (bench/master_scale.py). What exists now lives for the run: frozen out of collections; young
    objects are collected when 20000 (not 700) accumulate, older generations 20x less often."""
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


class Master:
    def __init__(self, cfg: ExperimentConfig, secret: bytes, n_workers: int):
        self.cfg = cfg
        self.n_workers = n_workers
        self.async_mode = cfg.mode == "async"
        self.dfg: DataFlowGraph = build_graph(cfg, source_keys(cfg))
        self.nodes = [self.dfg.nodes[n] for n in self.dfg.order()]
        self.buffer = SampleBuffer(self.nodes)
        self.names = [f"model_worker/{i}" for i in range(n_workers)]
        self.index_of = {n: i for i, n in enumerate(self.names)}
        self.alloc = parse_allocation_mode(cfg.allocation_mode)
        self.policy = cfg.policy_role()
        # One head per data-parallel replica of each mesh holds the replica's samples and answers for it.
        meshes = self.alloc.meshes(cfg.roles())
        self.head_set = {h for m in meshes for h in m.heads()}
        self.resolver = make_name_resolver(cfg.system.name_resolve, secret)
        timeout = cfg.system.startup_timeout_s
        addrs = {n: addresses.read_model_worker(self.resolver, cfg, i, timeout_s=timeout).control
                 for i, n in enumerate(self.names)}
        if self.async_mode:
            addrs[MANAGER] = addresses.read_manager(self.resolver, cfg, timeout_s=timeout).control
        drops.set_log_interval(cfg.system.drop_log_interval_s)
        self.pool = WorkerPool(
            addrs, secret,
            heartbeat_interval_s=cfg.system.heartbeat_interval_s, heartbeat_timeout_s=cfg.system.heartbeat_timeout_s,
            name="master", limits=wire.Limits.of(cfg.system),
            relays=(relays := relay_groups({n: addrs[n] for n in self.names}, cfg.system.relay_group_size)),
            relay_timeout_s=cfg.system.request_timeout_s, tops=relay_tops(list(relays), cfg.system.relay_fanout),
        )
        self.meshes = [MeshView(i, m, m.heads(), replica_groups(m.heads(), self.names, self.pool.relay_of, self.pool.top_of))
                       for i, m in enumerate(meshes)]
        self.mesh_of_role = {role: v for v in self.meshes for role in v.mesh.roles}
        # The dataset shards over the actor's mesh's replicas (and async trajectories go to its heads).
        self.heads, self.groups = self.meshes[0].heads, self.meshes[0].groups
        self.drop_tally = drops.Tally()
        self.drop_totals: collections.Counter[str] = collections.Counter()  # "process/socket/reason" -> drops this attempt
        self.version = 0
        self.published = 0  # the version the generation servers hold
        self.step = 0
        manager, gen = (self.call_manager if self.async_mode else None), self.alloc.gen  # the ports hold these, not the master
        self.weights = None if gen is None else make_weight_sync(cfg.rollout.weight_update, WeightPorts(
            call_workers=self.call_all, call_manager=manager, weights_dir=os.path.join(cfg.output_dir, "weights"),
            server_addresses=lambda kind: server_addresses(cfg, gen.dp, kind)))
        self.source = (StreamSource if self.async_mode else DatasetSource)(SourcePorts(
            batch_size=cfg.trainer.batch_size, timeout_s=cfg.system.request_timeout_s, heads=self.heads,
            groups=self.groups, buffer=self.buffer, call_columns=self.call_columns, call_worker=self.call_worker,
            clear=self.clear_on, call_manager=manager, version=lambda: self.version, while_waiting=self.while_waiting))
        self.preempt_requested = False
        self.terminated = False  # SIGTERM: whoever sent it stops every process of the run
        self.counters: dict[str, int] = {}  # rollout workers' totals (reward errors, ...) logged so far
        self.to_clear: dict[int, list[int]] = {}  # worker -> released samples its next Fetch/RunMFC drops

    # --- calls --------------------------------------------------------------------------------

    def wait(self, futs: dict[str, Reply], what: str, timeout_s: float | None = None) -> dict:
        return wait_all(futs, timeout_s or self.cfg.system.request_timeout_s, what)

    def call_all(self, msg, what: str, timeout_s: float | None = None) -> dict:
        return self.wait(self.pool.request_many({n: msg for n in self.names}), what, timeout_s)

    def with_clears(self, msgs: dict[str, Fetch | RunMFC]) -> dict[str, Fetch | RunMFC]:
        """`msgs` with each worker's released samples to drop before it runs them (Master.release)."""
        out = {}
        for name, msg in msgs.items():
            ids = self.to_clear.pop(self.index_of[name], None)
            out[name] = dataclasses.replace(msg, clear=ids) if ids else msg
        return out

    def call_worker(self, index: int, msg: Fetch | RunMFC, what: str):
        """One request to worker `index`, which drops its released samples first; its reply."""
        name = self.names[index]
        return self.wait(self.pool.request_many(self.with_clears({name: msg})), what)[name]

    def call_columns(self, runs: list[tuple[list[int], list[int], Fetch]], what: str) -> list[tuple[list[int], object]]:
        """Per run of workers (indices; `sizes[k]` samples from the k-th, which drops its released
        samples first), one request: who answered each sample, and the joined reply."""
        futs = self.pool.request_columns([Columns([self.names[i] for i in ws], sizes, msg, [self.to_clear.pop(i, []) for i in ws])
                                          for ws, sizes, msg in runs])
        return [(g.owners(self.index_of), g.reply) for g in self.wait(futs, what).values()]

    def clear_on(self, index: int, ids: list[int]) -> None:
        self.wait({self.names[index]: self.pool.request(self.names[index], Clear(ids))}, "clear")

    def call_manager(self, msg, what: str):
        """One request to the gserver manager, surviving its restart: when it publishes a new
        address (the launcher restarted it; it replayed its journal), reconnect and send again.
        Every manager command is idempotent, so a command that reached the old one is harmless."""
        deadline = time.monotonic() + self.cfg.system.request_timeout_s
        while True:
            fut = self.pool.request(MANAGER, msg)
            while True:
                try:
                    return fut.result(timeout=1.0)
                except TimeoutError:
                    if self._manager_moved():
                        break
                except WorkerLost:
                    while not self._manager_moved():
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"manager {what}: the gserver manager is gone and did not come back") from None
                        time.sleep(0.5)
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"manager {what}: no reply within {self.cfg.system.request_timeout_s:g} s")
            log.warning("the gserver manager restarted; sending %s again", what)

    def _manager_moved(self) -> bool:
        address = addresses.manager_moved(self.resolver, self.cfg, self.pool.addresses[MANAGER])
        if address is None:
            return False
        self.pool.reconnect(MANAGER, address)
        return True

    def while_waiting(self) -> None:
        """Called while the master waits for trajectories: servers that restarted get the
        current weights (in memory mode only the trainer can give them)."""
        status = self.pool.status.get(MANAGER)
        behind = status.info.get("behind", "") if status is not None else ""
        if behind and self.weights is not None:
            self.weights.catch_up([int(i) for i in str(behind).split(",")], self.version)

    # --- the step -----------------------------------------------------------------------------

    def mesh_of(self, node: MFCNode) -> MeshView:
        """Where `node` runs: its role's mesh; a model-free MFC on the actor's."""
        return self.mesh_of_role[node.model if node.model is not None else self.policy]

    def collective(self, node: MFCNode) -> bool:
        """Runs on every rank of each replica (a Megatron role's forward/backward), or on heads only."""
        if node.model is None or self.cfg.roles()[node.model].backend != "megatron":
            return False
        return not (self.alloc.gen is not None and mfc_spec(node.type).generates)

    def chain(self, node: MFCNode, ids: list[int], parts: list[list[int]], busy, costs: list[int] | None = None) -> list[MFCNode]:
        """MFCs to send with `node` on the same ids, run right after it on each worker: one request
        per worker where each was one more round trip (the master's cost per worker,
        bench/master_scale.py). An MFC joins when it waits only for what `node` (or one chained
        before it) produces, takes exactly these ids, runs on the heads as `node` does, and is
        split as `node` is by its own token costs: so it runs where it would have run anyway.
        Not after generation (the responses it makes change every later MFC's costs), nor for
        collective (Megatron) MFCs (other ranks read a head's outputs through the data plane,
        which a chained MFC could reach before the head stored them), nor on another mesh.
        `costs`: those `parts` were split by (an MFC with the same costs splits the same way: not
        split again)."""
        if self.collective(node) or mfc_spec(node.type).generates:
            return []
        view = self.mesh_of(node)
        have = self.buffer.common_keys(ids) | set(node.outputs)
        made = set(node.outputs)
        out: list[MFCNode] = []
        for b in self.nodes:
            if (b is node or b.name in busy or b.n_seqs != len(ids) or self.collective(b) or self.mesh_of(b) is not view
                    or not set(b.inputs) <= have or not set(b.inputs) & made
                    or self.buffer.touched(b, ids) or self.buffer.ready(b) is not None):
                continue
            mine = self.buffer.costs(ids, b.inputs)
            if mine != costs and split_balanced(ids, mine, view.mesh.dims.dp) != parts:
                continue
            out.append(b)
            have |= set(b.outputs)
            made |= set(b.outputs)
        return out

    def dispatch(self, node: MFCNode, ids: list[int], busy, chain: bool = True) -> tuple[list[MFCNode], dict[str, Reply]]:
        """Send `node` on `ids` (and, `chain`, the MFCs chained to it) to its workers: (chained
        MFCs, replies)."""
        view = self.mesh_of(node)
        costs = self.buffer.costs(ids, node.inputs)
        parts = split_balanced(ids, costs, view.mesh.dims.dp)
        chained = self.chain(node, ids, parts, busy, costs) if chain else []
        for n in (node, *chained):
            self.buffer.start(n, ids)
        # Who holds each input, for every id at once (in part order), then cut per part: what the
        # chain makes is stored by the head that runs the part.
        made, stored = set(node.outputs), set(node.inputs)
        for b in chained:
            stored |= set(b.inputs) - made
            made |= set(b.outputs)
        order = [sid for part in parts for sid in part]
        cols = self.buffer.owners(order, stored)
        starts = list(itertools.accumulate(map(len, parts), initial=0))
        # One request per group of replicas (a relay's, or one replica's): the ids of its parts in
        # order, and who holds each input of each (columns.py).
        collective = self.collective(node)
        groups = [[d] for d in range(len(parts))] if collective else view.groups
        msgs = []
        for ds in groups:
            spans = spans_of(starts, ds)
            ids = take(order, spans)
            heads = [view.heads[d] for d in ds for _ in parts[d]]
            then, made = [], set(node.outputs)
            for b in chained:
                then.append(RunMFC(b.name, ids, {k: heads if k in made else take(cols[k], spans) for k in b.inputs}))
                made |= set(b.outputs)
            msgs.append(RunMFC(node.name, ids, {k: take(cols[k], spans) for k in node.inputs}, then=then))
        if collective:  # every rank of a replica; the heads' replies are the replica's
            m = view.mesh
            futs = self.pool.request_many(self.with_clears({self.names[i]: msgs[m.dims.dp_rank(i - m.first)]
                                                            for i in m.workers}))
        else:
            futs = self.pool.request_columns([
                Columns([self.names[view.heads[d]] for d in ds], [len(parts[d]) for d in ds], msg,
                        [self.to_clear.pop(view.heads[d], []) for d in ds]) for ds, msg in zip(groups, msgs)])
        return chained, futs

    def run_step(self, step: int, metrics: dict, writer: MetricsWriter) -> None:
        # name of the first MFC -> (the MFCs sent together, ids, replies, start time)
        running: dict[str, tuple[list[MFCNode], list[int], dict[str, Reply], float]] = {}
        busy: set[str] = set()  # every MFC in `running`, chained ones included
        meshes_busy: dict[str, int] = {}  # first MFC in `running` -> the mesh it runs on
        # Each request reports once, when all its workers replied (or at the first failure): O(workers)
        # per MFC, where waking up on every reply and re-scanning every future was O(workers^2).
        events: queue.Queue = queue.Queue()
        step_t0 = time.perf_counter()
        while True:
            for node in self.nodes:
                # An MFC whose mesh is busy waits: on the workers it would only queue behind the
                # running one, and its wall time would count the wait.
                if node.name in busy or self.mesh_of(node).index in meshes_busy.values():
                    continue
                ids = self.buffer.ready(node)
                if ids is not None:
                    chained, futs = self.dispatch(node, ids, busy)
                    meshes_busy[node.name] = self.mesh_of(node).index
                    running[node.name] = ([node, *chained], ids, futs, time.perf_counter())
                    busy.update(n.name for n in running[node.name][0])
                    _report_when_done(node.name, futs, events)
            if not running:
                break
            writer.live(step, "running " + ", ".join(sorted(busy)))
            try:
                name, error = events.get(timeout=self.cfg.system.request_timeout_s)
            except queue.Empty:
                raise TimeoutError(f"MFCs {', '.join(sorted(busy))}: no reply within {self.cfg.system.request_timeout_s:g} s") from None
            if error is not None:  # a worker failed or was lost: the run cannot go on
                raise error
            nodes, ids, futs, t0 = running.pop(name)
            del meshes_busy[name]
            self.collect(nodes, ids, futs, t0, step_t0, metrics)
            busy.difference_update(n.name for n in nodes)

    def collect(self, nodes: list[MFCNode], ids: list[int], futs: dict[str, Reply], sent: float, step_t0: float,
                metrics: dict, stats: dict | None = None) -> None:
        """Take in the replies (all arrived) of `nodes`, sent as one request on `ids` at `sent`
        (perf_counter; the step's MFCs began at `step_t0`): what each stored where, its stats into
        `stats` (None: `metrics`), its time (time/NAME_s) and when it ran (timeline/NAME_*) into `metrics`."""
        name = nodes[0].name
        wall = time.perf_counter() - sent
        began = sent - step_t0
        got = [r if isinstance(r, Gathered) else Gathered([w], [len(r.ids)], r)
               for w, r in wait_all(futs, 0, f"MFC {name}").items()
               if isinstance(r, Gathered) or self.index_of[w] in self.head_set]  # the rest of a replica echoes its head
        for g in got:
            if len(g.reply.then) != len(nodes) - 1:
                raise RemoteError(f"{g.workers[0]}: MFC {name} answered {len(g.reply.then)} chained MFCs of {len(nodes) - 1}")
        owners = [g.owners(self.index_of) for g in got]
        per_node = [[g.reply for g in got]] + [[g.reply.then[k] for g in got] for k in range(len(nodes) - 1)]
        # A chain's wall time is shared out by the slowest worker's own time in each MFC.
        slowest = [max((r.seconds for r in rs), default=0.0) for rs in per_node]
        total = sum(slowest)
        for node, rs, s in zip(nodes, per_node, slowest):
            self.buffer.add_many([(own, r.ids, r.tokens, r.seqs) for own, r in zip(owners, rs)])
            self.buffer.finish(node, ids)
            merge_stats(rs, metrics if stats is None else stats)
            share = wall * s / total if total > 0 else wall / len(nodes)
            metrics[f"time/{node.name}_s"] = metrics.get(f"time/{node.name}_s", 0.0) + share
            # When it ran, in seconds since the step's MFCs began (which ran at the same time).
            metrics.setdefault(f"timeline/{node.name}_start_s", began)
            metrics[f"timeline/{node.name}_end_s"] = began = began + share
            if node.trains and node.model == self.policy:  # a critic's training is no new policy
                self.version += 1

    def log_drops(self, metrics: dict) -> None:
        """Messages dropped since this run (attempt) started, as dropped/<process>/<socket>/<reason>
        totals: the master's own, and those the workers and the manager (for itself and the
        generation servers) reported in their last heartbeat. Rollout workers' came in the
        manager's counters (counted into drop_totals by the caller)."""
        reports = [("master", os.getpid(), drops.snapshot())]
        for name, s in list(self.pool.status.items()):
            if s is not None:
                reports.append((name, s.pid, s.drops))
                reports += [(relayed, s.pid, d) for relayed, d in s.relayed_drops.items()]
        for process, pid, totals in reports:
            for k, n in self.drop_tally.update((process, pid), totals).items():
                self.drop_totals[f"{process}/{k}"] += n
        metrics.update({f"dropped/{k}": n for k, n in self.drop_totals.items()})

    def release(self, now: bool = False, ids: list[int] | None = None) -> None:
        """Forget the samples every MFC has run on (or `ids`). Each worker drops only what it holds
        (a Clear of every id to every worker was O(workers x batch) bytes per step), with its next
        Fetch or RunMFC (every head gets one each step): a round trip per worker per step saved.
        `now`: with a Clear each, waited for (the run's last step, or before stopping)."""
        ids = self.buffer.completed() if ids is None else ids
        for w, mine in self.buffer.holders(ids).items():
            self.to_clear.setdefault(w, []).extend(mine)
        self.buffer.release(ids)
        if now and self.to_clear:
            held, self.to_clear = self.to_clear, {}
            self.wait(self.pool.request_many({self.names[w]: Clear(mine) for w, mine in held.items()}), "release")

    def save(self, step: int) -> None:
        path = os.path.join(self.cfg.output_dir, "checkpoints", f"step_{step}")
        # The policy's mesh first: it swaps in the whole folder (atomically), which would take away
        # another mesh's role folder (step_N/ROLE) written into it at the same time.
        first = self.mesh_of_role[self.policy].mesh.workers
        for part in (first, [i for i in range(len(self.names)) if i not in first]):
            if part:
                self.wait(self.pool.request_many({self.names[i]: Save(path) for i in part}), "checkpoint")
        log.info("saved %s", path)

    # --- recovery -----------------------------------------------------------------------------

    def save_recover(self, step: int) -> None:
        """A recover checkpoint of the state after `step`. The manager's admission state is taken
        before the streams' waiting trajectories: a rollout that finishes in between is then both
        "running" (it will run again) and waiting in a stream, a duplicate the stream source
        discards, where the other order could lose it."""
        t0 = time.perf_counter()
        out = self.cfg.output_dir
        tmp = recover.begin(out, step)
        if self.async_mode:
            recover.write_json(os.path.join(tmp, "manager.json"), self.call_manager(Snapshot(), "snapshot"))
        self.call_all(SaveState(tmp), "recover checkpoint")
        recover.write_json(os.path.join(tmp, "master.json"),
                           recover.MasterState(step, self.version, self.source.next_id, self.source.state()))
        path = recover.commit(tmp, out, step)
        log.info("recover checkpoint %s (%.1f s)", path, time.perf_counter() - t0)

    def recover_on(self) -> bool:
        return self.cfg.recover_mode != "disabled" or self.cfg.trainer.recover_freq_steps is not None

    def resume_from(self) -> tuple[recover.MasterState, str] | None:
        """The recover checkpoint to continue from (recover_mode resume/auto), or None."""
        if self.cfg.recover_mode == "disabled":
            return None
        found = recover.latest(self.cfg.output_dir)
        if found is None:
            return None
        _, path = found
        state = recover.MasterState(**recover.read_json(os.path.join(path, "master.json")))
        saved = len([d for d in os.listdir(path) if d.startswith("model_worker-")])
        if saved != self.n_workers:
            raise ValueError(f"recover checkpoint {path} holds {saved} model workers, this run has {self.n_workers}: "
                             "resume with the allocation_mode it was written with")
        return state, path

    def _on_term(self, exit_handler, signum, frame) -> None:
        self.terminated = True
        exit_handler(signum, frame)

    def _on_preempt(self, signum, frame) -> None:
        if self.step >= self.cfg.trainer.total_steps:  # the run is done: it ends as it was going to
            log.warning("preempted after the last step: finishing the run")
        else:
            log.warning("preempted: finishing step %d, then writing a recover checkpoint and stopping", self.step + 1)
        self.preempt_requested = True

    # --- main ---------------------------------------------------------------------------------

    def configure(self, recover_from: str | None = None) -> None:
        replies = self.call_all(Configure(recover_from=recover_from), "configure", self.cfg.system.startup_timeout_s)
        calm_collector()
        if not self.async_mode:
            skipped: dict[str, int] = {}
            for r in replies.values():
                for why, n in r.skipped.items():
                    skipped[why] = skipped.get(why, 0) + n
            log.info("dataset: %d rows, %d usable, skipped %s", sum(r.n_rows for r in replies.values()),
                     sum(r.n_samples for r in replies.values()), skipped or "none")

    def begin(self) -> tuple[MetricsWriter, Ledger]:
        """Everything before the first step: signals, resuming from a recover checkpoint, the
        workers' configuration, the run's records, the base policy's evaluation, generation."""
        cfg = self.cfg
        # Preemption (the launcher got SIGTERM): checkpoint at the end of this step. SIGTERM itself
        # still means "stop now", as for every worker.
        signal.signal(signal.SIGUSR2, self._on_preempt)
        on_term = signal.getsignal(signal.SIGTERM)
        if callable(on_term):  # run_worker's exit_on_sigterm; SIG_IGN under a Slurm task runner stays
            signal.signal(signal.SIGTERM, lambda signum, frame: self._on_term(on_term, signum, frame))
        resumed, path = self.resume_from(), None
        if resumed is not None:
            state, path = resumed
            self.step, self.version, self.source.next_id = state.step, state.version, state.next_id
            print(f"realcore: resuming from step {self.step} (recover checkpoint {path})", flush=True)
        self.configure(path)
        writer = MetricsWriter(cfg.output_dir, cfg.trainer.total_steps, resume_step=self.step,
                               wandb_init=wandb_init_kwargs(cfg))
        ledger = Ledger(cfg.output_dir, resume_step=self.step)
        try:
            if resumed is not None:
                self.source.load_state(resumed[0].source, ledger)
            if cfg.eval.freq_steps and self.step == 0:  # the base policy, before anything trains
                t0 = time.perf_counter()
                metrics = {"step": 0, "version": 0, **self.evaluate()}
                writer.write({**metrics, "time/step_s": time.perf_counter() - t0})
            self.start_generation(path)
        except BaseException:
            writer.close()
            ledger.close()
            raise
        return writer, ledger

    def run(self) -> None:
        writer, ledger = self.begin()
        try:
            self.loop(writer, ledger)
        finally:
            writer.close()
            ledger.close()
        print_reward_summary(writer.path)

    def start_generation(self, path: str | None) -> None:
        """Servers start with the initial weights: give them the current version, then (async) let
        the manager admit rollouts, from the checkpoint's admission state if resuming."""
        if self.weights is not None and self.version > 0:
            self.weights.publish(self.version)
        self.published = self.version
        if self.async_mode:
            state = ManagerState()
            if path is not None:
                state = parse(ManagerState, recover.read_json(os.path.join(path, "manager.json")))
            self.counters = dict(state.counters)
            self.call_manager(Restore(state, getattr(self.weights, "path", None)), "restore")

    def loop(self, writer: MetricsWriter, ledger: Ledger) -> None:
        for step in range(self.step + 1, self.cfg.trainer.total_steps + 1):
            t0 = time.perf_counter()
            metrics: dict = {"step": step}
            groups = self.source.fetch(metrics)
            version = self.version
            self.run_step(step, metrics, writer)
            self.publish(metrics)
            if self.eval_due(step):
                metrics.update(self.evaluate())
            self.end_step(step, metrics, groups, version, t0, writer, ledger)

    def eval_due(self, step: int) -> bool:
        freq = self.cfg.eval.freq_steps
        return bool(freq) and (step % freq == 0 or step == self.cfg.trainer.total_steps)

    def publish(self, metrics: dict) -> None:
        """The generation servers get the current policy, if they have not got it yet (none when
        generation is colocated): its time and the rollout side's counters into `metrics`."""
        if self.weights is None or self.version == self.published:
            return
        t1 = time.perf_counter()
        reply = self.weights.publish(self.version)
        self.published = self.version
        metrics["time/weight_update_s"] = metrics.get("time/weight_update_s", 0.0) + time.perf_counter() - t1
        for k, total in getattr(reply, "counters", {}).items():  # this step's share of the totals
            share, self.counters[k] = total - self.counters.get(k, 0), total
            if k.startswith("dropped/"):  # a rollout worker's drops: logged as totals
                self.drop_totals[k.removeprefix("dropped/")] += share
            else:
                metrics[k] = metrics.get(k, 0) + share

    def end_step(self, step: int, metrics: dict, groups: list[Group], version: int, t0: float, writer: MetricsWriter,
                 ledger: Ledger, ids: list[int] | None = None, last: bool | None = None, save: bool = True) -> None:
        """After the step's MFCs: the ledger's rows of the `groups` trained (taken at policy
        `version`), the samples released (`ids`; None: those every MFC ran on), the metrics row,
        the checkpoints the config asks for at this step (`save`: the HF one too; `last`: as at
        the run's last step, None: whether it is); Preempted after a preemption's."""
        cfg = self.cfg
        last = step == cfg.trainer.total_steps if last is None else last
        drift = drift_warnings(metrics, cfg)
        if drift:  # one line per step, naming each figure past its threshold
            log.warning("step %d: %s", step, "; ".join(drift))
        ledger.write(step, version, ledger_rows(groups, self.buffer, version))
        self.release(now=last or self.preempt_requested, ids=ids)
        self.log_drops(metrics)
        metrics["version"] = self.version
        metrics["time/step_s"] = time.perf_counter() - t0
        self.add_throughput(metrics)
        writer.write(metrics)
        self.step = step
        freq = cfg.trainer.save_freq_steps
        if save and (last or (freq and step % freq == 0)):
            self.save(step)
        rfreq = cfg.trainer.recover_freq_steps
        if self.preempt_requested or (rfreq and step % rfreq == 0) or (last and self.recover_on()):
            self.save_recover(step)
        if self.preempt_requested and not last:
            raise Preempted(f"preempted after step {step}")

    def add_throughput(self, metrics: dict) -> None:
        """Tokens per second of generation and of the policy's training this step."""
        def took(nodes) -> float:
            return sum(metrics.get(f"time/{n.name}_s", 0.0) for n in nodes)

        gen_s = metrics["time/step_s"] if self.async_mode else took(n for n in self.nodes if mfc_spec(n.type).generates)
        add_throughput(metrics, gen_s, took(n for n in self.nodes if n.trains and n.model == self.policy))

    def evaluate(self) -> dict[str, float]:
        """eval/* of the policy just published (realcore.trainer.evaluation), by model worker 0."""
        name = self.names[0]
        return self.wait({name: self.pool.request(name, Evaluate(self.version))}, "evaluate")[name].metrics

    def shutdown(self) -> None:
        """Ask every live worker to exit (best effort, bounded), then close sockets. Not after a
        SIGTERM: the launcher (or task runner) that sent it stops every process itself, and a worker
        that died (often why the run stops) would hold the master here until the deadline."""
        if self.terminated:
            self.pool.close()
            return
        try:
            futs = self.pool.request_many({n: Exit() for n in self.pool.names if n not in self.pool.lost})
            wait_all(futs, self.cfg.system.shutdown_timeout_s, "exit")
        except Exception as e:  # workers may already be gone; the launcher kills leftovers
            log.warning("shutdown: %s", e)
        self.pool.close()
