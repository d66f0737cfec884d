"""Control plane: requests and replies, forged messages, heartbeats, deadlines, pause/start."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from realcore.launch.config_loader import import_user_modules, load_config
from realcore.transport import drops, wire
from realcore.trainer.buffer import SampleBuffer, split_balanced
from realcore.transport.control import ControlServer
from realcore.transport.pool import WorkerPool
from realcore.transport.reply import wait_all
from realcore.transport.protocol import (Clear, Exit, Fetch, Fetched, Pause, RemoteError, Start,
                                      Status, WorkerLost, request)
from test_buffer import sizes
from test_relay import serve as serve_with

SECRET = b"s" * 32


def serve(server: ControlServer, stop: threading.Event, handled: list | None = None):
    """A minimal worker loop: FETCH echoes its fields back, CLEAR fails, the rest succeed."""
    while not stop.is_set():
        try:
            peer, rid, msg = server.requests.get(timeout=0.1)
        except Exception:
            continue
        if handled is not None:
            handled.append(msg)
        if isinstance(msg, Clear):
            server.send_reply(peer, rid, error="no such samples")
        elif isinstance(msg, Fetch):
            server.send_reply(peer, rid, Fetched([msg.first_id], {}, {}, [f"n={msg.n}"]))
        else:
            server.send_reply(peer, rid)


@pytest.fixture
def pair():
    server = ControlServer("127.0.0.1", SECRET, status=lambda: Status("running", 1), name="w0")
    stop = threading.Event()
    server.handled = []  # what the worker loop executed
    t = threading.Thread(target=serve, args=(server, stop, server.handled), daemon=True)
    t.start()
    pool = WorkerPool({"w0": server.address}, SECRET, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0)
    yield server, pool
    stop.set()
    pool.close()
    server.close()


def test_request_reply_and_remote_error(pair):
    server, pool = pair
    assert pool.request("w0", Fetch(7, 3)).result(5) == Fetched([7], {}, {}, ["n=3"])
    with pytest.raises(RemoteError, match="w0: no such samples"):
        pool.request("w0", Clear([1])).result(5)


def test_malformed_bodies_are_dropped_and_counted(pair):
    """A body that does not fit its command's dataclass (missing, unknown or mistyped field) is
    dropped at the I/O thread, like a forged message; the worker keeps serving."""
    server, pool = pair
    sock = zmq.Context.instance().socket(zmq.DEALER)
    wire.secure(sock, SECRET, server=False, limits=wire.Limits.of())  # past CURVE: the run's keys
    sock.connect(server.address)
    client = wire.Endpoint(SECRET, "tester", socket="test")
    for body in ({"first_id": 1}, {"first_id": 1, "n": 2, "evil": 3}, {"first_id": "x", "n": 2}):
        wire.send(sock, {"cmd": int(Fetch.CMD), "rid": 5, "body": body}, endpoint=client, to=server.address)
    wire.send(sock, {"cmd": 999, "rid": 5, "body": {}}, endpoint=client, to=server.address)
    sock.close(linger=1000)
    deadline = time.time() + 5
    while server.dropped < 4 and time.time() < deadline:
        time.sleep(0.02)
    assert server.dropped == 4 and server.requests.empty()
    assert pool.request("w0", Fetch(1, 1)).result(5).ids == [1]


def test_forged_message_dropped_and_counted(pair):
    server, pool = pair
    sock = zmq.Context.instance().socket(zmq.DEALER)
    wire.secure(sock, SECRET, server=False, limits=wire.Limits.of())  # past CURVE: the run's keys
    sock.connect(server.address)
    wire.send(sock, request(Exit(), 7), endpoint=wire.Endpoint(b"x" * 32, "forger", socket="test"), to=server.address)
    sock.send_multipart([b"garbage"])
    sock.close(linger=1000)
    deadline = time.time() + 5
    while server.dropped < 2 and time.time() < deadline:
        time.sleep(0.02)
    assert server.dropped == 2
    assert server.requests.empty()  # the forged EXIT never reached the worker's loop
    pool.request("w0", Start()).result(5)
    time.sleep(0.3)
    assert pool.status["w0"].dropped >= 2 and pool.status["w0"].state == "running"  # the process's drops (all tests')
    assert pool.status["w0"].drops["control/mac"] >= 1 and pool.status["w0"].drops["control/malformed"] >= 1


def _spy(endpoint: wire.Endpoint) -> list:
    """Capture what `endpoint` seals (the frames as they go on the wire)."""
    captured, seal = [], endpoint.seal

    def seal_and_keep(*args, **kwargs):
        frames = seal(*args, **kwargs)
        captured.append([bytes(f) for f in frames])
        return frames

    endpoint.seal = seal_and_keep
    return captured


def _wait(cond, timeout_s=5.0):
    deadline = time.time() + timeout_s
    while not cond() and time.time() < deadline:
        time.sleep(0.02)
    return cond()


def test_a_replayed_request_is_dropped_and_counted(pair):
    """A FETCH the master really sent, captured and sent again by someone else (a new connection,
    as an attacker on the host would): the worker drops it (replay) and executes the FETCH once;
    sent to another worker, it is misaddressed. Both are counted, and reported in PING."""
    server, pool = pair
    captured = _spy(pool.endpoint)
    assert pool.request("w0", Fetch(7, 3)).result(5).ids == [7]
    fetch = next(f for f in captured if b"first_id" in f[0])
    other = ControlServer("127.0.0.1", SECRET, status=lambda: Status("running", 2), name="w1")
    before, dropped = drops.snapshot(), server.dropped
    try:
        for address in (server.address, server.address, other.address):
            attacker = zmq.Context.instance().socket(zmq.DEALER)
            wire.secure(attacker, SECRET, server=False, limits=wire.Limits.of())  # an insider (CURVE keys)
            attacker.connect(address)
            attacker.send_multipart(fetch)
            attacker.close(linger=1000)
        assert _wait(lambda: server.dropped == dropped + 2 and other.dropped == 1)
    finally:
        other.close()
    assert [m for m in server.handled if isinstance(m, Fetch)] == [Fetch(7, 3)]  # executed once
    assert other.requests.empty()
    after = drops.snapshot()
    assert after["control/replay"] - before.get("control/replay", 0) == 2
    assert after["control/misaddressed"] - before.get("control/misaddressed", 0) == 1
    assert _wait(lambda: pool.status["w0"].drops.get("control/replay", 0) >= after["control/replay"])
    assert pool.request("w0", Fetch(8, 1)).result(5).ids == [8]  # the real master goes on


def test_a_replayed_reply_is_dropped():
    """A reply replayed to the master (its socket gets the same reply twice) resolves nothing twice."""
    server = ControlServer("127.0.0.1", SECRET, status=lambda: Status("running", 1), name="w0")
    captured = _spy(server.endpoint)
    stop = threading.Event()
    threading.Thread(target=serve, args=(server, stop), daemon=True).start()
    pool = WorkerPool({"w0": server.address}, SECRET, heartbeat_interval_s=10, heartbeat_timeout_s=60)
    try:
        assert pool.request("w0", Fetch(1, 1)).result(5).ids == [1]
        reply = next(f for f in captured if b"first_id" not in f[1] and b"n=1" in f[1])
        before, counted = pool.dropped, drops.snapshot().get("pool/replay", 0)
        pool._on_reply([pool._route["w0"], *reply[1:]])  # as if it arrived again on the master's socket
        assert pool.dropped == before + 1 and drops.snapshot()["pool/replay"] == counted + 1
    finally:
        stop.set()
        pool.close()
        server.close()


def test_master_logs_every_process_drops_as_totals():
    """dropped/<process>/<socket>/<reason>: totals of this attempt, from heartbeat Status (a restarted
    process, a new pid, counts from zero again) and relayed ones (the manager's generation servers)."""
    import collections
    from types import SimpleNamespace

    from realcore.trainer.master import Master

    status = {"model_worker/0": Status("running", 11, drops={"control/replay": 2}),
              "gserver_manager": Status("running", 12, relayed_drops={"gen_server/0": {"weights/mac": 4}}),
              "model_worker/1": None}
    m = SimpleNamespace(pool=SimpleNamespace(status=status), drop_tally=drops.Tally(), drop_totals=collections.Counter())
    own = drops.snapshot()
    metrics = {}
    Master.log_drops(m, metrics)
    assert metrics["dropped/model_worker/0/control/replay"] == 2
    assert metrics["dropped/gen_server/0/weights/mac"] == 4
    assert all(metrics[f"dropped/master/{k}"] == n for k, n in own.items())
    status["model_worker/0"] = Status("running", 13, drops={"control/replay": 1})  # restarted
    Master.log_drops(m, metrics)
    assert metrics["dropped/model_worker/0/control/replay"] == 3 and metrics["dropped/gen_server/0/weights/mac"] == 4


def test_lost_worker_fails_pending_requests(pair):
    server, pool = pair
    server.close()  # stops answering, including pings
    fut = pool.request("w0", Fetch(0, 1))
    with pytest.raises(WorkerLost, match="w0: no heartbeat for 1 s"):
        fut.result(5)
    with pytest.raises(WorkerLost):
        pool.request("w0", Fetch(0, 1)).result(1)


def test_reconnect_to_a_restarted_worker(pair):
    """A worker restarted at a new address: pending requests fail (the caller retries), the pool
    then talks to the new one and its heartbeats count again."""
    server, pool = pair
    server.close()
    fut = pool.request("w0", Fetch(0, 1))
    again = ControlServer("127.0.0.1", SECRET, status=lambda: Status("running", 2), name="w0")
    stop = threading.Event()
    threading.Thread(target=serve, args=(again, stop), daemon=True).start()
    try:
        pool.reconnect("w0", again.address)
        with pytest.raises(WorkerLost, match="restarted"):
            fut.result(5)
        assert pool.request("w0", Fetch(3, 1)).result(5).ids == [3]
        time.sleep(1.5)  # longer than the heartbeat deadline: the new process answers them
        assert "w0" not in pool.lost and pool.status["w0"].pid == 2
    finally:
        stop.set()
        again.close()


def reconnect_churn(seconds: float, n_workers: int) -> int:
    """Workers answer requests and heartbeats while, over and over, one of them is replaced by a
    new process at a new address (WorkerPool.reconnect). Returns the replacements made."""
    def start(i):
        server = ControlServer("127.0.0.1", SECRET, status=lambda: Status("running", 1), name=f"w{i}")
        stop = threading.Event()
        threading.Thread(target=serve, args=(server, stop), daemon=True).start()
        return server, stop

    servers = [start(i) for i in range(n_workers)]
    pool = WorkerPool({f"w{i}": s.address for i, (s, _) in enumerate(servers)}, SECRET,
                      heartbeat_interval_s=0.005, heartbeat_timeout_s=5.0)
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        futs = [pool.request(f"w{j}", Fetch(j, 1)) for j in range(n_workers) for _ in range(5)]
        i = n % n_workers
        servers[i][0].close()
        servers[i][1].set()
        servers[i] = start(i)
        pool.reconnect(f"w{i}", servers[i][0].address)
        for f in futs:
            try:
                f.result(5)
            except WorkerLost:
                pass  # pending on the replaced one
        n += 1
    pool.close()
    for server, stop in servers:
        stop.set()
        server.close()
    return n


def test_a_reply_sent_while_or_after_the_server_closes_is_dropped_not_a_crash():
    """A worker loop that answers while another thread closes its server (shutdown, or the churn
    below) used to send on the closed waker socket: ZMQError, or a segfault in libzmq (CI)."""
    code = """if True:
        import threading
        from realcore.transport.control import ControlServer
        from realcore.transport.protocol import Status
        from realcore.transport.wire import Peer
        for _ in range(20):
            server = ControlServer("127.0.0.1", b"s" * 32, status=lambda: Status("running", 1), name="w")
            go, errors = threading.Event(), []
            def answer():
                go.wait()
                try:
                    for rid in range(2000):
                        server.send_reply(Peer("x", b"x"), rid)
                except Exception as e:
                    errors.append(e)
            t = threading.Thread(target=answer)
            t.start()
            go.set()
            server.close(relay_grace_s=0.0)
            t.join()
            assert not errors, errors
        print("ok")
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split()[-1] == "ok", done.stderr[-2000:]


def test_reconnects_under_load_do_not_abort_the_pool():
    """libzmq aborts (Assertion failed: !_more, src/fq.cpp) a ROUTER that hears from several peers
    when a connection ends while it is between the frames of a message: replies of several frames
    did that to the pool within a second of this churn (and once in CI, in the test above). Every
    message is one frame now. In a child process, since the failure is an abort."""
    code = "import test_control; print(test_control.reconnect_churn(3.0, 2))"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) > 50  # the churn did happen


def test_wait_all_deadline_names_late_workers(pair):
    from concurrent.futures import Future

    with pytest.raises(TimeoutError, match="configure: no reply from w1 within 0.2 s"):
        wait_all({"w1": Future()}, 0.2, "configure")


def test_model_worker_pause_holds_requests(tmp_path):
    from realcore.trainer.model_worker import ModelWorker

    cfg = load_config(["experiment=ppo-math", f"output_dir={tmp_path}", f"system.name_resolve.root={tmp_path}/nr"])
    import_user_modules(cfg)
    worker = ModelWorker(cfg, 0, 1, SECRET)
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    pool = WorkerPool({"mw0": worker.control.address}, SECRET, heartbeat_interval_s=0.1, heartbeat_timeout_s=5)
    try:
        pool.request("mw0", Pause()).result(5)
        held = pool.request("mw0", Clear([1]))
        time.sleep(0.5)
        assert not held.done()  # paused: queued, not executed
        time.sleep(0.2)
        assert pool.status["mw0"].state == "paused"  # pings still answered
        pool.request("mw0", Start()).result(5)
        held.result(5)
        pool.request("mw0", Exit()).result(5)
        t.join(5)
        assert not t.is_alive()
    finally:
        pool.close()
        worker.close()


def test_buffer_readiness_and_balanced_split():
    cfg = load_config(["experiment=ppo-math", "output_dir=/tmp/unused"])
    import_user_modules(cfg)
    from realcore.api.registry import dataset_keys
    from realcore.dfg.graph import build_graph

    dfg = build_graph(cfg, dataset_keys(cfg.dataset))
    nodes = [dfg.nodes[n] for n in dfg.order()]
    buf = SampleBuffer(nodes)
    n = cfg.trainer.batch_size
    source = {"prompt_ids": [[5]] * n, "answer": [[2]] * n, "question": [[3]] * n, "fields": [[4]] * n}
    buf.add([0] * n, list(range(n)), *sizes(source))  # what the built-in datasets' rows hold
    gen, ref = dfg.nodes["actor_gen"], dfg.nodes["ref_inf"]
    assert buf.ready(ref) is None and buf.ready(gen) == list(range(n))
    buf.start(gen, list(range(n)))
    assert buf.ready(gen) is None  # running: not handed out twice
    buf.add([1] * n, list(range(n)), *sizes({k: [[9, 9]] * n for k in ("input_ids", "loss_mask", "behav_logprobs", "rewards")}))
    buf.finish(gen, list(range(n)))
    assert buf.ready(ref) == list(range(n))
    assert buf.owners([0], ["input_ids", "loss_mask", "answer"]) == {"input_ids": [1], "loss_mask": [1], "answer": [0]}
    assert buf.completed() == []

    parts = split_balanced(list(range(6)), [10, 1, 1, 1, 1, 6], 2)
    assert sorted(len(p) for p in parts) == [3, 3]
    assert sorted(sum([10, 1, 1, 1, 1, 6][i] for i in p) for p in parts) == [8, 12]  # the best split with equal counts


def test_one_message_to_several_workers_is_serialized_once(monkeypatch):
    """A fan-out of one message object (every rank of a replica gets the same RunMFC) builds its
    body once; each worker still gets it under its own request id."""
    import realcore.transport.pool as control
    from realcore.transport import protocol

    servers = [ControlServer("127.0.0.1", SECRET, status=lambda: Status("running", 1), name=f"w{i}") for i in range(3)]
    stop = threading.Event()
    for s in servers:
        threading.Thread(target=serve, args=(s, stop), daemon=True).start()
    pool = WorkerPool({f"w{i}": s.address for i, s in enumerate(servers)}, SECRET, heartbeat_interval_s=0.1,
                      heartbeat_timeout_s=5.0)
    built = []
    monkeypatch.setattr(control, "to_body", lambda msg: built.append(msg) or protocol.to_body(msg))
    try:
        same, other = Fetch(7, 3), Fetch(9, 1)
        got = wait_all(pool.request_many({"w0": same, "w1": same, "w2": other}), 10, "fetch")
        assert got == {"w0": Fetched([7], {}, {}, ["n=3"]), "w1": Fetched([7], {}, {}, ["n=3"]), "w2": Fetched([9], {}, {}, ["n=1"])}
        assert built == [same, other]
    finally:
        stop.set()
        pool.close()
        for s in servers:
            s.close()


def test_a_rollout_workers_manager_client_follows_a_restarted_manager_at_once(tmp_path):
    """A request waits on a manager that died (it never answers); a restarted one publishes its
    address: the client must go there within a heartbeat interval, not after the heartbeat deadline
    (30 s by default: every rollout stopped that long whenever the manager was restarted)."""
    import asyncio
    import json

    from realcore.api.config import ExperimentConfig, MFCConfig
    from realcore.transport import keys
    from realcore.transport.name_resolve import make_name_resolver
    from realcore.transport.protocol import Allocate, Grant, Register, Registered
    from realcore.rollout.rollout_worker import ManagerClient

    cfg = ExperimentConfig(experiment_name="manager-client", trial_name=tmp_path.name, output_dir=str(tmp_path),
                           mfcs=[MFCConfig(name="n", type="t")],
                           system={"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 600.0,
                                   "name_resolve": {"root": str(tmp_path / "names")}})
    resolver = make_name_resolver(cfg.system.name_resolve, SECRET)
    dead = ControlServer("127.0.0.1", SECRET, status=lambda: Status("running", 1), name="old_manager")  # nobody answers
    new = ControlServer("127.0.0.1", SECRET, status=lambda: Status("running", 1), name="new_manager")
    stop, seen = threading.Event(), []
    answer = lambda msg, _: Registered(True) if isinstance(msg, Register) else Grant(True, 3, "s0", seq=5)  # noqa: E731
    threading.Thread(target=serve_with, args=(new, stop, seen, 0.0, 0, answer), daemon=True).start()
    resolver.put(keys.manager(cfg), json.dumps({"control": dead.address}), replace=True)
    reconnected = []

    async def register():
        reconnected.append(await client._call_once(Register(0, [4]), 10.0))

    async def main():
        client.connect(dead.address)
        call = asyncio.create_task(client.call(Allocate(0)))
        await asyncio.sleep(1.0)  # the request waits on the dead manager
        resolver.put(keys.manager(cfg), json.dumps({"control": new.address}), replace=True)
        return await asyncio.wait_for(call, 20)

    client = ManagerClient(cfg, SECRET, register)
    try:
        grant = asyncio.run(main())
    finally:
        stop.set()
        client.close()
        dead.close()
        new.close()
    assert grant == Grant(True, 3, "s0", seq=5)
    assert reconnected == [Registered(True)]  # re-registered first, then sent its request again
    assert seen == [Register(0, [4]), Allocate(0)]
