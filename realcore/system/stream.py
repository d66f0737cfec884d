"""The trajectory stream: rollout workers PUSH finished groups to the model workers (round robin),
which keep them until the master FETCHes them into a training batch. Tensors never pass through
the master; it learns ids, lengths and versions only.

A group (one prompt's `n` sequences) is one authenticated message: header {"group": n,
"keys": STREAM_KEYS} and, key after key, one tensor per sequence.
"""

from __future__ import annotations

import collections
import logging
import threading

import torch
import zmq

from realcore.api.data import Sample
from realcore.system import wire
from realcore.system.staleness import is_stale

log = logging.getLogger("realcore.stream")

# What a trajectory carries (the async DFG's source keys). Per token: input_ids, loss_mask,
# behav_logprobs; per sequence (1 element): rewards, version_start, version_end.
STREAM_KEYS = ("input_ids", "loss_mask", "behav_logprobs", "rewards", "version_start", "version_end")


def encode_group(sample: Sample) -> tuple[dict, list[torch.Tensor]]:
    n = len(sample["input_ids"])
    for k in STREAM_KEYS:
        if len(sample[k]) != n:
            raise ValueError(f"trajectory key {k!r} has {len(sample[k])} sequences, input_ids has {n}")
    return {"group": n, "keys": list(STREAM_KEYS)}, [t for k in STREAM_KEYS for t in sample[k]]


def decode_group(header: dict, tensors: list[torch.Tensor]) -> Sample:
    n, keys = int(header["group"]), list(header["keys"])
    if keys != list(STREAM_KEYS) or len(tensors) != n * len(keys):
        raise ValueError(f"trajectory with keys {keys} and {len(tensors)} tensors for a group of {n}")
    # clone: received tensors are views of ZeroMQ frames; storage keeps them for a while
    return {k: [t.clone() for t in tensors[i * n : (i + 1) * n]] for i, k in enumerate(keys)}


class TrajectoryStream:
    """Model-worker side: a PULL socket read by its own thread into a queue of samples."""

    def __init__(self, host: str, secret: bytes):
        self.secret = secret
        self.sock = zmq.Context.instance().socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.pending: collections.deque[Sample] = collections.deque()
        self.received = 0
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stream", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(200):
                continue
            try:
                _, header, tensors = wire.recv(self.sock, secret=self.secret)
                sample = decode_group(header, tensors)
            except (wire.BadMessage, KeyError, TypeError, ValueError) as e:
                self.dropped += 1
                log.warning("dropped a bad trajectory (%s)", e)
                continue
            self.pending.append(sample)
            self.received += 1

    def take(self, first_id: int, n: int, storage, *, current_version: int, max_head_offpolicyness: int) -> dict:
        """Move up to n pending trajectories into storage under ids first_id...; their metadata.
        Trajectories too stale for the current version are dropped and counted (a hard bound)."""
        ids, seqlens, versions, dropped, rewards = [], {k: [] for k in STREAM_KEYS}, [], 0, []
        while len(ids) < n and self.pending:
            sample, sid = self.pending.popleft(), first_id + len(ids)
            start = min(int(t) for t in sample["version_start"])
            if is_stale(start, current_version=current_version, max_head_offpolicyness=max_head_offpolicyness):
                dropped += 1
                continue
            for k in STREAM_KEYS:
                storage.put(sid, k, sample[k])
                seqlens[k].append([int(t.numel()) for t in sample[k]])
            versions.append([start, max(int(t) for t in sample["version_end"])])
            rewards += [float(r) for r in sample["rewards"]]
            ids.append(sid)
        return {"ids": ids, "seqlens": seqlens, "versions": versions, "dropped": dropped, "rewards": rewards}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()
