"""The master's sample buffer: metadata only (ids, keys, token counts, owners), never tensors.

Columns, not an object per sample: a sample's slot is its id minus the window's first id (the
master numbers samples in order and releases a step's before the next ones arrive), and each key
and MFC is a numpy array over the slots. At 1000 workers a step holds ~2000 samples; a Python
object per sample and key made the buffer the largest part of the master's time per step
(bench/master_scale.py).
"""

from __future__ import annotations

import heapq

import numpy as np

from realcore.dfg.graph import MFCNode


class _Key:
    """One key's columns: the worker holding it (-1: not there), its tokens (the sum of its
    sequence lengths, a cost) and its number of sequences."""

    __slots__ = ("owner", "tokens", "seqs")

    def __init__(self, cap: int):
        self.owner = np.full(cap, -1, np.int64)
        self.tokens = np.zeros(cap, np.int64)
        self.seqs = np.zeros(cap, np.int64)


class SampleBuffer:
    def __init__(self, nodes: list[MFCNode]):
        self.nodes = nodes
        self.base = 0  # the id of slot 0
        self.cap = 0
        self.live = np.zeros(0, bool)
        self.keys: dict[str, _Key] = {}
        self.done: dict[str, np.ndarray] = {n.name: np.zeros(0, bool) for n in nodes}  # MFC -> ran on the slot
        self.running: dict[str, np.ndarray] = {n.name: np.zeros(0, bool) for n in nodes}

    def __len__(self) -> int:
        return int(self.live.sum())

    # --- slots ------------------------------------------------------------------------------

    def _slots(self, ids) -> np.ndarray:
        return np.asarray(ids, np.int64) - self.base

    def _make_room(self, ids: np.ndarray) -> np.ndarray:
        """Slots for `ids`, the window moved (to start at the first live or new id) and grown to
        hold them."""
        lo, hi = int(ids.min()), int(ids.max())
        live = np.flatnonzero(self.live)
        if not len(live):
            self.base = lo  # nothing held: every column is clear, the window starts anew
        if lo < self.base or hi - self.base >= self.cap:
            first = min(lo, self.base + int(live[0])) if len(live) else lo
            last = max(hi, self.base + int(live[-1])) if len(live) else hi
            self._reshape(first, max(2 * (last - first + 1), 64))
        return ids - self.base

    def _reshape(self, base: int, cap: int) -> None:
        shift = self.base - base  # old slot s is new slot s + shift (every live slot fits)
        a, b = max(0, -shift), min(self.cap, cap - shift)

        def moved(old: np.ndarray, fill) -> np.ndarray:
            new = np.full(cap, fill, old.dtype)
            if a < b:
                new[a + shift:b + shift] = old[a:b]
            return new

        self.live = moved(self.live, False)
        for k in self.keys.values():
            k.owner, k.tokens, k.seqs = moved(k.owner, -1), moved(k.tokens, 0), moved(k.seqs, 0)
        for cols in (self.done, self.running):
            for name in cols:
                cols[name] = moved(cols[name], False)
        self.base, self.cap = base, cap

    # --- the master's questions -------------------------------------------------------------

    def add(self, owners: list[int], ids: list[int], seqlens: dict[str, list[list[int]]]) -> None:
        """Sample ids[i] now has each key of `seqlens`, stored on worker owners[i]."""
        self.add_many([(owners, ids, seqlens)])

    def add_many(self, parts: list[tuple[list[int], list[int], dict[str, list[list[int]]]]]) -> None:
        """add() of several (owners, ids, seqlens), one numpy assignment per key for all of them."""
        parts = [p for p in parts if p[1]]
        if not parts:
            return
        arrays = [np.asarray(ids, np.int64) for _, ids, _ in parts]
        self._make_room(np.concatenate(arrays) if len(arrays) > 1 else arrays[0])
        slots = [a - self.base for a in arrays]  # after the window moved, once for all
        for sl in slots:
            self.live[sl] = True
        by_key: dict[str, list[int]] = {}  # key -> the parts that have it
        for i, (_, _, seqlens) in enumerate(parts):
            for key in seqlens:
                by_key.setdefault(key, []).append(i)
        for key, have in by_key.items():
            col = self.keys.get(key)
            if col is None:
                col = self.keys[key] = _Key(self.cap)
            at = np.concatenate([slots[i] for i in have]) if len(have) > 1 else slots[have[0]]
            col.owner[at] = [o for i in have for o in parts[i][0]]
            col.tokens[at] = [t for i in have for t in map(sum, parts[i][2][key])]
            col.seqs[at] = [n for i in have for n in map(len, parts[i][2][key])]

    def _has(self, keys) -> np.ndarray:
        """Mask over the slots of the samples holding all of `keys`."""
        mask = self.live.copy()
        for k in keys:
            col = self.keys.get(k)
            if col is None:
                return np.zeros_like(mask)
            mask &= col.owner >= 0
        return mask

    def ready(self, node: MFCNode) -> list[int] | None:
        """`node.n_seqs` samples that hold all of its inputs and have not run it, or None."""
        mask = self._has(node.inputs)
        mask &= ~self.done[node.name]
        mask &= ~self.running[node.name]
        slots = np.flatnonzero(mask)
        return (slots[: node.n_seqs] + self.base).tolist() if len(slots) >= node.n_seqs else None

    def start(self, node: MFCNode, ids: list[int]) -> None:
        self.running[node.name][self._slots(ids)] = True

    def finish(self, node: MFCNode, ids: list[int]) -> None:
        slots = self._slots(ids)
        self.running[node.name][slots] = False
        self.done[node.name][slots] = True

    def touched(self, node: MFCNode, ids: list[int]) -> bool:
        """Whether `node` ran or runs on any of `ids`."""
        slots = self._slots(ids)
        return bool(self.done[node.name][slots].any() or self.running[node.name][slots].any())

    def common_keys(self, ids: list[int]) -> set[str]:
        """The keys every one of `ids` holds."""
        slots = self._slots(ids)
        return {k for k, col in self.keys.items() if (col.owner[slots] >= 0).all()}

    def owners(self, ids: list[int], keys) -> dict[str, list[int]]:
        """key -> the worker holding it, for each of `ids`."""
        slots = self._slots(ids)
        return {k: self.keys[k].owner[slots].tolist() for k in keys}

    def costs(self, ids: list[int], keys) -> list[int]:
        """Cost estimate of each sample for an MFC: the longest of its inputs (`keys`) it holds,
        summed over sequences; 1 if it holds none."""
        slots = self._slots(ids)
        best = np.full(len(slots), -1, np.int64)
        for k in keys:
            col = self.keys.get(k)
            if col is not None:
                np.maximum(best, np.where(col.owner[slots] >= 0, col.tokens[slots], -1), out=best)
        return np.where(best < 0, 1, best).tolist()

    def sequences(self, sid: int, key: str) -> int | None:
        """How many sequences sample `sid` has of `key` (None: it has no such key)."""
        col, slot = self.keys.get(key), sid - self.base
        return None if col is None or col.owner[slot] < 0 else int(col.seqs[slot])

    def completed(self) -> list[int]:
        """Samples every MFC has run on: ready to be released."""
        mask = self.live.copy()
        for done in self.done.values():
            mask &= done
        return (np.flatnonzero(mask) + self.base).tolist()

    def holders(self, ids: list[int]) -> dict[int, list[int]]:
        """worker -> the ids among `ids` it stores something of (the owners of their keys)."""
        if not ids or not self.keys:
            return {}
        slots = self._slots(ids)
        own = np.concatenate([col.owner[slots] for col in self.keys.values()])
        at = np.tile(slots, len(self.keys))
        held = own >= 0
        # (worker, slot) pairs as one number each, each once, sorted by worker then slot
        pairs = np.unique(own[held] * self.cap + at[held])
        workers, starts = np.unique(pairs // self.cap, return_index=True)
        return {int(w): (chunk + self.base).tolist()
                for w, chunk in zip(workers, np.split(pairs % self.cap, starts[1:]))}

    def release(self, ids: list[int]) -> None:
        slots = self._slots(ids)
        self.live[slots] = False
        for col in self.keys.values():
            col.owner[slots] = -1
        for cols in (self.done, self.running):
            for arr in cols.values():
                arr[slots] = False


def split_balanced(ids: list[int], costs: list[int], n_parts: int) -> list[list[int]]:
    """Split ids into n_parts whose counts differ by at most one, balancing total cost (greedy LPT)."""
    cap = -(-len(ids) // n_parts)
    parts: list[list[int]] = [[] for _ in range(n_parts)]
    # A heap of the parts that can take more, least loaded first: O(n log parts), so a 1000-rank
    # mesh does not cost the master seconds per step (bench/master_scale.py).
    heap = [(0, 0, p) for p in range(n_parts)]  # (load, count, part)
    # Largest first; stable (ties keep their order), as sorted(..., reverse=True) is.
    for i in np.argsort(-np.asarray(costs, np.int64), kind="stable").tolist():
        load, count, p = heapq.heappop(heap)
        parts[p].append(ids[i])
        if count + 1 < cap:
            heapq.heappush(heap, (load + costs[i], count + 1, p))
    return parts
