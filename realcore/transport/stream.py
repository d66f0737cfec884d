"""The trajectory stream: rollout workers send finished groups to the model workers (round robin
over the data-parallel heads), which keep them until the master FETCHes them into a training
batch. Tensors never pass through the master; it learns ids, names, lengths and versions only.

A group (one prompt's `n` sequences) is one authenticated message: header {"group": n, "keys": the
workflow's declared keys, "uid": the prompt's stable name, "grant": the admission that produced it}
and, key after key, one tensor per sequence. The
model worker acknowledges a group once it is in its queue, and only then does the rollout worker
report the rollout finished: so a rollout the manager counts as finished is never lost, whatever
process dies next (cluster notes: never rely on ZeroMQ linger at exit). Both directions go through
a wire.Endpoint: a trajectory replayed to a stream is dropped (counted), never trained on twice.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
from dataclasses import dataclass

import torch
import zmq

from realcore.api.data import Sample
from realcore.transport import drops, wire
from realcore.api.versions import is_stale


@dataclass
class Group:
    uid: str  # the prompt: "r{worker}:{seq}"
    grant: int  # the admission that produced this copy
    sample: Sample


def encode_group(group: Group) -> tuple[dict, list[torch.Tensor]]:
    sample = group.sample
    n, keys = len(sample["input_ids"]), list(sample)
    for k in keys:
        if len(sample[k]) != n:
            raise ValueError(f"trajectory key {k!r} has {len(sample[k])} sequences, input_ids has {n}")
    header = {"group": n, "keys": keys, "uid": group.uid, "grant": group.grant}
    return header, [t for k in keys for t in sample[k]]


def decode_group(header: dict, tensors: list[torch.Tensor], expected: tuple[str, ...]) -> Group:
    """`expected`: the workflow's declared keys; a group with other keys is refused."""
    n, keys, uid, grant = int(header["group"]), list(header["keys"]), header["uid"], header["grant"]
    if sorted(keys) != sorted(expected) or len(tensors) != n * len(keys) or not isinstance(uid, str) or type(grant) is not int:
        raise ValueError(f"trajectory with keys {keys} and {len(tensors)} tensors for a group of {n}")
    # clone: received tensors are views of ZeroMQ frames; storage keeps them for a while
    return Group(uid, grant, {k: [t.clone() for t in tensors[i * n : (i + 1) * n]] for i, k in enumerate(keys)})


class TrajectoryStream:
    """Model-worker side: a ROUTER socket read by its own thread into a queue of groups."""

    SOCKET = "stream"  # its name in drop counts

    def __init__(self, host: str, secret: bytes, keys: tuple[str, ...], *, name: str = "worker",
                 limits: wire.Limits | None = None):
        self.secret, self.keys = secret, tuple(keys)
        limits = limits or wire.Limits.of()
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        wire.set_max_size(self.sock, limits.max_message_bytes)
        wire.secure(self.sock, secret, server=True, limits=limits, socket=self.SOCKET)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.endpoint = wire.Endpoint(secret, name, socket=self.SOCKET, address=self.address, limits=limits)
        self.pending: collections.deque[Group] = collections.deque()
        self._lock = threading.Lock()  # pending is read by save() on the main thread
        self.received = 0
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stream", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not wire.readable(self.sock, 200):
                continue
            try:
                peer, header, tensors = wire.recv(self.sock, endpoint=self.endpoint, router=True)
            except wire.BadMessage:
                self.dropped += 1  # counted by the endpoint
                continue
            try:
                group = decode_group(header, tensors, self.keys)
            except (KeyError, TypeError, ValueError) as e:
                self.dropped += 1
                drops.count(self.SOCKET, "body", f"a bad trajectory: {e!r}")
                continue
            with self._lock:
                self.pending.append(group)
                self.received += 1
            wire.send(self.sock, {"grant": group.grant}, endpoint=self.endpoint, to=peer)

    def take(self, n: int, *, current_version: int, max_head_offpolicyness: int | None):
        """Up to n pending groups that are fresh enough for the current version, and the grants
        of those that arrived too stale (dropped: a hard staleness bound; None: nothing is)."""
        out, dropped = [], []
        with self._lock:
            while len(out) < n and self.pending:
                group = self.pending.popleft()
                start = min(int(t) for t in group.sample["version_start"])
                if is_stale(start, current_version=current_version, max_head_offpolicyness=max_head_offpolicyness):
                    dropped.append(group.grant)
                else:
                    out.append(group)
        return out, dropped

    def snapshot(self) -> list[Group]:
        """The groups waiting now (for a recover checkpoint)."""
        with self._lock:
            return list(self.pending)

    def restore(self, groups: list[Group]) -> None:
        with self._lock:
            self.pending.extendleft(reversed(groups))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


class StreamPusher:
    """Rollout-worker side (asyncio): one DEALER per data-parallel head, groups sent round robin,
    each send waiting for its acknowledgement (one at a time per head, so acks never cross)."""

    SOCKET = "stream_ack"  # its name in drop counts

    def __init__(self, ctx, addresses: list[str], secret: bytes, timeout_s: float, *, name: str = "rollout_worker",
                 limits: wire.Limits | None = None):
        self.secret, self.timeout_s = secret, timeout_s
        self.endpoint = wire.Endpoint(secret, name, socket=self.SOCKET, limits=limits)
        self.socks = []
        for address in addresses:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            wire.set_max_size(sock, self.endpoint.limits.max_control_message_bytes)  # acks only
            wire.secure(sock, secret, server=False, limits=self.endpoint.limits)
            sock.connect(address)
            self.socks.append((sock, address, asyncio.Lock()))
        self._next = itertools.cycle(range(len(self.socks)))

    async def push(self, group: Group) -> None:
        sock, address, lock = self.socks[next(self._next)]
        header, tensors = encode_group(group)
        async with lock:  # sealed under the lock: each head gets this sender's seqs in order
            await sock.send_multipart(self.endpoint.seal(header, tensors, to=address))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.timeout_s
            while True:  # an ack of an earlier, timed-out push may come first: skip it
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError(f"trajectory {group.uid}: no acknowledgement within {self.timeout_s:g} s")
                try:
                    frames = await asyncio.wait_for(sock.recv_multipart(copy=False), left)
                except asyncio.TimeoutError:
                    continue
                try:
                    _, ack, _ = self.endpoint.open(frames)
                except wire.BadMessage:
                    continue  # counted by the endpoint
                if ack.get("grant") == group.grant:
                    return

    def close(self) -> None:
        for sock, _, _ in self.socks:
            sock.close(0)
