"""Control plane over ZeroMQ, the worker's side: a ControlServer (and the NodeRelay it may run for
its node); the master's side is pool.WorkerPool.

Socket I/O lives on one thread per side; the main thread talks to it through queues (and a
futures map on the master side). Pings are answered on the I/O thread, so a worker busy in a long
MFC still proves it is alive. Every message goes through a wire.Endpoint (authenticated, addressed,
single-use); a bad one is dropped and counted (realcore.transport.drops, and in each PING's Status).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import zmq

from realcore.transport import drops, wire
from realcore.transport.node_relay import NodeRelay
from realcore.transport.protocol import BadBody, Cmd, Ping, Relay, Split, Status, parse_request, reply
from realcore.transport.waker import Waker


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
        self._waker = Waker(self.ctx)
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
