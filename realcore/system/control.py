"""Control plane over ZeroMQ: a worker's ControlServer and the master's WorkerPool.

Socket I/O lives on one thread per side; the main thread talks to it through queues (and a
futures map on the master side). Pings are answered on the I/O thread, so a worker busy in a long
MFC still proves it is alive. Every message goes through a wire.Endpoint (authenticated, addressed,
single-use); a bad one is dropped and counted (realcore.system.drops, and in each PING's Status).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

import zmq

from realcore.system import drops, wire
from realcore.system.protocol import BadBody, Ping, RemoteError, Status, WorkerLost, parse, parse_request, reply, request


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

    def wake(self) -> None:
        with self._lock:
            self.send_sock.send(b"", zmq.NOBLOCK)

    def drain(self) -> None:
        while self.recv_sock.poll(0):
            self.recv_sock.recv()

    def close(self) -> None:
        self.send_sock.close(0)
        self.recv_sock.close(0)


class ControlServer:
    """Worker side: a ROUTER socket; requests go to `self.requests` as (peer, rid, body), the
    body a typed message of realcore.system.protocol; answer with send_reply(peer, rid, ...)."""

    SOCKET = "control"  # its name in drop counts

    def __init__(self, host: str, secret: bytes, status: Callable[[], Status], *, name: str = "worker",
                 limits: wire.Limits | None = None):
        self.ctx = zmq.Context.instance()
        self.secret = secret
        self.status = status
        limits = limits or wire.Limits.of()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        wire.set_max_size(self.sock, limits.max_control_message_bytes)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.endpoint = wire.Endpoint(secret, name, socket=self.SOCKET, address=self.address, limits=limits)
        self.requests: queue.Queue = queue.Queue()
        self._out: queue.Queue = queue.Queue()
        self._waker = _Waker(self.ctx)
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
        if isinstance(body, Ping):
            status = self.status()
            status.drops = drops.snapshot()  # the whole process's, every socket
            status.dropped = sum(status.drops.values())
            wire.send(self.sock, reply(rid, status), endpoint=self.endpoint, to=peer)
        else:
            self.requests.put((peer, rid, body))

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._waker.recv_sock, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(200))
            if self._waker.recv_sock in events:
                self._waker.drain()
            while not self._out.empty():
                peer, header = self._out.get()
                wire.send(self.sock, header, endpoint=self.endpoint, to=peer)
            if self.sock in events:
                while self.sock.poll(0):
                    self._handle(self.sock.recv_multipart(copy=False))
        while not self._out.empty():  # replies queued just before close (e.g. to EXIT) still go out
            peer, header = self._out.get()
            wire.send(self.sock, header, endpoint=self.endpoint, to=peer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()
        self._waker.close()


class WorkerPool:
    """Master side: one DEALER per worker, futures for replies, heartbeats with a deadline."""

    SOCKET = "pool"  # its name in drop counts

    def __init__(self, addresses: dict[str, str], secret: bytes, *, heartbeat_interval_s: float, heartbeat_timeout_s: float,
                 name: str = "master", limits: wire.Limits | None = None):
        self.ctx = zmq.Context.instance()
        self.secret = secret
        self.limits = limits or wire.Limits.of()
        # One endpoint for every worker's socket: replies are addressed to it, requests to each
        # worker's address; the I/O thread alone sends, so each worker sees its seqs in order.
        self.endpoint = wire.Endpoint(secret, name, socket=self.SOCKET, limits=self.limits)
        self.names = list(addresses)
        self.addresses = dict(addresses)
        self.socks: dict[str, zmq.Socket] = {name: self._connect(addr) for name, addr in addresses.items()}
        self.interval = heartbeat_interval_s
        self.timeout = heartbeat_timeout_s
        self.last_reply = {n: time.monotonic() for n in self.names}
        self.status: dict[str, Status | None] = {n: None for n in self.names}
        self.lost: dict[str, str] = {}
        self.dropped = 0
        self._rids = itertools.count(1)
        self._pending: dict[int, tuple[str, Future, type]] = {}
        self._reconnects: queue.Queue = queue.Queue()
        self._out: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waker = _Waker(self.ctx)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pool-io", daemon=True)
        self._thread.start()

    def _connect(self, address: str) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        wire.set_max_size(s, self.limits.max_control_message_bytes)
        s.connect(address)
        return s

    def request(self, worker: str, msg) -> Future:
        """Send a typed message; the future resolves to its typed reply (msg.REPLY)."""
        fut: Future = Future()
        rid = next(self._rids)
        with self._lock:
            if worker in self.lost:
                fut.set_exception(WorkerLost(f"{worker}: {self.lost[worker]}"))
                return fut
            self._pending[rid] = (worker, fut, msg.REPLY)
        self._out.put((worker, request(msg, rid)))
        self._waker.wake()
        return fut

    def reconnect(self, worker: str, address: str) -> None:
        """`worker` was restarted at a new address: talk to it there from now on. Requests still
        pending on the old process fail with WorkerLost (the caller retries them)."""
        self._mark_lost(worker, "restarted")
        done = threading.Event()
        self._reconnects.put((worker, address, done))
        self._waker.wake()
        if not done.wait(10):
            raise TimeoutError(f"reconnect {worker}: the pool's I/O thread did not answer")

    def _on_reply(self, worker: str, frames) -> None:
        try:
            _, header, tensors = self.endpoint.open(frames)  # counts its own drops
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
            entry = self._pending.pop(rid, None)
        try:
            if rid < 0:  # a heartbeat reply
                self.status[worker] = parse(Status, header.get("body"))
            elif entry is not None:
                _, fut, reply_type = entry
                if header.get("ok"):
                    fut.set_result(parse(reply_type, header.get("body")))
                else:
                    fut.set_exception(RemoteError(f"{worker}: {header.get('error')}"))
        except BadBody as e:
            self.dropped += 1
            drops.count(self.SOCKET, "body", f"a malformed reply from {worker}: {e}")
            if entry is not None:
                entry[1].set_exception(RemoteError(f"{worker}: malformed reply: {e}"))

    def _mark_lost(self, worker: str, why: str) -> None:
        with self._lock:
            self.lost[worker] = why
            mine = [rid for rid, (w, _, _) in self._pending.items() if w == worker]
            futs = [self._pending.pop(rid)[1] for rid in mine]
        for f in futs:
            f.set_exception(WorkerLost(f"{worker}: {why}"))

    def _loop(self) -> None:
        poller = zmq.Poller()
        for s in self.socks.values():
            poller.register(s, zmq.POLLIN)
        poller.register(self._waker.recv_sock, zmq.POLLIN)
        by_sock = {s: n for n, s in self.socks.items()}
        next_ping = time.monotonic()
        ping_ids = itertools.count(-1, -1)
        while not self._stop.is_set():
            events = dict(poller.poll(100))
            if self._waker.recv_sock in events:
                self._waker.drain()
            while not self._reconnects.empty():  # sockets are this thread's: swap them here
                name, address, done = self._reconnects.get()
                old = self.socks[name]
                poller.unregister(old)
                del by_sock[old]
                old.close(0)
                self.socks[name] = self._connect(address)
                self.addresses[name] = address
                poller.register(self.socks[name], zmq.POLLIN)
                by_sock[self.socks[name]] = name
                self.last_reply[name] = time.monotonic()
                with self._lock:
                    self.lost.pop(name, None)
                done.set()
            while not self._out.empty():
                worker, header = self._out.get()
                wire.send(self.socks[worker], header, endpoint=self.endpoint, to=self.addresses[worker])
            for s in events:  # only the sockets with replies: a loop over all costs O(workers) per wake-up
                name = by_sock.get(s)
                while name is not None and s.poll(0):
                    self._on_reply(name, s.recv_multipart(copy=False))
            now = time.monotonic()
            if now >= next_ping:
                next_ping = now + self.interval
                for name, s in self.socks.items():
                    if name in self.lost:
                        continue
                    if now - self.last_reply[name] > self.timeout:
                        self._mark_lost(name, f"no heartbeat for {self.timeout:g} s")
                        continue
                    wire.send(s, request(Ping(), next(ping_ids)), endpoint=self.endpoint, to=self.addresses[name])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        for s in self.socks.values():
            s.close(0)
        self._waker.close()


def wait_all(futures: dict[str, Future], timeout_s: float, what: str) -> dict:
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
