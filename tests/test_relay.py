"""The master's requests for a node's workers travel as one RELAY through the first of them
(control.NodeRelay): real ControlServers and a WorkerPool over loopback."""

import threading
import time

import pytest

from realcore.transport.control import ControlServer
from realcore.transport.pool import Columns, WorkerPool
from realcore.transport.reply import wait_all
from realcore.transport.relay_tree import relay_groups, relay_tops
from realcore.transport.protocol import Clear, Fetch, Fetched, MFCDone, RemoteError, RunMFC, Status, WorkerLost

SECRET = b"r" * 32


def answer_fetch(msg, index: int):
    """FETCH answers its first_id and n; CLEAR fails."""
    if isinstance(msg, Clear):
        raise ValueError("no such samples")
    return Fetched([msg.first_id], {}, {}, [f"n={msg.n}"])


def serve(server: ControlServer, stop: threading.Event, handled: list, delay_s: float, index: int, answer) -> None:
    """A worker loop: every request logged in order, answered by answer(msg, index) after
    `delay_s`, or with the error it raises."""
    while not stop.is_set():
        try:
            peer, rid, msg = server.requests.get(timeout=0.05)
        except Exception:
            continue
        handled.append(msg)
        time.sleep(delay_s)
        try:
            server.send_reply(peer, rid, answer(msg, index))
        except Exception as e:
            server.send_reply(peer, rid, error=str(e))


class Node:
    """`n` workers on one host (each relay=True, as every model worker: the first of each group of
    `group` relays), serving with `answer`; relays of relays per `fanout`."""

    def __init__(self, n: int, *, heartbeat_timeout_s: float = 5.0, relay_timeout_s: float = 30.0, delays=None, answer=answer_fetch,
                 group: int = 8, fanout: int = 1):
        self.servers = [ControlServer("127.0.0.1", SECRET, lambda: Status("running", 1), name=f"w{i}", relay=True)
                        for i in range(n)]
        self.handled: list[list] = [[] for _ in range(n)]
        self.stops = [threading.Event() for _ in range(n)]
        self.threads = [threading.Thread(target=serve, args=(s, self.stops[i], self.handled[i], (delays or {}).get(i, 0.0), i, answer),
                                         daemon=True) for i, s in enumerate(self.servers)]
        for t in self.threads:
            t.start()
        addrs = {f"w{i}": s.address for i, s in enumerate(self.servers)}
        relays = relay_groups(addrs, group)
        self.pool = WorkerPool(addrs, SECRET, heartbeat_interval_s=0.1, heartbeat_timeout_s=heartbeat_timeout_s,
                               relays=relays, relay_timeout_s=relay_timeout_s, tops=relay_tops(list(relays), fanout))

    def close(self):
        for st in self.stops:
            st.set()
        for t in self.threads:  # a delayed worker replies before its server closes
            t.join(timeout=10)
        self.pool.close()
        for s in self.servers:
            s.close(relay_grace_s=0.2)


@pytest.fixture
def node():
    made = []
    yield lambda *a, **k: made.append(Node(*a, **k)) or made[-1]
    for n in made:
        n.close()


def test_relay_groups_are_per_host_and_bounded():
    addrs = {f"w{i}": f"tcp://node-{'ab'[i % 2]}:{5000 + i}" for i in range(6)} | {"w6": "tcp://node-c:1"}
    assert relay_groups(addrs, 2) == {"w0": ["w0", "w2"], "w1": ["w1", "w3"]}  # groups of one go direct
    assert relay_groups(addrs, 8) == {"w0": ["w0", "w2", "w4"], "w1": ["w1", "w3", "w5"]}
    assert relay_groups(addrs, 1) == {}


def test_requests_go_through_the_relay_in_order_with_typed_replies(node):
    """Three rounds to four workers: the master sends one RELAY per round (to w0), every worker gets
    its own requests in the order sent, every reply comes back typed to its own Reply; a remote
    error stays the worker's."""
    n = node(4)
    assert n.pool.relay_of == {f"w{i}": "w0" for i in range(4)}
    relayed_before = n.servers[0].relay.endpoint.guard._senders.copy()
    for r in range(3):
        got = wait_all(n.pool.request_many({f"w{i}": Fetch(100 * r + i, i) for i in range(4)}), 10, "fetch")
        assert got == {f"w{i}": Fetched([100 * r + i], {}, {}, [f"n={i}"]) for i in range(4)}
    with pytest.raises(RemoteError, match="w2: no such samples"):
        n.pool.request("w2", Clear([1])).result(10)
    for i in range(4):
        assert [m.first_id for m in n.handled[i] if isinstance(m, Fetch)] == [i, 100 + i, 200 + i]
    # every worker heard the requests from w0's relay, not from the master
    assert relayed_before == {} and len(n.servers[0].relay.endpoint.guard._senders) == 4
    assert not n.pool._pending and not n.pool._relayed


def test_a_silent_worker_gets_an_error_reply_from_the_relay(node):
    """w1 takes longer than the RELAY's timeout: the relay answers anyway, w1's Reply fails naming
    the relay's timeout and the others' replies arrive."""
    n = node(3, relay_timeout_s=0.5, delays={1: 2.0})
    futs = n.pool.request_many({f"w{i}": Fetch(i, 1) for i in range(3)})
    assert futs["w0"].result(10).ids == [0] and futs["w2"].result(10).ids == [2]
    with pytest.raises(RemoteError, match="w1: relay: no reply within the relay's timeout"):
        futs["w1"].result(10)


def test_a_lost_relay_fails_what_it_relays(node):
    """The relaying worker stops answering (its I/O thread stops) while w1 is still busy: every
    request it relays fails with WorkerLost naming it, and later requests to its node fail at once."""
    n = node(3, heartbeat_timeout_s=0.5, delays={1: 3.0})
    futs = n.pool.request_many({f"w{i}": Fetch(i, 1) for i in range(3)})
    time.sleep(0.3)  # forwarded: w0 and w2 answered their relay, w1 is busy
    n.servers[0]._close_by = 0  # w0's I/O thread (and with it its relay and heartbeat) stops at once
    n.servers[0]._stop.set()
    with pytest.raises(WorkerLost, match="w0: no heartbeat"):
        futs["w0"].result(10)
    for w in ("w1", "w2"):
        with pytest.raises(WorkerLost, match=f"{w}: its relay w0: no heartbeat"):
            futs[w].result(1)
    with pytest.raises(WorkerLost, match="w2: no heartbeat"):
        n.pool.request("w2", Fetch(9, 1)).result(1)


def test_a_relay_request_to_a_process_that_does_not_relay_fails():
    """The manager's control server (relay=False) refuses a RELAY with an error reply."""
    servers = [ControlServer("127.0.0.1", SECRET, lambda: Status("running", 1), name=f"m{i}") for i in range(2)]
    stops = [threading.Event(), threading.Event()]
    for s, st in zip(servers, stops):
        threading.Thread(target=serve, args=(s, st, [], 0.0, 0, answer_fetch), daemon=True).start()
    pool = WorkerPool({"m0": servers[0].address, "m1": servers[1].address}, SECRET, heartbeat_interval_s=0.1,
                      heartbeat_timeout_s=5, relays={"m0": ["m0", "m1"]})
    try:
        with pytest.raises(RemoteError, match="m1: relayed by m0: RELAY: this process does not relay"):
            pool.request("m1", Fetch(1, 1)).result(10)
    finally:
        for st in stops:
            st.set()
        pool.close()
        for s in servers:
            s.close()


def test_heartbeats_travel_through_the_relay(node):
    """The master pings a node's workers with one RELAY per interval: every worker's Status arrives,
    no worker hears the master directly, and a worker that stops answering (its I/O thread stopped)
    is lost on its own while its node goes on."""
    n = node(3, heartbeat_timeout_s=1.0)
    deadline = time.monotonic() + 10
    while any(n.pool.status[f"w{i}"] is None for i in range(3)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all((n.pool.status[f"w{i}"].state, n.pool.status[f"w{i}"].pid) == ("running", 1) for i in range(3)), n.pool.status
    for s in n.servers[1:]:
        assert s.endpoint.guard._senders and all(k.startswith("w0/relay#") for k in s.endpoint.guard._senders)
    n.servers[2]._close_by = 0
    n.servers[2]._stop.set()
    while "w2" not in n.pool.lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(n.pool.lost) == {"w2"}, n.pool.lost
    assert n.pool.request("w1", Fetch(5, 1)).result(10).ids == [5]


def test_relays_of_relays_pass_every_message_on_in_order(node):
    """Two relays of two workers, the second's messages passed on by the first (a top): the master
    sends only to w0, every worker gets its requests in order with its own typed reply, a SPLIT
    through the top is answered as one, and heartbeats come back through both levels."""
    n = node(4, group=2, fanout=8)
    assert n.pool.relay_of == {"w0": "w0", "w1": "w0", "w2": "w2", "w3": "w2"} and n.pool.top_of == {"w0": "w0", "w2": "w0"}
    assert relay_tops(["a", "b", "c"], 2) == {"a": "a", "b": "a"} and relay_tops(["a", "b"], 1) == {}
    for r in range(3):
        got = wait_all(n.pool.request_many({f"w{i}": Fetch(100 * r + i, i) for i in range(4)}), 10, "fetch")
        assert got == {f"w{i}": Fetched([100 * r + i], {}, {}, [f"n={i}"]) for i in range(4)}
    reqs = [Columns(["w0", "w1"], [1, 1], Fetch(500, 2), [[], []]), Columns(["w2", "w3"], [1, 1], Fetch(502, 2), [[], [9]])]
    got = wait_all(n.pool.request_columns(reqs), 10, "fetch")
    assert {w: (g.workers, g.reply.ids) for w, g in got.items()} == {"w0": (["w0", "w1"], [500, 501]), "w2": (["w2", "w3"], [502, 503])}
    # both relays' workers in one request: one SPLIT to the top, cut there per relay, answered as one
    g = wait_all(n.pool.request_columns([Columns([f"w{i}" for i in range(4)], [1, 2, 1, 1], Fetch(600, 5),
                                                 [[], [], [3], []])]), 10, "fetch")["w0"]
    assert (g.workers, g.sizes, g.reply.ids) == ([f"w{i}" for i in range(4)], [1, 1, 1, 1], [600, 601, 603, 604])
    assert [m.n for m in (n.handled[i][-1] for i in range(4))] == [1, 2, 1, 1] and n.handled[2][-1].clear == [3]
    for i in range(4):
        assert [m.first_id for m in n.handled[i] if isinstance(m, Fetch)] == [i, 100 + i, 200 + i, 500 + i, [600, 601, 603, 604][i]]
    assert n.handled[3][-2].clear == [9]
    with pytest.raises(ValueError, match="not the workers of one relay"):
        n.pool.request_columns([Columns(["w0", "w2", "w1"], [1, 1, 1], Fetch(0, 3), [[], [], []])])
    deadline = time.monotonic() + 10
    while any(n.pool.status[f"w{i}"] is None for i in range(4)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(n.pool.status[f"w{i}"] is not None for i in range(4)), n.pool.status
    # who heard whom: the master only w0; w2 (a relay) w0's relay and its own; w3 only w2's
    heard = [{k.split("#")[0] for k in s.endpoint.guard._senders} for s in n.servers]
    assert heard[0] >= {"master"} and heard[1:] == [{"w0/relay"}, {"w0/relay", "w2/relay"}, {"w2/relay"}], heard
    assert not n.pool._pending and not n.pool._relayed


def test_a_lost_top_fails_everything_beneath_it(node):
    """The top (w0) stops answering while w3 is busy: the requests of both relays fail with
    WorkerLost naming it, and later requests to them fail at once."""
    n = node(4, group=2, fanout=8, heartbeat_timeout_s=0.5, delays={3: 3.0})
    futs = n.pool.request_many({f"w{i}": Fetch(i, 1) for i in range(4)})
    time.sleep(0.3)
    n.servers[0]._close_by = 0
    n.servers[0]._stop.set()
    with pytest.raises(WorkerLost, match="w0: no heartbeat"):
        futs["w0"].result(10)
    with pytest.raises(WorkerLost, match="w3: its relay w0: no heartbeat"):
        futs["w3"].result(1)
    with pytest.raises(WorkerLost, match="no heartbeat"):  # its relay's top is lost (and its own pings with it)
        n.pool.request("w3", Fetch(9, 1)).result(1)
    assert not n.pool._pending


def test_a_failure_beneath_a_top_names_the_worker(node):
    """A worker under the second relay fails its part of a request that spans both relays: the
    request fails with that worker's name and error (passed up through its relay and the top);
    one that stays silent past the deadline is named too."""
    def answer(msg, index):
        if isinstance(msg, RunMFC) and index == 3:
            raise RuntimeError("MFC x failed")
        return MFCDone(msg.ids, {}, {}, {}, 1) if isinstance(msg, RunMFC) else answer_fetch(msg, index)

    n = node(4, group=2, fanout=8, answer=answer)
    with pytest.raises(RemoteError, match="^w3: MFC x failed"):
        wait_all(n.pool.request_columns([Columns([f"w{i}" for i in range(4)], [1, 1, 1, 1],
                                                 RunMFC("x", [0, 1, 2, 3], {}), [[]] * 4)]), 10, "mfc")
    assert not n.pool._pending
    n = node(4, group=2, fanout=8, relay_timeout_s=0.5, delays={2: 2.0})
    with pytest.raises(RemoteError, match="^w2: relay: no reply within the relay's timeout"):
        wait_all(n.pool.request_columns([Columns([f"w{i}" for i in range(4)], [1, 1, 1, 1], Fetch(0, 4), [[]] * 4)]),
                 10, "fetch")
    assert not n.pool._pending


def test_a_lost_relay_beneath_a_top_fails_the_request_through_it(node):
    """The second relay (w2) stops answering while w3 is busy on a request spanning both relays:
    the request fails with WorkerLost naming w2, without waiting for the top's deadline."""
    n = node(4, group=2, fanout=8, heartbeat_timeout_s=0.5, delays={3: 3.0})
    fut = n.pool.request_columns([Columns([f"w{i}" for i in range(4)], [1, 1, 1, 1], Fetch(0, 4), [[]] * 4)])["w0"]
    time.sleep(0.3)
    n.servers[2]._close_by = 0
    n.servers[2]._stop.set()
    with pytest.raises(WorkerLost, match="^w2: no heartbeat"):
        fut.result(2.5)
    assert not n.pool._pending
