"""Data plane: tensors move worker to worker, never through the master.

Each model worker keeps its samples in `Storage` and serves them on a ROUTER socket (its own
thread); a peer that needs keys it does not hold fetches them with `DataClient`. Every message goes
through a wire.Endpoint (authenticated, addressed, single-use; drops counted); tensors are zero-copy
frames.
"""

from __future__ import annotations

import threading
import time

import torch
import zmq

from realcore.api.data import Sample
from realcore.transport import drops, wire


class Storage:
    """sample id -> {key: [tensor per sequence]}, shared by the main and data-server threads."""

    def __init__(self):
        self._data: dict[int, Sample] = {}
        self._lock = threading.Lock()

    def put(self, sid: int, key: str, seqs: list[torch.Tensor]) -> None:
        with self._lock:
            self._data.setdefault(sid, {})[key] = seqs

    def get(self, sid: int, key: str) -> list[torch.Tensor]:
        with self._lock:
            try:
                return self._data[sid][key]
            except KeyError:
                raise KeyError(f"sample {sid} key {key!r} is not stored here") from None

    def drop(self, ids: list[int]) -> None:
        with self._lock:
            for sid in ids:
                self._data.pop(sid, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)


def _pack(storage: Storage, items: list[tuple[int, str]]) -> tuple[list[int], list[torch.Tensor]]:
    layout, tensors = [], []
    for sid, key in items:
        seqs = storage.get(sid, key)
        layout.append(len(seqs))
        tensors.extend(seqs)
    return layout, tensors


class DataServer:
    SOCKET = "data"  # its name in drop counts

    def __init__(self, host: str, secret: bytes, storage: Storage, *, name: str = "worker",
                 limits: wire.Limits | None = None):
        self.secret = secret
        self.storage = storage
        limits = limits or wire.Limits.of()
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        wire.set_max_size(self.sock, limits.max_control_message_bytes)  # requests are metadata only
        wire.secure(self.sock, secret, server=True, limits=limits, socket=self.SOCKET)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.endpoint = wire.Endpoint(secret, name, socket=self.SOCKET, address=self.address, limits=limits)
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="data-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            peer, header, _ = wire.recv(self.sock, endpoint=self.endpoint, router=True)
        except wire.BadMessage:
            self.dropped += 1  # counted by the endpoint
            return
        try:
            items, rid = [(int(sid), str(key)) for sid, key in header["items"]], header["rid"]
        except (KeyError, TypeError, ValueError) as e:
            self.dropped += 1
            drops.count(self.SOCKET, "body", f"a data request without valid items/rid: {e!r}")
            return
        try:
            layout, tensors = _pack(self.storage, items)
            wire.send(self.sock, {"rid": rid, "layout": layout}, tensors, endpoint=self.endpoint, to=peer,
                      zero_copy=True)  # to a DEALER that talks to this server only
        except KeyError as e:
            wire.send(self.sock, {"rid": rid, "error": str(e)}, endpoint=self.endpoint, to=peer)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if wire.readable(self.sock, 200):
                self._serve()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


class DataClient:
    """Fetches samples from peers' DataServers (used by one thread only)."""

    SOCKET = "data_client"  # its name in drop counts

    def __init__(self, secret: bytes, timeout_s: float, *, name: str = "worker", limits: wire.Limits | None = None):
        self.secret = secret
        self.timeout_s = timeout_s
        self.endpoint = wire.Endpoint(secret, name, socket=self.SOCKET, limits=limits)
        self._socks: dict[str, zmq.Socket] = {}
        self._rid = 0

    def _sock(self, address: str) -> zmq.Socket:
        if address not in self._socks:
            s = zmq.Context.instance().socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            wire.set_max_size(s, self.endpoint.limits.max_message_bytes)  # replies carry tensors
            wire.secure(s, self.secret, server=False, limits=self.endpoint.limits)
            s.connect(address)
            self._socks[address] = s
        return self._socks[address]

    def fetch(self, requests: dict[str, list[tuple[int, str]]]) -> dict[tuple[int, str], list[torch.Tensor]]:
        """requests: peer address -> [(sample id, key)]. All peers are asked at once, then read."""
        sent = {}
        for address, items in requests.items():
            self._rid += 1
            wire.send(self._sock(address), {"rid": self._rid, "items": [list(i) for i in items]},
                      endpoint=self.endpoint, to=address)
            sent[address] = (self._rid, items)
        out: dict[tuple[int, str], list[torch.Tensor]] = {}
        deadline = time.monotonic() + self.timeout_s
        for address, (rid, items) in sent.items():
            while True:
                try:
                    _, header, tensors = wire.recv(self._sock(address), endpoint=self.endpoint,
                                                   timeout_s=max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise TimeoutError(f"data fetch from {address}: no reply within {self.timeout_s:g} s") from None
                except wire.BadMessage:
                    continue  # counted by the endpoint; the real reply may still come
                if header.get("rid") == rid:
                    break  # an older reply (from a timed-out call) is skipped
            if "error" in header:
                raise KeyError(f"data fetch from {address}: {header['error']}")
            pos = 0
            for item, n in zip(items, header["layout"]):
                out[item] = tensors[pos : pos + n]
                pos += n
        return out

    def close(self) -> None:
        for s in self._socks.values():
            s.close(0)
