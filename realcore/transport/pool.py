"""Control plane over ZeroMQ, the master's side: the WorkerPool (one ROUTER to every worker's
control.ControlServer, replies as reply.Reply, heartbeats with a deadline), routed along the relay
tree (relay_tree.py) when workers relay for their node (node_relay.NodeRelay).

Socket I/O lives on the pool's own thread; callers hand it messages through a queue and get
Replies back. A bad message is dropped and counted (realcore.transport.drops).
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import zmq

from realcore.transport import columns, drops, relay_tree, wire
from realcore.transport.protocol import (BadBody, Joined, Ping, RemoteError, Relayed, Status, WorkerLost, parse, relay_request,
                                         request, split_request, to_body)
from realcore.transport.reply import Batch, Reply
from realcore.transport.waker import Waker


_PING = Ping()
_PING_BODY = to_body(_PING)  # built once: a heartbeat goes to every worker every interval


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

class Pending(NamedTuple):
    """A request waiting for its reply (WorkerPool._pending, by rid). A NamedTuple: one is made per
    request, 1000 per MFC at 1000 workers."""

    worker: str  # the worker (or relay) it was sent to
    reply: Reply
    reply_type: type
    members: tuple[str, ...] | None  # the workers whose replies it gathers (request_columns), or None
    split: bool  # a SPLIT to a relay (its answer is a Joined)
    via: tuple[str, ...]  # the relays it passes through beyond the one asked (a top's)


class Relaying(NamedTuple):
    """A RELAY sent to `leader` (WorkerPool._relayed, by its rid): the requests it carries."""

    leader: str
    rids: dict[int, str]  # request rid -> the worker it is for


class Outgoing(NamedTuple):
    """A message for the I/O thread to send (WorkerPool._send_round)."""

    worker: str
    rid: int
    header: dict
    timeout_s: float  # its answer's deadline (a RELAY wrapping it waits a little longer)
    wrap: bool  # to a relay under a top, wrapped in a RELAY to the top (False: addressed to the top as such)


class Reconnect(NamedTuple):
    """A restarted worker's new address, for the I/O thread to connect to (`done` set once it has)."""

    worker: str
    address: str
    done: threading.Event


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
        self._pending: dict[int, Pending] = {}  # rid -> the request waiting for its reply
        # Relays (NodeRelay): leader -> its node's workers (itself included). Every request to one of
        # them goes through its leader, so each worker still gets the master's requests in order.
        self.relay_of = relay_tree.leaders_of(relays or {})
        self.relay_timeout_s = relay_timeout_s
        self._relayed: dict[int, Relaying] = {}  # a RELAY's rid -> what it carries
        # Relays of relays: leader -> the leader whose relay passes on every message to it (tops).
        # The messages of one I/O round for a top's relays go as one RELAY to it; their replies
        # come back nested in its answer. Every message to a relay takes that path, so order holds.
        self.top_of = dict(tops or {})
        self._reconnects: queue.Queue[Reconnect] = queue.Queue()
        self._out: queue.Queue[list[Outgoing]] = queue.Queue()  # one round of messages per put
        self._lock = threading.Lock()
        self._waker = Waker(self.ctx)
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
        out: list[Outgoing] = []
        batch = Batch()
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
                self._pending[rid] = Pending(worker, fut, msg.REPLY, None, False, ())
                body = bodies.get(id(msg))
                if body is None:
                    body = bodies[id(msg)] = to_body(msg)
                header = request(msg, rid, body)
                leader = self.relay_of.get(worker)
                if leader is None:
                    out.append(Outgoing(worker, rid, header, self.relay_timeout_s, True))
                else:
                    by_leader.setdefault(leader, []).append((worker, header))
            for leader, reqs in by_leader.items():
                rid = next(self._rids)
                self._relayed[rid] = Relaying(leader, {h["rid"]: w for w, h in reqs})
                out.append(Outgoing(leader, rid, relay_request([(self.addresses[w], h) for w, h in reqs], self.relay_timeout_s, rid),
                                    self.relay_timeout_s, True))
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
            runs = relay_tree.runs_of(r.workers, self.relay_of)
            if not relay_tree.one_relay_or_top(r.workers, runs, self.top_of):
                raise ValueError(f"request_columns: {', '.join(r.workers)} are not the workers of one relay, "
                                 "nor of relays under one top")
            built.append((r, runs, None if runs[0].leader is None else to_body(r.msg)))
        futs: dict[str, Reply] = {}
        out: list[Outgoing] = []
        batch = Batch()
        with self._lock:
            for r, runs, body in built:
                fut = futs[r.workers[0]] = Reply(batch)
                leaders = [run.leader for run in runs]
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
                    self._pending[rid] = Pending(w, fut, msg.REPLY, (w,), False, ())
                    out.append(Outgoing(w, rid, request(msg, rid), self.relay_timeout_s, True))
                elif top is None:  # one relay's workers: a SPLIT to it (under a top: passed on by it)
                    self._pending[rid] = Pending(leaders[0], fut, r.msg.REPLY, tuple(r.workers), True, ())
                    out.append(Outgoing(leaders[0], rid, split_request(cmd, [self.addresses[w] for w in r.workers], r.sizes,
                                                                       body, r.clears, self.relay_timeout_s, rid),
                                        self.relay_timeout_s, True))
                else:  # several relays under one top: one SPLIT to it, cut per relay there, answered as one
                    self._pending[rid] = Pending(top, fut, r.msg.REPLY, tuple(r.workers), True, tuple(leaders))
                    out.append(Outgoing(top, rid, split_request(
                        cmd, [self.addresses[w] for w in r.workers], r.sizes, body, r.clears,
                        self.relay_timeout_s + self.interval, rid,
                        relays=[(self.addresses[run.leader], len(run.indices)) for run in runs],
                        relay_timeout_s=self.relay_timeout_s), self.relay_timeout_s, False))
        if out:
            self._out.put(out)
            self._waker.wake()
        return futs

    def reconnect(self, worker: str, address: str) -> None:
        """`worker` was restarted at a new address: talk to it there from now on. Requests still
        pending on the old process fail with WorkerLost (the caller retries them)."""
        self._mark_lost(worker, "restarted")
        done = threading.Event()
        self._reconnects.put(Reconnect(worker, address, done))
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
                entry.reply.set_exception(WorkerLost(f"{entry.worker}: cannot send to {worker} ({e})"))

    def _take(self, rids) -> list[Pending]:
        """The pending requests under `rids` (requests, RELAYs and RELAYs of RELAYs), removed. Under
        the lock."""
        out = []
        for r in list(rids):
            relayed = self._relayed.pop(r, None)
            if relayed is not None:
                out += self._take(relayed.rids)
                continue
            entry = self._pending.pop(r, None)
            if entry is not None:
                out.append(entry)
        return out

    def _send_round(self, items: list[Outgoing]) -> None:
        """Send `items`; those to a relay with a top (and `wrap`: not addressed to the top as such)
        go as one RELAY per top (its timeout: theirs plus an interval, so theirs expire first). A
        round never holds two messages for one worker, so sending the wrapped ones last reorders
        nothing that matters."""
        wrapped: dict[str, list[Outgoing]] = {}
        for item in items:
            top = self.top_of.get(item.worker) if item.wrap else None
            if top is None:
                self._send(item.worker, item.header, item.rid)
            else:
                wrapped.setdefault(top, []).append(item)
        for top, subs in wrapped.items():
            rid = next(self._rids)
            with self._lock:
                self._relayed[rid] = Relaying(top, {o.rid: o.worker for o in subs})
            timeout = max(o.timeout_s for o in subs) + self.interval
            self._send(top, relay_request([(self.addresses[o.worker], o.header) for o in subs], timeout, rid), rid)

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
            self._on_relayed(worker, relayed.rids, header)
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

    def _resolve(self, entry: Pending, header: dict) -> None:
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
                self._on_relayed(rids[rid], nested.rids, sub)
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
        for entry in left:
            entry.reply.set_exception(RemoteError(f"{entry.worker}: relayed by {leader}: {why}"))

    def _mark_lost(self, worker: str, why: str) -> None:
        with self._lock:
            self.lost[worker] = why
            entries = self._take([rid for rid, p in self._pending.items()
                                  if p.worker == worker or (p.members and worker in p.members) or worker in p.via])
            # What `worker` relays for others (or passes on to other relays) is lost with it.
            entries += self._take([r for r, relaying in self._relayed.items() if relaying.leader == worker])
        for p in entries:
            w = p.worker
            if p.split and worker != w and worker in p.members:  # a member of a SPLIT its relay `w` sent
                p.reply.set_exception(WorkerLost(f"{worker}: {why}"))
            else:
                p.reply.set_exception(WorkerLost(f"{w}: {why}" if w == worker else f"{w}: its relay {worker}: {why}"))

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
                self._send_round(self._out.get())
            if self.sock in events:
                while (frames := wire.recv_waiting(self.sock, self.SOCKET)) is not None:  # Socket.poll(0) builds a Poller per call
                    self._on_reply(frames)
            now = time.monotonic()
            if now >= next_ping:
                next_ping = now + self.interval
                relayed: dict[str, dict[int, str]] = {}  # leader -> {ping rid: worker}
                direct: list[Outgoing] = []
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
                        direct.append(Outgoing(name, rid, request(_PING, rid, _PING_BODY), self.interval, True))
                    else:
                        relayed.setdefault(leader, {})[rid] = name
                for leader, rids in relayed.items():  # a node's heartbeats in one RELAY, answered within the interval
                    if leader in self.lost or self.top_of.get(leader) in self.lost:
                        continue
                    rid = next(ping_ids)
                    with self._lock:
                        self._relayed[rid] = Relaying(leader, rids)
                    pings = [(self.addresses[w], request(_PING, r, _PING_BODY)) for r, w in rids.items()]
                    direct.append(Outgoing(leader, rid, relay_request(pings, self.interval, rid), self.interval, True))
                self._send_round(direct)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close(0)
        self._waker.close()
