"""A worker's NodeRelay: forwards the master's RELAY and SPLIT messages to the workers of its node
(or, a relay of relays, to other relays) and answers with their replies as one. Runs on the
worker's control I/O thread (control.ControlServer), never behind the worker's own work."""

from __future__ import annotations

import itertools
import time
from typing import Callable, NamedTuple

import zmq

from realcore.transport import columns, drops, wire
from realcore.transport.protocol import Cmd, Relay, Split, reply, split_request


class _Forwarded:
    """One RELAY (or SPLIT) being answered: who asked, and its requests' replies as they come."""

    __slots__ = ("peer", "rid", "replies", "left", "deadline", "keys", "split", "addresses", "nested")

    def __init__(self, peer: wire.Peer, rid: int, n: int, deadline: float, split: int | None = None,
                 addresses: list[str] | None = None):
        self.peer, self.rid, self.replies, self.left, self.deadline = peer, rid, [None] * n, n, deadline
        self.keys: list[tuple[bytes, int]] = []
        self.split, self.addresses = split, addresses  # a SPLIT's command, and its workers
        self.nested = False  # its replies are relays' Joined replies (a SPLIT with `relays`)


class _Slot(NamedTuple):
    """Where a forwarded request's reply goes: its RELAY (or SPLIT) and its place in it."""

    fwd: _Forwarded
    index: int


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
        self._waiting: dict[tuple[bytes, int], _Slot] = {}  # (route, rid) -> where its reply goes
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
            self._waiting[(route, sub)] = _Slot(fwd, i)
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
            fwd = entry.fwd
            self._fill(fwd, entry.index, {k: header.get(k) for k in ("rid", "ok", "body", "error")})
            if not fwd.left:
                self._done(fwd)

    def expire(self, now: float) -> None:
        """Answer every relay past its deadline, with an error for each worker that did not reply."""
        for fwd in [f for f in self._open.values() if now >= f.deadline]:
            for route, sub in fwd.keys:
                entry = self._waiting.pop((route, sub), None)
                if entry is not None:
                    self._fill(fwd, entry.index, reply(sub, error="relay: no reply within the relay's timeout"))
            self._done(fwd)

    def close(self) -> None:
        self.sock.close(0)
