"""The master's sample buffer: metadata only (ids, keys, sequence lengths, owners), never tensors."""

from __future__ import annotations

import heapq

from realcore.dfg.graph import MFCNode


class SampleMeta:
    """One sample's metadata (a plain class with slots: the master makes one per sample per step)."""

    __slots__ = ("id", "keys", "done", "running")

    def __init__(self, id: int):
        self.id = id
        self.keys: dict[str, tuple[int, int, int]] = {}  # key -> (owner worker, tokens, sequences)
        self.done: set[str] = set()  # MFC nodes that ran on this sample
        self.running: set[str] = set()


class SampleBuffer:
    def __init__(self, nodes: list[MFCNode]):
        self.nodes = nodes
        self.samples: dict[int, SampleMeta] = {}

    def __len__(self) -> int:
        return len(self.samples)

    def add(self, owners: list[int], ids: list[int], seqlens: dict[str, list[list[int]]]) -> None:
        """Sample ids[i] now has each key of `seqlens`, stored on worker owners[i]. Kept per key: its
        tokens (the sum of its sequence lengths, a cost) and how many sequences."""
        samples = self.samples
        # Per key, its tokens and sequences per sample, in C loops (not per sample and key in Python).
        items = [(key, list(map(sum, lens)), list(map(len, lens))) for key, lens in seqlens.items()]
        for i, sid in enumerate(ids):
            meta = samples.get(sid)
            if meta is None:
                meta = samples[sid] = SampleMeta(sid)
            keys, owner = meta.keys, owners[i]
            for key, tokens, counts in items:
                keys[key] = (owner, tokens[i], counts[i])

    def ready(self, node: MFCNode) -> list[int] | None:
        """`node.n_seqs` samples that hold all of its inputs and have not run it, or None."""
        name, inputs = node.name, set(node.inputs)
        ids = [
            m.id for m in self.samples.values()
            if name not in m.done and name not in m.running and m.keys.keys() >= inputs
        ]
        return ids[: node.n_seqs] if len(ids) >= node.n_seqs else None

    def start(self, node: MFCNode, ids: list[int]) -> None:
        for sid in ids:
            self.samples[sid].running.add(node.name)

    def finish(self, node: MFCNode, ids: list[int]) -> None:
        for sid in ids:
            self.samples[sid].running.discard(node.name)
            self.samples[sid].done.add(node.name)

    def owners(self, ids: list[int], keys) -> dict[str, list[int]]:
        """key -> the worker holding it, for each of `ids`."""
        metas = [self.samples[sid].keys for sid in ids]
        return {k: [m[k][0] for m in metas] for k in keys}

    def tokens(self, sid: int, keys: tuple[str, ...]) -> int:
        """Cost estimate of a sample for an MFC: the longest of its inputs, summed over sequences."""
        have, best = self.samples[sid].keys, None
        for k in keys:  # a loop, not max(generator): called per sample and MFC
            if k in have:
                n = have[k][1]
                if best is None or n > best:
                    best = n
        return 1 if best is None else best

    def sequences(self, sid: int, key: str) -> int | None:
        """How many sequences sample `sid` has of `key` (None: it has no such key)."""
        entry = self.samples[sid].keys.get(key)
        return None if entry is None else entry[2]

    def completed(self) -> list[int]:
        """Samples every MFC has run on: ready to be released."""
        n = len(self.nodes)  # `done` holds only names of these nodes
        return [m.id for m in self.samples.values() if len(m.done) == n]

    def holders(self, ids: list[int]) -> dict[int, list[int]]:
        """worker -> the ids among `ids` it stores something of (the owners of their keys)."""
        out: dict[int, list[int]] = {}
        for sid in ids:
            for w in {entry[0] for entry in self.samples[sid].keys.values()}:
                out.setdefault(w, []).append(sid)
        return out

    def release(self, ids: list[int]) -> None:
        for sid in ids:
            del self.samples[sid]


def split_balanced(ids: list[int], costs: list[int], n_parts: int) -> list[list[int]]:
    """Split ids into n_parts whose counts differ by at most one, balancing total cost (greedy LPT)."""
    cap = -(-len(ids) // n_parts)
    parts: list[list[int]] = [[] for _ in range(n_parts)]
    # A heap of the parts that can take more, least loaded first: O(n log parts), so a 1000-rank
    # mesh does not cost the master seconds per step (bench/master_scale.py).
    heap = [(0, 0, p) for p in range(n_parts)]  # (load, count, part)
    for i in sorted(range(len(ids)), key=costs.__getitem__, reverse=True):  # stable: ties keep their order
        load, count, p = heapq.heappop(heap)
        parts[p].append(ids[i])
        if count + 1 < cap:
            heapq.heappush(heap, (load + costs[i], count + 1, p))
    return parts
