"""Control plane over ZeroMQ: a worker's ControlServer (and the NodeRelay it may run for its node)
and the master's WorkerPool.

Socket I/O lives on one thread per side; the main thread talks to it through queues (and a
futures map on the master side). Pings are answered on the I/O thread, so a worker busy in a long
MFC still proves it is alive. Every message goes through a wire.Endpoint (authenticated, addressed,
single-use); a bad one is dropped and counted (realcore.transport.drops, and in each PING's Status).
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from realcore.transport import columns, drops, wire
from realcore.transport.protocol import (BadBody, Cmd, Joined, Ping, Relay, Relayed, RemoteError, Split, Status, WorkerLost,
                                      parse, parse_request, relay_request, reply, request, split_request, to_body)


_PING = Ping()
_PING_BODY = to_body(_PING)  # built once: a heartbeat goes to every worker every interval


class _Waker:
    """An inproc PAIR so another thread can wake the I/O thread's poller."""

    _ids = itertools.count()

    def __init__(self, ctx: zmq.Context):
        addr = f"inproc://waker-{id(self)}-{next(self._ids)}"
        self.recv_sock = ctx.socket(zmq.PAIR)
        self.recv_sock.bind(addr)
        self.send_sock = ctx.socket(zmq.PAIR)
        self.send_sock.connect(addr)
        self._lock = threading.Lock()
        self._closed = False

    def wake(self) -> None:
        """A no-op once closed: another thread (a worker loop answering late) must not touch a
        closed socket, which libzmq answers with an error or a segfault."""
        with self._lock:
            if not self._closed:
                wire.send_frames(self.send_sock, [b""], noblock=True)

    def drain(self) -> None:
        while wire.recv_waiting(self.recv_sock) is not None:
            pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self.send_sock.close(0)
        self.recv_sock.close(0)


class _Batch:
    """The replies of one request_many share one condition: a concurrent.futures.Future builds an
    RLock + Condition each (3.3 us with its result, against 0.6; 1000 per MFC at 1000 workers).
    A waiter is woken by the reply it waits for, not by every reply of the batch. `when_done` is
    called once, when the last reply of the batch is resolved or at its first failure: one call
    per fan-out instead of a callback (and a lock) per reply."""

    __slots__ = ("cond", "left", "when_done")

    def __init__(self):
        self.cond = threading.Condition(threading.Lock())
        self.left = 0  # replies not resolved yet
        self.when_done: Callable[[BaseException | None], None] | None = None


class Reply:
    """A reply to come: the subset of concurrent.futures.Future the master uses (result, done,
    exception, add_done_callback), resolved by the pool's I/O thread."""

    __slots__ = ("_batch", "_done", "_value", "_error", "_waiting", "_callbacks")

    def __init__(self, batch: _Batch | None = None):
        self._batch = batch or _Batch()
        self._batch.left += 1
        self._done, self._value, self._error, self._waiting, self._callbacks = False, None, None, False, None

    def done(self) -> bool:
        return self._done

    def result(self, timeout: float | None = None):
        """The reply (waiting up to `timeout` s; TimeoutError after it), or the error it failed with."""
        self._wait(timeout)
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return self._error

    def _wait(self, timeout: float | None) -> None:
        if self._done:
            return
        cond = self._batch.cond
        with cond:
            self._waiting = True
            if not cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"no reply within {timeout:g} s")

    def add_done_callback(self, fn: Callable[[Reply], None]) -> None:
        with self._batch.cond:
            if not self._done:
                self._callbacks = (self._callbacks or []) + [fn]
                return
        fn(self)

    def set_result(self, value) -> None:
        self._resolve(value, None)

    def set_exception(self, error: BaseException) -> None:
        self._resolve(None, error)

    def _resolve(self, value, error) -> None:
        batch = self._batch
        with batch.cond:
            if self._done:  # lost and answered in a race: the first outcome stands
                return
            self._value, self._error, self._done = value, error, True
            if self._waiting:
                batch.cond.notify_all()
            callbacks, self._callbacks = self._callbacks, None
            batch.left -= 1
            report = batch.when_done if error is not None or batch.left == 0 else None
            if report is not None:
                batch.when_done = None  # once: at the first failure, or when the last reply came
        for fn in callbacks or ():
            fn(self)
        if report is not None:
            report(error)


def when_all_done(replies: dict[str, Reply], fn: Callable[[BaseException | None], None]) -> None:
    """Call fn(None) once every reply is resolved, or fn(error) at the first failure (once either
    way). `replies` must be all of one request_many's."""
    batches = {id(r._batch): r._batch for r in replies.values()}
    if len(batches) != 1 or next(iter(batches.values())).left > len(replies):
        raise ValueError("when_all_done: the replies of one request_many, all of them")
    batch = next(iter(batches.values()))
    with batch.cond:
        failed = next((r._error for r in replies.values() if r._error is not None), None)
        if failed is None and batch.left:
            batch.when_done = fn
            return
    fn(failed)


@dataclass
class Columns:
    """One Fetch or RunMFC for several workers (WorkerPool.request_columns, columns.py): `msg` covers
    all their samples, `sizes[k]` of them (a Fetch's count, a RunMFC's ids, in order) for
    `workers[k]`, which drops its released samples `clears[k]` first."""

    workers: list[str]
    sizes: list[int]
    msg: Any
    clears: list[list[int]]


@dataclass
class Gathered:
    """Several workers' replies to one request each, as one (WorkerPool.request_columns): `reply`
    covers all their samples, `sizes[k]` of them from `workers[k]`, in order."""

    workers: list[str]
    sizes: list[int]
    reply: Any

    def owners(self, index_of: dict[str, int]) -> list[int]:
        """The worker (its index in `index_of`) that answered each sample of `reply`."""
        return [index_of[w] for w, n in zip(self.workers, self.sizes) for _ in range(n)]


class _Forwarded:
    """One RELAY (or SPLIT) being answered: who asked, and its requests' replies as they come."""

    __slots__ = ("peer", "rid", "replies", "left", "deadline", "keys", "split", "addresses", "nested")

    def __init__(self, peer: wire.Peer, rid: int, n: int, deadline: float, split: int | None = None,
                 addresses: list[str] | None = None):
        self.peer, self.rid, self.replies, self.left, self.deadline = peer, rid, [None] * n, n, deadline
        self.keys: list[tuple[bytes, int]] = []
        self.split, self.addresses = split, addresses  # a SPLIT's command, and its workers
        self.nested = False  # its replies are relays' Joined replies (a SPLIT with `relays`)


class NodeRelay:
    """Forwards the requests of a RELAY (protocol.Relay), each to its worker over one ROUTER
    connected to every worker named so far, and answers the master once all of them replied (a
    worker silent past the RELAY's timeout gets an error reply in its place). The master then sends
    one message per node, not per worker. Requests are forwarded in the order they arrive, so each
    worker still sees the master's requests in order. Driven by its owner's I/O loop: poll `sock`,
    call on_readable() when it is, expire() now and then; answers go out through `answer(peer,
    reply header)`. Not thread-safe: one thread only."""

    SOCKET = "relay"  # its name in drop counts

    def __init__(self, ctx: zmq.Context, secret: bytes, name: str, answer: Callable[[wire.Peer, dict], None], *,
                 limits: wire.Limits | None = None):
        limits = limits or wire.Limits.of()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        wire.set_max_size(self.sock, limits.max_control_message_bytes)
        wire.secure(self.sock, secret, server=False, limits=limits)
        self.endpoint = wire.Endpoint(secret, f"{name}/relay", socket=self.SOCKET, limits=limits)
        self.answer = answer
        self._routes: dict[str, bytes] = {}  # worker address -> the routing id of our connection to it
        self._ids = itertools.count()
        self._sub_rids = itertools.count(1 << 50)  # a SPLIT's requests: never a master's rid (those count from 1)
        self._waiting: dict[tuple[bytes, int], tuple[_Forwarded, int]] = {}  # (route, rid) -> (relay, slot)
        self._open: dict[int, _Forwarded] = {}  # id() -> relays not answered yet

    def busy(self) -> bool:
        return bool(self._open)

    def _route(self, address: str) -> bytes:
        route = self._routes.get(address)
        if route is None:
            route = self._routes[address] = f"relay-{next(self._ids)}".encode()
            self.sock.setsockopt(zmq.CONNECT_ROUTING_ID, route)
            self.sock.connect(address)  # messages queue until the TCP connection is up
        return route

    def forward(self, peer: wire.Peer, rid: int, msg: Relay) -> None:
        self._send_all(fwd=_Forwarded(peer, rid, len(msg.requests), time.monotonic() + msg.timeout_s),
                       requests=msg.requests)

    def split(self, peer: wire.Peer, rid: int, msg: Split) -> None:
        """Send each worker of a SPLIT its own request (columns.cut), or, a relay of relays, each
        relay its own SPLIT; answer with their replies joined (columns.join), or with the first
        failure, naming its worker's (or relay's) address."""
        n = len(msg.workers)
        try:
            if msg.cmd not in (Cmd.FETCH, Cmd.RUN_MFC) or len(msg.sizes) != n or len(msg.clears) != n:
                raise ValueError(f"command {msg.cmd} with {n} workers, {len(msg.sizes)} sizes, {len(msg.clears)} clears")
            if msg.relays:
                requests = self._per_relay(msg)
                addresses = [address for address, _ in msg.relays]
            else:
                requests = [(address, {"cmd": msg.cmd, "rid": next(self._sub_rids),
                                       "body": columns.cut(msg.cmd, msg.body, msg.sizes, msg.clears, k)})
                            for k, address in enumerate(msg.workers)]
                addresses = msg.workers
        except (KeyError, TypeError, ValueError, IndexError) as e:
            self.answer(peer, reply(rid, error=f"relay: a malformed SPLIT: {type(e).__name__}: {e}"))
            return
        fwd = _Forwarded(peer, rid, len(requests), time.monotonic() + msg.timeout_s, split=msg.cmd, addresses=addresses)
        fwd.nested = bool(msg.relays)
        self._send_all(fwd, requests)

    def _per_relay(self, msg: Split) -> list[tuple[str, dict]]:
        """A relay of relays' SPLIT cut into one SPLIT per relay (its run of `workers`)."""
        counts = [count for _, count in msg.relays]
        if sum(counts) != len(msg.workers) or min(counts) < 1:
            raise ValueError(f"relays serve {counts} of {len(msg.workers)} workers")
        starts = list(itertools.accumulate(counts, initial=0))
        samples = [sum(msg.sizes[a:b]) for a, b in zip(starts, starts[1:])]
        no_clears = [[] for _ in counts]  # each worker's own go in its relay's SPLIT
        return [(address, split_request(msg.cmd, msg.workers[a:b], msg.sizes[a:b],
                                        columns.cut(msg.cmd, msg.body, samples, no_clears, j), msg.clears[a:b],
                                        msg.relay_timeout_s, next(self._sub_rids)))
                for j, ((address, _), a, b) in enumerate(zip(msg.relays, starts, starts[1:]))]

    def _send_all(self, fwd: _Forwarded, requests: list[tuple[str, dict]]) -> None:
        for i, (address, header) in enumerate(requests):
            sub = header.get("rid")
            if type(sub) is not int:
                self._fill(fwd, i, reply(0, error=f"relay: request {i} has no int rid"))
                continue
            try:
                route = self._route(address)
                if (route, sub) in self._waiting:
                    raise ValueError(f"request {sub} to {address} is already waiting for its reply")
                wire.send_frames(self.sock, [route, *self.endpoint.seal(header, to=address)], noblock=True)
            except (zmq.ZMQError, ValueError) as e:  # a bad address or header, or a full queue
                self._fill(fwd, i, reply(sub, error=f"relay: cannot send to {address}: {e}"))
                continue
            self._waiting[(route, sub)] = (fwd, i)
            fwd.keys.append((route, sub))
        if fwd.left:
            self._open[id(fwd)] = fwd
        else:
            self._done(fwd)

    def _fill(self, fwd: _Forwarded, slot: int, header: dict) -> None:
        fwd.replies[slot] = header
        fwd.left -= 1

    def _done(self, fwd: _Forwarded) -> None:
        self._open.pop(id(fwd), None)
        if fwd.split is None:
            self.answer(fwd.peer, {"rid": fwd.rid, "ok": True, "body": {"replies": fwd.replies}, "error": None})
            return
        failed = next(((a, r) for a, r in zip(fwd.addresses, fwd.replies) if not r.get("ok")), None)
        if failed is not None:
            self.answer(fwd.peer, reply(fwd.rid, error=f"{failed[0]}: {failed[1].get('error')}"))
            return
        try:
            if fwd.nested:
                sizes = [n for r in fwd.replies for n in r["body"]["sizes"]]
                _, body = columns.join(fwd.split, [r["body"]["body"] for r in fwd.replies])
            else:
                sizes, body = columns.join(fwd.split, [r["body"] for r in fwd.replies])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            self.answer(fwd.peer, reply(fwd.rid, error=f"relay: the replies do not join: {type(e).__name__}: {e}"))
            return
        self.answer(fwd.peer, {"rid": fwd.rid, "ok": True, "body": {"sizes": sizes, "body": body}, "error": None})

    def on_readable(self) -> None:
        while (frames := wire.recv_waiting(self.sock, self.SOCKET)) is not None:
            try:
                _, header, tensors = self.endpoint.open(frames[1:])  # counts its own drops
            except wire.BadMessage:
                continue
            entry = self._waiting.pop((bytes(frames[0]), header.get("rid")), None)
            if entry is None or tensors:  # a late reply (after its timeout) or one that should not be
                drops.count(self.SOCKET, "body", "a reply no relayed request waits for" if entry is None
                            else f"a reply carrying {len(tensors)} tensors")
                continue
            fwd, slot = entry
            self._fill(fwd, slot, {k: header.get(k) for k in ("rid", "ok", "body", "error")})
            if not fwd.left:
                self._done(fwd)

    def expire(self, now: float) -> None:
        """Answer every relay past its deadline, with an error for each worker that did not reply."""
        for fwd in [f for f in self._open.values() if now >= f.deadline]:
            for route, sub in fwd.keys:
                entry = self._waiting.pop((route, sub), None)
                if entry is not None:
                    self._fill(fwd, entry[1], reply(sub, error="relay: no reply within the relay's timeout"))
            self._done(fwd)

    def close(self) -> None:
        self.sock.close(0)


class ControlServer:
    """Worker side: a ROUTER socket; requests go to `self.requests` as (peer, rid, body), the
    body a typed message of realcore.transport.protocol; answer with send_reply(peer, rid, ...)."""

    SOCKET = "control"  # its name in drop counts

    def __init__(self, host: str, secret: bytes, status: Callable[[], Status], *, name: str = "worker",
                 limits: wire.Limits | None = None, relay: bool = False):
        self.ctx = zmq.Context.instance()
        self.secret = secret
        self.status = status
        limits = limits or wire.Limits.of()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        wire.set_max_size(self.sock, limits.max_control_message_bytes)
        wire.secure(self.sock, secret, server=True, limits=limits, socket=self.SOCKET)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.endpoint = wire.Endpoint(secret, name, socket=self.SOCKET, address=self.address, limits=limits)
        self.requests: queue.Queue = queue.Queue()
        self._out: queue.Queue = queue.Queue()
        self._waker = _Waker(self.ctx)
        # `relay`: this worker may relay the master's requests for its node (NodeRelay, on the I/O thread)
        self.relay = NodeRelay(self.ctx, secret, name, self._answer, limits=limits) if relay else None
        self._close_by = float("inf")  # close(): relays in progress may finish until then
        self.dropped = 0  # unauthenticated or malformed messages
        self.last_seen = time.monotonic()  # last authenticated message from the master
        self._served = False  # a request has been handed out (the startup deadline is over)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="control-io", daemon=True)
        self._thread.start()

    def send_reply(self, peer: wire.Peer, rid: int, body=None, error: str | None = None) -> None:
        self._out.put((peer, reply(rid, body, error)))
        self._waker.wake()

    def next_request(self, *, startup_timeout_s: float, heartbeat_timeout_s: float, who: str):
        """The next request (peer, rid, body), or None after a short poll. Exits the
        process when nothing authenticated arrived for the deadline (startup until the first
        request, heartbeat after): the master is gone."""
        try:
            req = self.requests.get(timeout=0.5)
            self._served = True
            return req
        except queue.Empty:
            deadline = heartbeat_timeout_s if self._served else startup_timeout_s
            if time.monotonic() - self.last_seen > deadline:
                raise SystemExit(f"{who}: no message from the master for {deadline:g} s; exiting")
            return None

    def _handle(self, frames) -> None:
        try:
            peer, header, _ = self.endpoint.open(frames, router=True)  # counts its own drops
        except wire.BadMessage:
            self.dropped += 1
            return
        try:
            rid, body = parse_request(header)
        except (BadBody, KeyError, ValueError, TypeError) as e:
            self.dropped += 1
            drops.count(self.SOCKET, "body", f"{type(e).__name__}: {e}")
            return
        self.last_seen = time.monotonic()
        if isinstance(body, (Relay, Split)):  # forwarded from the I/O thread: never behind this worker's own work
            if self.relay is None:
                self._answer(peer, reply(rid, error=f"{Cmd(body.CMD).name}: this process does not relay"))
            elif isinstance(body, Relay):
                self.relay.forward(peer, rid, body)
            else:
                self.relay.split(peer, rid, body)
        elif isinstance(body, Ping):
            status = self.status()
            status.drops = drops.snapshot()  # the whole process's, every socket
            status.dropped = sum(status.drops.values())
            wire.send(self.sock, reply(rid, status), endpoint=self.endpoint, to=peer)
        else:
            self.requests.put((peer, rid, body))

    def _answer(self, peer: wire.Peer, header: dict) -> None:
        wire.send(self.sock, header, endpoint=self.endpoint, to=peer)

    def _serving(self) -> bool:
        if not self._stop.is_set():
            return True
        # Closing (this worker's EXIT is answered): a relay still waiting for the other workers'
        # replies (their EXITs) gets until _close_by to send them on.
        return self.relay is not None and self.relay.busy() and time.monotonic() < self._close_by

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._waker.recv_sock, zmq.POLLIN)
        if self.relay is not None:
            poller.register(self.relay.sock, zmq.POLLIN)
        while self._serving():
            events = dict(poller.poll(200 if not self._stop.is_set() else 20))
            if self._waker.recv_sock in events:
                self._waker.drain()
            while not self._out.empty():
                peer, header = self._out.get()
                wire.send(self.sock, header, endpoint=self.endpoint, to=peer)
            if self.relay is not None:
                if self.relay.sock in events:
                    self.relay.on_readable()
                if self.relay.busy():
                    self.relay.expire(time.monotonic())
            if self.sock in events:
                # control messages are small: copied into bytes, cheaper than zero-copy frames
                while (frames := wire.recv_waiting(self.sock, self.SOCKET)) is not None:
                    self._handle(frames)
        while not self._out.empty():  # replies queued just before close (e.g. to EXIT) still go out
            peer, header = self._out.get()
            wire.send(self.sock, header, endpoint=self.endpoint, to=peer)

    def close(self, relay_grace_s: float = 2.0) -> None:
        self._close_by = time.monotonic() + relay_grace_s
        self._stop.set()
        self._thread.join(timeout=relay_grace_s + 2)
        self.sock.close()
        if self.relay is not None:
            self.relay.close()
        self._waker.close()


class WorkerPool:
    """Master side: ONE ROUTER socket connected to every worker's ROUTER, futures for replies,
    heartbeats with a deadline.

    Each connection gets its own routing id (ZMQ_CONNECT_ROUTING_ID, set before connect), so a
    reply names its worker in its first frame and one poll covers every worker: with a DEALER per
    worker, each wake-up polled all N sockets (O(N) per reply, ~1.3 ms per worker per step at 1000
    workers). Workers are unchanged: their ROUTER answers the master's routing id as before.

    `relays` (leader -> its node's workers): requests to those workers go as one RELAY per leader
    and call (NodeRelay forwards them), each worker's Reply resolved from the leader's answer;
    heartbeats too: one RELAY of pings per leader and interval, a worker alive only if it answered."""

    SOCKET = "pool"  # its name in drop counts

    def __init__(self, addresses: dict[str, str], secret: bytes, *, heartbeat_interval_s: float, heartbeat_timeout_s: float,
                 name: str = "master", limits: wire.Limits | None = None, relays: dict[str, list[str]] | None = None,
                 relay_timeout_s: float = 1800.0, tops: dict[str, str] | None = None):
        self.ctx = zmq.Context.instance()
        self.secret = secret
        self.limits = limits or wire.Limits.of()
        # One endpoint for every worker's connection: replies are addressed to it, requests to each
        # worker's address; the I/O thread alone sends, so each worker sees its seqs in order.
        self.endpoint = wire.Endpoint(secret, name, socket=self.SOCKET, limits=self.limits)
        self.names = list(addresses)
        self.addresses: dict[str, str] = {}
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, f"pool-{secrets.token_hex(8)}".encode())
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send that cannot be queued raises, never vanishes
        wire.set_max_size(self.sock, self.limits.max_control_message_bytes)
        wire.secure(self.sock, secret, server=False, limits=self.limits)
        self._route: dict[str, bytes] = {}  # worker -> the routing id of its current connection
        self._by_route: dict[bytes, str] = {}
        self._generation = itertools.count()
        for worker, address in addresses.items():
            self._connect(worker, address)
        self.interval = heartbeat_interval_s
        self.timeout = heartbeat_timeout_s
        self.last_reply = {n: time.monotonic() for n in self.names}
        self.status: dict[str, Status | None] = {n: None for n in self.names}
        self._status_body: dict[str, dict] = {}  # the body each Status was parsed from
        self.lost: dict[str, str] = {}
        self.dropped = 0
        self._rids = itertools.count(1)
        # rid -> (worker asked, its Reply, reply type, workers whose replies it gathers or None, a SPLIT?,
        # the relays it passes through beyond the one asked)
        self._pending: dict[int, tuple[str, Reply, type, tuple[str, ...] | None, bool, tuple[str, ...]]] = {}
        # Relays (NodeRelay): leader -> its node's workers (itself included). Every request to one of
        # them goes through its leader, so each worker still gets the master's requests in order.
        self.relay_of = {w: leader for leader, members in (relays or {}).items() for w in members}
        self.relay_timeout_s = relay_timeout_s
        self._relayed: dict[int, tuple[str, dict[int, str]]] = {}  # a RELAY's rid -> (leader, {request rid: worker})
        # Relays of relays: leader -> the leader whose relay passes on every message to it (tops).
        # The messages of one I/O round for a top's relays go as one RELAY to it; their replies
        # come back nested in its answer. Every message to a relay takes that path, so order holds.
        self.top_of = dict(tops or {})
        self._reconnects: queue.Queue = queue.Queue()
        self._out: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waker = _Waker(self.ctx)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pool-io", daemon=True)
        self._thread.start()

    def _connect(self, worker: str, address: str) -> None:
        """Connect to `worker` at `address` under a fresh routing id (libzmq refuses an id still in
        use, and an old connection's teardown is asynchronous). Only the I/O thread calls this
        once it runs. Messages queue until the TCP connection is up, as on a DEALER."""
        old = self._route.get(worker)
        if old is not None:
            self._by_route.pop(old, None)
            self.sock.disconnect(self.addresses[worker])
        route = f"{worker}@{next(self._generation)}".encode()
        self.sock.setsockopt(zmq.CONNECT_ROUTING_ID, route)
        self.sock.connect(address)
        self._route[worker], self._by_route[route] = route, worker
        self.addresses[worker] = address

    def request(self, worker: str, msg) -> Reply:
        """Send a typed message; the Reply resolves to its typed reply (msg.REPLY)."""
        return self.request_many({worker: msg})[worker]

    def request_many(self, msgs: dict[str, object]) -> dict[str, Reply]:
        """request() to several workers at once: one wake-up of the I/O thread for all of them."""
        futs: dict[str, Reply] = {}
        out = []
        batch = _Batch()
        by_leader: dict[str, list[tuple[str, dict]]] = {}  # leader -> [(worker, request header)]
        # One body per distinct message: every rank of a replica gets the same RunMFC object (a
        # Megatron MFC runs on all of them), and a body is never changed once built.
        bodies: dict[int, dict] = {}
        with self._lock:
            for worker, msg in msgs.items():
                fut = futs[worker] = Reply(batch)
                leader = self.relay_of.get(worker, worker)
                lost = self.lost.get(worker) or self.lost.get(leader) or self.lost.get(self.top_of.get(leader, leader))
                if lost:
                    fut.set_exception(WorkerLost(f"{worker}: {lost}"))
                    continue
                rid = next(self._rids)
                self._pending[rid] = (worker, fut, msg.REPLY, None, False, ())
                body = bodies.get(id(msg))
                if body is None:
                    body = bodies[id(msg)] = to_body(msg)
                header = request(msg, rid, body)
                leader = self.relay_of.get(worker)
                if leader is None:
                    out.append((worker, rid, header, True))
                else:
                    by_leader.setdefault(leader, []).append((worker, header))
            for leader, reqs in by_leader.items():
                rid = next(self._rids)
                self._relayed[rid] = (leader, {h["rid"]: w for w, h in reqs})
                out.append((leader, rid, relay_request([(self.addresses[w], h) for w, h in reqs], self.relay_timeout_s, rid), True))
        if out:
            self._out.put(out)
            self._waker.wake()
        return futs

    def request_columns(self, reqs: list[Columns]) -> dict[str, Reply]:
        """Requests for groups of workers (columns.py), each Reply resolving to a Gathered and keyed
        by its group's first worker: a group of one worker sent to directly is an ordinary request;
        the workers of one relay get theirs as one SPLIT to it; those of several relays under one
        top (relay_fanout) as one RELAY of SPLITs to the top, which joins their answers. Checked
        before anything is sent (ValueError)."""
        built = []
        for r in reqs:
            columns.check(r.msg, r.sizes)
            if len(r.sizes) != len(r.workers) or len(r.clears) != len(r.workers):
                raise ValueError(f"request_columns: {len(r.workers)} workers, {len(r.sizes)} sizes, {len(r.clears)} clears")
            runs: list[tuple[str | None, list[int]]] = []  # (relay, indices of its workers in r), in order
            for k, w in enumerate(r.workers):
                leader = self.relay_of.get(w)
                if runs and runs[-1][0] == leader and leader is not None:
                    runs[-1][1].append(k)
                else:
                    runs.append((leader, [k]))
            leaders = [leader for leader, _ in runs]
            tops = {self.top_of.get(leader) for leader in leaders}
            if (None in leaders and len(r.workers) != 1 or len(set(leaders)) != len(leaders)
                    or len(runs) > 1 and (len(tops) != 1 or None in tops)):
                raise ValueError(f"request_columns: {', '.join(r.workers)} are not the workers of one relay, "
                                 "nor of relays under one top")
            built.append((r, runs, None if leaders == [None] else to_body(r.msg)))
        futs: dict[str, Reply] = {}
        out = []
        batch = _Batch()
        with self._lock:
            for r, runs, body in built:
                fut = futs[r.workers[0]] = Reply(batch)
                leaders = [leader for leader, _ in runs]
                top = self.top_of.get(leaders[0]) if len(runs) > 1 else None
                lost = next((f"{w}: {self.lost[w]}" for w in (*r.workers, *leaders, top) if w in self.lost), None)
                if lost:
                    fut.set_exception(WorkerLost(lost))
                    continue
                rid = next(self._rids)
                cmd = int(r.msg.CMD)
                if body is None:  # one worker, no relay
                    w = r.workers[0]
                    msg = dataclasses.replace(r.msg, clear=r.clears[0]) if r.clears[0] else r.msg
                    self._pending[rid] = (w, fut, msg.REPLY, (w,), False, ())
                    out.append((w, rid, request(msg, rid), True))
                elif top is None:  # one relay's workers: a SPLIT to it (under a top: passed on by it)
                    self._pending[rid] = (leaders[0], fut, r.msg.REPLY, tuple(r.workers), True, ())
                    out.append((leaders[0], rid, split_request(cmd, [self.addresses[w] for w in r.workers], r.sizes,
                                                               body, r.clears, self.relay_timeout_s, rid), True))
                else:  # several relays under one top: one SPLIT to it, cut per relay there, answered as one
                    self._pending[rid] = (top, fut, r.msg.REPLY, tuple(r.workers), True, tuple(leaders))
                    out.append((top, rid, split_request(
                        cmd, [self.addresses[w] for w in r.workers], r.sizes, body, r.clears,
                        self.relay_timeout_s + self.interval, rid,
                        relays=[(self.addresses[leader], len(ks)) for leader, ks in runs],
                        relay_timeout_s=self.relay_timeout_s), False))
        if out:
            self._out.put(out)
            self._waker.wake()
        return futs

    def reconnect(self, worker: str, address: str) -> None:
        """`worker` was restarted at a new address: talk to it there from now on. Requests still
        pending on the old process fail with WorkerLost (the caller retries them)."""
        self._mark_lost(worker, "restarted")
        done = threading.Event()
        self._reconnects.put((worker, address, done))
        self._waker.wake()
        if not done.wait(10):
            raise TimeoutError(f"reconnect {worker}: the pool's I/O thread did not answer")

    def _send(self, worker: str, header: dict, rid: int) -> None:
        frames = self.endpoint.seal(header, to=self.addresses[worker])
        try:
            wire.send_frames(self.sock, [self._route[worker], *frames], noblock=True)
        except zmq.ZMQError as e:  # its queue is full (a worker that reads nothing) or it is gone
            drops.count(self.SOCKET, "send", f"to {worker}: {e}")
            with self._lock:
                entries = self._take([rid])
            for entry in entries:
                entry[1].set_exception(WorkerLost(f"{entry[0]}: cannot send to {worker} ({e})"))

    def _take(self, rids) -> list[tuple]:
        """The pending requests under `rids` (requests, RELAYs and RELAYs of RELAYs), removed. Under
        the lock."""
        out = []
        for r in list(rids):
            relayed = self._relayed.pop(r, None)
            if relayed is not None:
                out += self._take(relayed[1])
                continue
            entry = self._pending.pop(r, None)
            if entry is not None:
                out.append(entry)
        return out

    def _send_round(self, items: list[tuple[str, int, dict, float, bool]]) -> None:
        """Send (worker, rid, header, its timeout, wrap) items; those to a relay with a top (and
        `wrap`: not addressed to the top as such) go as one RELAY per top (its timeout: theirs plus
        an interval, so theirs expire first). A round never holds two messages for one worker, so
        sending the wrapped ones last reorders nothing that matters."""
        wrapped: dict[str, list[tuple[str, int, dict, float, bool]]] = {}
        for item in items:
            top = self.top_of.get(item[0]) if item[4] else None
            if top is None:
                self._send(item[0], item[2], item[1])
            else:
                wrapped.setdefault(top, []).append(item)
        for top, subs in wrapped.items():
            rid = next(self._rids)
            with self._lock:
                self._relayed[rid] = (top, {r: w for w, r, *_ in subs})
            timeout = max(t for _, _, _, t, _ in subs) + self.interval
            self._send(top, relay_request([(self.addresses[w], h) for w, _, h, *_ in subs], timeout, rid), rid)

    def _on_reply(self, frames) -> None:
        worker = self._by_route.get(bytes(frames[0])) if frames else None
        if worker is None:  # an old connection's late reply, or garbage
            self.dropped += 1
            drops.count(self.SOCKET, "misaddressed", "a reply on a connection the pool no longer uses")
            return
        try:
            _, header, tensors = self.endpoint.open(frames[1:])  # counts its own drops
        except wire.BadMessage:
            self.dropped += 1
            return
        try:
            rid = int(header["rid"])
        except (KeyError, ValueError, TypeError) as e:
            self.dropped += 1
            drops.count(self.SOCKET, "body", f"a reply from {worker} without a valid rid: {e!r}")
            return
        if tensors:  # the master moves metadata only; tensors go worker to worker
            self.dropped += 1
            drops.count(self.SOCKET, "body", f"a reply from {worker} carrying {len(tensors)} tensors")
            return
        self.last_reply[worker] = time.monotonic()
        with self._lock:
            relayed = self._relayed.pop(rid, None)
            entry = self._pending.pop(rid, None)
        if relayed is not None:
            self._on_relayed(worker, relayed[1], header)
        elif rid < 0:  # a heartbeat reply
            self._heartbeat(worker, header.get("body"))
        elif entry is not None:
            self._resolve(entry, header)

    def _heartbeat(self, worker: str, body) -> bool:
        """Record a heartbeat's Status; False if it is malformed (dropped and counted). A body
        equal to the last one is not parsed again (most are: 1000 workers send one a second)."""
        if body is not None and body == self._status_body.get(worker):
            return True
        try:
            self.status[worker] = parse(Status, body)
        except BadBody as e:
            self.dropped += 1
            drops.count(self.SOCKET, "body", f"a malformed heartbeat from {worker}: {e}")
            return False
        self._status_body[worker] = body
        return True

    def _resolve(self, entry: tuple, header: dict) -> None:
        worker, fut, reply_type, members, split, via = entry
        if not header.get("ok"):
            error = str(header.get("error"))
            if split:  # each relay on the way names the one it heard the failure from by its address
                at, known = None, {self.addresses[w]: w for w in (*members, *via)}
                while (hit := next((a for a in known if error.startswith(a + ": ")), None)) is not None:
                    at, error = known[hit], error[len(hit) + 2:]
                fut.set_exception(RemoteError(f"{at}: {error}" if at is not None
                                              else f"{worker}: relaying for {', '.join(members)}: {error}"))
            else:
                fut.set_exception(RemoteError(f"{worker}: {error}"))
            return
        try:
            if not split:
                value = parse(reply_type, header.get("body"))
                if members is not None:
                    value = Gathered(list(members), [len(value.ids)], value)
            else:
                joined = parse(Joined, header.get("body"))
                value = parse(reply_type, joined.body)
                if len(joined.sizes) != len(members) or sum(joined.sizes) != len(value.ids):
                    raise BadBody(f"Joined.sizes: {joined.sizes} for {len(members)} workers and {len(value.ids)} ids")
                value = Gathered(list(members), joined.sizes, value)
            fut.set_result(value)
        except BadBody as e:
            self.dropped += 1
            drops.count(self.SOCKET, "body", f"a malformed reply from {worker}: {e}")
            fut.set_exception(RemoteError(f"{worker}: malformed reply: {e}"))

    def _on_relayed(self, leader: str, rids: dict[int, str], header: dict) -> None:
        """A RELAY's reply: each of its requests' replies resolves that request (matched by rid), a
        heartbeat's (rid < 0) is that worker's; a request the relay did not answer fails."""
        replies: list = []
        try:
            if header.get("ok"):
                replies = parse(Relayed, header.get("body")).replies
        except BadBody as e:
            self.dropped += 1
            drops.count(self.SOCKET, "body", f"a malformed relay reply from {leader}: {e}")
        for sub in replies:
            rid = sub.get("rid")
            if type(rid) is not int or rid not in rids:
                self.dropped += 1
                drops.count(self.SOCKET, "body", f"a relay reply from {leader} answering no request of it ({rid!r:.40})")
                continue
            with self._lock:
                nested = self._relayed.pop(rid, None)
            if nested is not None:  # a top's answer: this is a relay's answer to the RELAY it passed on
                self._on_relayed(rids[rid], nested[1], sub)
                continue
            if rid < 0:  # a heartbeat: only a worker that answered it is alive
                if sub.get("ok") and self._heartbeat(rids[rid], sub.get("body")):
                    self.last_reply[rids[rid]] = time.monotonic()
                continue
            with self._lock:
                entry = self._pending.pop(rid, None)
            if entry is not None:
                self._resolve(entry, sub)
        with self._lock:
            left = self._take(rids)  # what the relay did not answer
        why = header.get("error") if not header.get("ok") else "no reply in the relay's answer"
        for worker, fut, *_ in left:
            fut.set_exception(RemoteError(f"{worker}: relayed by {leader}: {why}"))

    def _mark_lost(self, worker: str, why: str) -> None:
        with self._lock:
            self.lost[worker] = why
            entries = self._take([rid for rid, (w, _, _, members, _, via) in self._pending.items()
                                  if w == worker or (members and worker in members) or worker in via])
            # What `worker` relays for others (or passes on to other relays) is lost with it.
            entries += self._take([r for r, (leader, _) in self._relayed.items() if leader == worker])
        for w, f, _, members, split, via in entries:
            if split and worker != w and worker in members:  # a member of a SPLIT its relay `w` sent
                f.set_exception(WorkerLost(f"{worker}: {why}"))
            else:
                f.set_exception(WorkerLost(f"{w}: {why}" if w == worker else f"{w}: its relay {worker}: {why}"))

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._waker.recv_sock, zmq.POLLIN)
        next_ping = time.monotonic()
        ping_ids = itertools.count(-1, -1)
        while not self._stop.is_set():
            events = dict(poller.poll(100))
            if self._waker.recv_sock in events:
                self._waker.drain()
            while not self._reconnects.empty():  # the socket is this thread's: connect here
                name, address, done = self._reconnects.get()
                self._connect(name, address)
                self.last_reply[name] = time.monotonic()
                with self._lock:
                    self.lost.pop(name, None)
                done.set()
            while not self._out.empty():
                self._send_round([(worker, rid, header, self.relay_timeout_s, wrap) for worker, rid, header, wrap in self._out.get()])
            if self.sock in events:
                while (frames := wire.recv_waiting(self.sock, self.SOCKET)) is not None:  # Socket.poll(0) builds a Poller per call
                    self._on_reply(frames)
            now = time.monotonic()
            if now >= next_ping:
                next_ping = now + self.interval
                relayed: dict[str, dict[int, str]] = {}  # leader -> {ping rid: worker}
                direct = []
                for name in self.names:
                    if name in self.lost:
                        continue
                    if now - self.last_reply[name] > self.timeout:
                        self._mark_lost(name, f"no heartbeat for {self.timeout:g} s")
                        continue
                    # Every interval, busy or not: the Status carries the worker's drop counts, which
                    # the metrics must show (skipping busy workers lost the last ones of a run).
                    rid = next(ping_ids)
                    leader = self.relay_of.get(name)
                    if leader is None:
                        direct.append((name, rid, request(_PING, rid, _PING_BODY), self.interval, True))
                    else:
                        relayed.setdefault(leader, {})[rid] = name
                for leader, rids in relayed.items():  # a node's heartbeats in one RELAY, answered within the interval
                    if leader in self.lost or self.top_of.get(leader) in self.lost:
                        continue
                    rid = next(ping_ids)
                    with self._lock:
                        self._relayed[rid] = (leader, rids)
                    pings = [(self.addresses[w], request(_PING, r, _PING_BODY)) for r, w in rids.items()]
                    direct.append((leader, rid, relay_request(pings, self.interval, rid), self.interval, True))
                self._send_round(direct)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close(0)
        self._waker.close()


def wait_all(futures: dict[str, Reply], timeout_s: float, what: str) -> dict:
    """Results of every future, or an error naming what timed out and on which workers."""
    deadline = time.monotonic() + timeout_s
    out = {}
    for name, fut in futures.items():
        left = max(0.0, deadline - time.monotonic())
        try:
            out[name] = fut.result(timeout=left)
        except TimeoutError:
            late = [n for n, f in futures.items() if not f.done()]
            raise TimeoutError(f"{what}: no reply from {', '.join(late)} within {timeout_s:g} s") from None
    return out
