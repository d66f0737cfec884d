"""Master scale benchmark: the real Master driving N simulated model workers over the real wire.

    python bench/master_scale.py [--workers 10 100 1000] [--steps K] [--procs P] [--relay-group G ...]
                                 [--relay-fanout F ...] [--quick]

For each N, P simulator processes (multiprocessing spawn) each bind N/P ROUTER sockets on
127.0.0.1 and serve them all from ONE thread with a zmq.Poller. Each simulated worker publishes
its address with the name resolver exactly like a model worker (key `keys.model_worker(cfg, i)`)
and speaks `wire` (msgpack + HMAC, the run's secret) with the typed messages of
realcore.transport.protocol: it answers PING with a Status,
CONFIGURE/FETCH/RUN_MFC with metadata shaped like a real ModelWorker's replies (sequence
lengths, no tensors; the ids in a FETCH/RUN_MFC's `clear` dropped first), CLEAR/SAVE/PUBLISH_WEIGHTS with {}, EXIT with {} (then it stops). Replies
are instant, so a step's time is the master's own scheduling plus the wire.

The benchmark's main process builds the `ppo-math` config (allocation d{N}p1t1, batch_size 2N,
so every worker gets work in every MFC), constructs `Master`, calls `configure()`, then runs K
steps of `source.fetch; run_step; release; MetricsWriter.write` (Master.run's sequence in sync mode
without generation servers) and `shutdown()`. The first step is a warm-up when K >= 3.

Prints a markdown table per N: median wall-clock ms per step, the master process's CPU ms per step
(all its threads: the main thread and the pool's I/O thread), the wall-clock split (fetch / MFC
dispatch+collect / release / metrics log), Master() + configure() time, the master process's peak
RSS during that N (VmHWM reset before each N; the baseline includes torch and the registries), its
RSS after steps 1, 10, 50 and 100 (at 1000 workers it grows until each connection has carried
~225 messages, ~70 steps at ~3.5 per step with pings, then stays flat: libzmq's per-connection
queues reaching their working size; bench/zmq_queue_rss.py: a bare pyzmq ROUTER sending to 1000
peers grows by the same ~55 MB over its first ~225 messages per peer and not after), how many samples workers still held when the next step's Fetch came
(should be 0: the master's release of a step travels with each worker's next request, and the
simulated workers apply it like model workers do), and what is left in the master's sample buffer
and pending-request map and on the workers after the last step (should be 0).
Note: 2 cores shared by the master and the simulators, so the simulators' CPU time competes: the
wall-clock time includes their share, the CPU column is the master's own.
`--quick` (N in 4, 16; 2 steps) is the smoke test's run.
"""

import argparse
import contextlib
import io
import os
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

GROUP = 4  # sequences per prompt (generation.n_samples of ppo-math), set from the config
READY_TIMEOUT_S = 180.0  # spawn + torch import of the simulators, on a loaded 2-core machine
TIMEOUT_S = 120.0  # the master's request/startup deadlines, and the simulators' idle deadline
LIFETIME_S = 1800.0  # a simulator never outlives this
NOT_STEP = ("PING", "CONFIGURE", "EXIT", "RELAY", "SPLIT")  # not counted as a step's requests to workers


# --- simulated model workers ----------------------------------------------------------------


def _os_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


class _SimWorker:
    __slots__ = ("index", "state", "stored", "exited", "relay")

    def __init__(self, index: int):
        self.index, self.state, self.stored, self.exited, self.relay = index, "ready", set(), False, None


def _plen(sid: int) -> int:
    return 12 + sid % 17  # a plausible prompt length, deterministic per sample


def _commands(msg) -> set:
    """The commands a message carries: its own, or those it relays (a RELAY of RELAYs: theirs)."""
    from realcore.transport.protocol import Cmd, Relay, Split

    if isinstance(msg, Split):
        return {msg.cmd}
    if not isinstance(msg, Relay):
        return {int(msg.CMD)}
    out = set()
    for _, h in msg.requests:
        body = h.get("body") or {}
        if h.get("cmd") == Cmd.RELAY:
            out |= {sub.get("cmd") for _, sub in body.get("requests", [])}
        else:
            out.add(body.get("cmd") if h.get("cmd") == Cmd.SPLIT else h.get("cmd"))
    return out


def _serve(assign: list, secret: bytes, root: str, spec: dict, out_q) -> None:
    """Host the workers in `assign` [(index, name-resolve key)] on one thread; report when done."""
    import zmq

    from realcore.transport import addresses, wire
    from realcore.transport.node_relay import NodeRelay
    from realcore.transport.name_resolve import FileNameResolver
    from realcore.transport.protocol import (BadBody, Clear, Configure, Configured, Exit, Fetch, Fetched, MFCDone, Ping,
                                          Relay, RunMFC, Split, Status, parse_request, reply)

    pid = os.getpid()
    ctx = zmq.Context(io_threads=1)
    ctx.set(zmq.MAX_SOCKETS, len(assign) + 64)
    resolver = FileNameResolver(root, secret)
    workers: dict = {}
    endpoints: dict = {}  # socket -> its wire.Endpoint (each simulated worker is a receiver of its own)
    relays: dict = {}  # a NodeRelay's socket -> the relay (made when a worker gets its first RELAY)
    poller = zmq.Poller()
    try:
        for index, key in assign:
            s = ctx.socket(zmq.ROUTER)
            s.setsockopt(zmq.LINGER, 1000)
            wire.secure(s, secret, server=True, limits=wire.Limits.of())  # as a worker's (no handshake monitor)
            port = s.bind_to_random_port("tcp://127.0.0.1")  # loopback only
            addr = f"tcp://127.0.0.1:{port}"
            workers[s] = _SimWorker(index)
            endpoints[s] = wire.Endpoint(secret, f"model_worker/{index}", socket="control", address=addr)
            poller.register(s, zmq.POLLIN)
            resolver.put(key, addresses.to_json(addresses.ModelWorkerAddress(addr, addr, pid)), replace=True)
        out_q.put(("ready", pid, len(assign)))

        keys, group, mfcs = sorted(spec["dataset_keys"]), spec["group"], spec["mfcs"]
        dp, size = spec["dp"], spec["dataset_size"]
        counts: dict[str, int] = {}
        from_master = 0  # requests that came from the master itself (the rest came through a relay)
        dropped, live = 0, len(workers)
        held_at_fetch = 0  # samples a worker still held when a Fetch came (its release went missing)
        last_msg, end = time.monotonic(), time.monotonic() + LIFETIME_S

        def handle(w: _SimWorker, msg):
            if isinstance(msg, Configure):
                w.state = "running"
                rows = size // dp + (1 if w.index < size % dp else 0)
                return Configured(rows, rows)
            nonlocal held_at_fetch
            if isinstance(msg, (Fetch, RunMFC)):
                w.stored.difference_update(msg.clear)  # the master's release, carried by the next request
            if isinstance(msg, Fetch):
                held_at_fetch += len(w.stored)  # sync: every earlier sample was released by now
                ids = list(range(msg.first_id, msg.first_id + msg.n))
                w.stored.update(ids)
                return Fetched(ids, {k: [_plen(sid) if k != "answer" else 3 for sid in ids] for k in keys},
                               {k: [1] * len(ids) for k in keys}, [f"d{w.index}:{sid}" for sid in ids])
            if isinstance(msg, RunMFC):
                node, ids = mfcs[msg.mfc], msg.ids
                w.stored.update(ids)
                # sizes of `group` sequences per sample: rewards 1 token each, the rest prompt + 16 + j
                tokens = {k: [group if k == "rewards" else group * (_plen(sid) + 16) + group * (group - 1) // 2
                              for sid in ids] for k in node["outputs"]}
                n = len(ids) * (1 if node["first_input"] in keys else group)
                return MFCDone(ids, tokens, {k: [group] * len(ids) for k in tokens}, dict(node["stats"]), n,
                               then=[handle(w, m) for m in msg.then])
            if isinstance(msg, Clear):
                w.stored.difference_update(msg.ids)
                return None
            raise ValueError(f"unexpected command {msg.CMD.name}")

        # After the last EXIT, serve on while a relay still waits for others' replies (up to 5 s, as
        # ControlServer.close does): a relay of relays answers only once the relays under it did.
        grace = float("inf")
        while (live or any(r.busy() for r in relays.values())) and time.monotonic() < min(end, grace):
            if not live and grace == float("inf"):
                grace = time.monotonic() + 5
            events = poller.poll(200)
            now = time.monotonic()
            if not events:
                if now - last_msg > TIMEOUT_S:
                    break  # the master is gone
                continue
            last_msg = now
            for s, _ in events:
                if s in relays:  # the real relay of realcore.transport.node_relay, as a model worker runs it
                    relays[s].on_readable()
                    continue
                w = workers[s]
                while True:
                    try:
                        frames = s.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        peer, header, _ = endpoints[s].open(frames, router=True)
                        rid, msg = parse_request(header)
                    except (wire.BadMessage, BadBody, KeyError, ValueError, TypeError):
                        dropped += 1
                        continue
                    counts[msg.CMD.name] = counts.get(msg.CMD.name, 0) + 1
                    if peer.sender.startswith("master#") and not _commands(msg) <= {int(Ping.CMD), int(Configure.CMD), int(Exit.CMD)}:
                        from_master += 1  # a step's message from the master (a RELAY counts once)
                    if isinstance(msg, (Relay, Split)):
                        if w.relay is None:
                            w.relay = NodeRelay(ctx, secret, f"model_worker/{w.index}",
                                                lambda p, h, s=s: wire.send(s, h, endpoint=endpoints[s], to=p))
                            relays[w.relay.sock] = w.relay
                            poller.register(w.relay.sock, zmq.POLLIN)
                        (w.relay.forward if isinstance(msg, Relay) else w.relay.split)(peer, rid, msg)
                        continue
                    if isinstance(msg, Ping):
                        out = reply(rid, Status(w.state, pid, dropped, {"stored": len(w.stored)}))
                    elif isinstance(msg, Exit):
                        out = reply(rid)
                        if not w.exited:
                            w.exited, live = True, live - 1
                    else:
                        try:
                            out = reply(rid, handle(w, msg))
                        except Exception as e:
                            out = reply(rid, error=f"{msg.CMD.name}: {type(e).__name__}: {e}")
                    wire.send(s, out, endpoint=endpoints[s], to=peer)
            for r in relays.values():
                if r.busy():
                    r.expire(now)
        out_q.put(("done", pid, len(assign), _os_threads(), counts, dropped, held_at_fetch,
                   sum(len(w.stored) for w in workers.values()), from_master))
    finally:
        for r in relays.values():
            r.close()
        for s in workers:
            s.close(linger=1000)  # lets the last EXIT replies out
        ctx.term()


# --- the master side ---------------------------------------------------------------------------


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


def _wait_msgs(q, procs, kind: str, n: int, timeout_s: float) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"simulators: {len(got)} of {n} '{kind}' reports within {timeout_s:g} s")
        try:
            msg = q.get(timeout=min(0.5, left))
        except queue.Empty:
            if kind == "ready" and any(p.exitcode is not None for p in procs):
                raise RuntimeError(f"a simulator process died: exit codes {[p.exitcode for p in procs]}")
            continue
        if msg[0] == kind:
            got.append(msg)
    return got


def run_one(n: int, steps: int, n_procs: int, relay_group: int, fanout: int = 8) -> dict:
    import multiprocessing as mp

    from realcore.dfg.graph import build_graph
    from realcore.launch.config_loader import load_config
    from realcore.transport import wire
    from realcore.transport import keys as rc_keys
    from realcore.api.registry import source_keys
    from realcore.trainer.master import Master
    from realcore.trainer.metrics import MetricsWriter

    tmp = tempfile.mkdtemp(prefix="rc-master-scale-")
    procs: list = []
    try:
        cfg = load_config([
            "experiment=ppo-math", "model=tiny", f"allocation_mode=d{n}p1t1", f"trainer.batch_size={2 * n}",
            f"trainer.total_steps={steps}", f"trial_name=scale{n}", f"output_dir={tmp}/out",
            f"system.name_resolve.root={tmp}/name_resolve", f"system.startup_timeout_s={TIMEOUT_S}",
            f"system.request_timeout_s={TIMEOUT_S}", "system.shutdown_timeout_s=20",
            f"system.relay_group_size={relay_group}", f"system.relay_fanout={fanout}",
        ])
        os.makedirs(cfg.output_dir, exist_ok=True)
        secret = wire.write_secret(os.path.join(tmp, "secret"))
        dfg = build_graph(cfg, source_keys(cfg))
        spec = {
            "dataset_keys": list(source_keys(cfg)), "group": cfg.generation.n_samples, "dp": n,
            "dataset_size": cfg.dataset.size,
            "mfcs": {name: {"outputs": list(node.outputs), "first_input": node.inputs[0],
                            "stats": ({"loss": 0.1, "ppo/kl": 0.01, "ppo/entropy": 2.0, "ppo/clip_frac": 0.1}
                                      if node.trains else {"reward/mean": 0.5} if node.type in ("reward", "generate") else {})}
                     for name, node in dfg.nodes.items()},
        }
        n_procs = min(n_procs, n)
        # Contiguous blocks: a simulator process plays whole nodes (a relay's workers sit together).
        bounds = [n * p // n_procs for p in range(n_procs + 1)]
        assign = [[(i, rc_keys.model_worker(cfg, i)) for i in range(bounds[p], bounds[p + 1])] for p in range(n_procs)]
        mpc = mp.get_context("spawn")
        out_q = mpc.Queue()
        procs = [mpc.Process(target=_serve, args=(a, secret, cfg.system.name_resolve.root, spec, out_q), daemon=True)
                 for a in assign]
        for p in procs:
            p.start()
        _wait_msgs(out_q, procs, "ready", n_procs, READY_TIMEOUT_S)

        _reset_peak_rss()
        t0 = time.perf_counter()
        master = Master(cfg, secret, n)
        try:
            master.configure()
            setup_ms = (time.perf_counter() - t0) * 1e3
            writer = MetricsWriter(cfg.output_dir, steps)
            split: dict[str, list[float]] = {k: [] for k in ("step", "fetch", "mfc", "release", "log")}
            cpu: list[float] = []  # the master process's CPU time per step (all its threads)
            rss: list[int] = []
            try:
                for step in range(1, steps + 1):
                    metrics: dict = {"step": step}
                    c0, t0 = time.process_time(), time.perf_counter()
                    master.source.fetch(metrics)
                    t1 = time.perf_counter()
                    master.run_step(step, metrics, writer)
                    t2 = time.perf_counter()
                    master.release(now=step == steps)  # as Master.loop: Clears go with the next step's requests
                    t3 = time.perf_counter()
                    metrics["version"] = master.version
                    metrics["time/step_s"] = t3 - t0
                    with contextlib.redirect_stdout(io.StringIO()):  # its console line would break the table
                        writer.write(metrics)
                    t4 = time.perf_counter()
                    cpu.append((time.process_time() - c0) * 1e3)
                    for k, dt in zip(split, (t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                        split[k].append(dt * 1e3)
                    rss.append(_status_kb("VmRSS"))
            finally:
                writer.close()
            left = len(master.buffer) + len(master.pool._pending)
            master_threads = _os_threads()
        finally:
            master.shutdown()
        peak_kb = _status_kb("VmHWM")
        done = _wait_msgs(out_q, procs, "done", n_procs, TIMEOUT_S)
        for p in procs:
            p.join(timeout=10)
        timed = slice(1, None) if steps >= 3 else slice(None)
        med = {k: statistics.median(v[timed]) for k, v in split.items()}
        med["cpu"] = statistics.median(cpu[timed])
        counts: dict[str, int] = {}
        for d in done:
            for c, k in d[4].items():
                counts[c] = counts.get(c, 0) + k
        return {
            "n": n, "group": relay_group, "fanout": fanout, "tops": len(set(master.pool.top_of.values())), "mfcs": list(dfg.order()), **med, "setup": setup_ms, "peak_mb": peak_kb / 1024, "rss": rss,
            "left": left + sum(d[7] for d in done), "held": sum(d[6] for d in done), "procs": n_procs, "sim_threads": [d[3] for d in done],
            "master_threads": master_threads, "msgs_per_step": sum(v for c, v in counts.items() if c not in NOT_STEP) / steps,
            "by_command": {c: v / steps for c, v in sorted(counts.items()) if c not in NOT_STEP},
            "pings": counts.get("PING", 0), "dropped": sum(d[5] for d in done),
            "from_master": sum(d[8] for d in done) / steps, "relays": len(set(master.pool.relay_of.values())),
        }
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--steps", type=int, default=100, help="steps per N (the first is a warm-up when >= 3)")
    ap.add_argument("--procs", type=int, default=4, help="simulator processes")
    ap.add_argument("--quick", action="store_true", help="N in 4, 16; 2 steps (smoke test)")
    ap.add_argument("--relay-group", type=int, nargs="+", default=[8],
                    help="system.relay_group_size values to run each N with (1: the master sends to every worker)")
    ap.add_argument("--relay-fanout", type=int, nargs="+", default=[8],
                    help="system.relay_fanout values to run each N and group with (1: the master sends to every relay)")
    args = ap.parse_args()
    if args.quick:
        args.workers, args.steps = [4, 16], 2

    import torch

    from realcore.launch.plugins import load_plugins

    torch.set_num_threads(1)
    load_plugins([])
    t_start = time.perf_counter()
    rows = [run_one(n, args.steps, args.procs, g, f) for n in args.workers for g in args.relay_group
            for f in (args.relay_fanout if g > 1 else [1])]

    timed = args.steps - 1 if args.steps >= 3 else args.steps
    print(f"master scale benchmark: ppo-math (MFCs {', '.join(rows[0]['mfcs'])}), d<N>p1t1, batch_size 2N, {args.steps} steps per N "
          f"(median of {timed}), simulated workers answer instantly over tcp://127.0.0.1, pid {os.getpid()}\n")
    print("| workers | relay group | relay fanout | master messages/step | step ms (wall, median) | master CPU ms/step | fetch ms "
          "| MFC dispatch+collect ms | release ms | log ms | Master()+configure ms | master peak RSS MB "
          "| RSS MB at step 1 / 10 / 50 / 100 | held at next fetch | left after release |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        at = " / ".join(f"{r['rss'][i - 1] / 1024:.1f}" if len(r["rss"]) >= i else "-" for i in (1, 10, 50, 100))
        print(f"| {r['n']} | {r['group']} | {r['fanout']} | {r['from_master']:.1f} | {r['step']:.1f} | {r['cpu']:.1f} | {r['fetch']:.1f} "
              f"| {r['mfc']:.1f} | {r['release']:.1f} "
              f"| {r['log']:.1f} | {r['setup']:.1f} | {r['peak_mb']:.1f} | {at} | {r['held']} | {r['left']} |")
    print()
    for r in rows:
        print(f"N={r['n']}, relay group {r['group']} ({r['relays']} relays, {r['tops']} of them passing on the others' messages): simulated workers hosted by {r['procs']} processes, 1 Python thread each "
              f"(OS threads per process, incl. ZeroMQ's I/O + reaper and the report queue's feeder: {r['sim_threads']}); "
              f"master process OS threads {r['master_threads']}; {r['msgs_per_step']:.0f} requests/step to workers "
              f"({', '.join(f'{c} {v:g}' for c, v in r['by_command'].items())}), "
              f"{r['pings']} heartbeats in all; "
              f"{r['dropped']} bad messages")
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
