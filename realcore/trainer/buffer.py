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


class SampleBuffer:
    """Per key (a row each, `key_row`): the worker holding it (-1: not there), its tokens (the sum
    of its sequences' lengths: a cost) and its number of sequences; per MFC (a row each): whether
    it ran (`done`) or runs (`running`) on the sample. Columns are slots."""

    def __init__(self, nodes: list[MFCNode]):
        self.nodes = nodes
        self.base = 0  # the id of slot 0
        self.cap = 0
        self.live = np.zeros(0, bool)
        self.key_row: dict[str, int] = {}
        self.owner = np.zeros((0, 0), np.int64)
        self.tokens = np.zeros((0, 0), np.int64)
        self.seqs = np.zeros((0, 0), np.int64)
        self.mfc_row = {n.name: r for r, n in enumerate(nodes)}
        self.done = np.zeros((len(nodes), 0), bool)
        self.running = np.zeros((len(nodes), 0), bool)

    def __len__(self) -> int:
        return int(self.live.sum())

    # --- slots ------------------------------------------------------------------------------

    def _slots(self, ids) -> np.ndarray:
        return np.asarray(ids, np.int64) - self.base

    def _make_room(self, ids: np.ndarray) -> None:
        """Move the window (to start at the first live or new id) and grow it to hold `ids`."""
        lo, hi = int(ids.min()), int(ids.max())
        live = np.flatnonzero(self.live)
        if not len(live):
            self.base = lo  # nothing held: every column is clear, the window starts anew
        if lo < self.base or hi - self.base >= self.cap:
            first = min(lo, self.base + int(live[0])) if len(live) else lo
            last = max(hi, self.base + int(live[-1])) if len(live) else hi
            self._reshape(first, max(2 * (last - first + 1), 64))

    def _reshape(self, base: int, cap: int, n_keys: int | None = None) -> None:
        shift = self.base - base  # old slot s is new slot s + shift (every live slot fits)
        a, b = max(0, -shift), min(self.cap, cap - shift)

        def moved(old: np.ndarray, fill, rows: int | None = None) -> np.ndarray:
            if old.ndim == 1:
                new = np.full(cap, fill, old.dtype)
                if a < b:
                    new[a + shift:b + shift] = old[a:b]
                return new
            new = np.full((old.shape[0] if rows is None else rows, cap), fill, old.dtype)
            if a < b:
                new[:old.shape[0], a + shift:b + shift] = old[:, a:b]
            return new

        self.live = moved(self.live, False)
        self.owner, self.tokens, self.seqs = (moved(self.owner, -1, n_keys), moved(self.tokens, 0, n_keys),
                                              moved(self.seqs, 0, n_keys))
        self.done, self.running = moved(self.done, False), moved(self.running, False)
        self.base, self.cap = base, cap

    def _rows(self, keys) -> list[int]:
        """The rows of `keys`, new keys given one (the columns grow a row each)."""
        new = [k for k in dict.fromkeys(keys) if k not in self.key_row]
        if new:
            for k in new:
                self.key_row[k] = len(self.key_row)
            self._reshape(self.base, self.cap, len(self.key_row))
        return [self.key_row[k] for k in keys]

    # --- the master's questions -------------------------------------------------------------

    def add(self, owners: list[int], ids: list[int], tokens: dict[str, list[int]], seqs: dict[str, list[int]]) -> None:
        """Sample ids[i] now has each key of `tokens`, stored on worker owners[i], with tokens[key][i]
        tokens in seqs[key][i] sequences."""
        self.add_many([(owners, ids, tokens, seqs)])

    def add_many(self, parts: list[tuple[list[int], list[int], dict[str, list[int]], dict[str, list[int]]]]) -> None:
        """add() of several (owners, ids, tokens, seqs): the parts with the same keys (usually all)
        joined as Python lists first, then one numpy assignment per column."""
        by_keys: dict[tuple[str, ...], tuple[list, list, dict, dict]] = {}
        for owners, ids, tokens, seqs in parts:
            if tokens.keys() != seqs.keys() or any(len(v) != len(ids) for d in (tokens, seqs) for v in d.values()):
                raise ValueError(f"SampleBuffer.add: tokens and seqs must name the same keys, one entry per id ({len(ids)})")
            if len(owners) != len(ids):
                raise ValueError(f"SampleBuffer.add: {len(owners)} owners for {len(ids)} ids")
            if not ids:
                continue
            joined = by_keys.get(tuple(tokens))
            if joined is None:
                by_keys[tuple(tokens)] = ([*owners], [*ids], {k: [*v] for k, v in tokens.items()},
                                          {k: [*v] for k, v in seqs.items()})
            else:
                joined[0].extend(owners)
                joined[1].extend(ids)
                for k in tokens:
                    joined[2][k].extend(tokens[k])
                    joined[3][k].extend(seqs[k])
        if not by_keys:
            return
        arrays = [np.asarray(p[1], np.int64) for p in by_keys.values()]
        self._make_room(np.concatenate(arrays) if len(arrays) > 1 else arrays[0])
        for (owners, _, tokens, seqs), ids in zip(by_keys.values(), arrays):
            self.live[ids - self.base] = True
            if not tokens:
                continue
            at = np.ix_(self._rows(list(tokens)), ids - self.base)  # after the window moved and grew
            self.owner[at] = np.asarray(owners, np.int64)
            self.tokens[at] = list(tokens.values())
            self.seqs[at] = [seqs[k] for k in tokens]

    def _has(self, keys) -> np.ndarray:
        """Mask over the slots of the samples holding all of `keys`."""
        if any(k not in self.key_row for k in keys):
            return np.zeros_like(self.live)
        return self.live & (self.owner[[self.key_row[k] for k in keys]] >= 0).all(axis=0)

    def ready(self, node: MFCNode) -> list[int] | None:
        """`node.n_seqs` samples that hold all of its inputs and have not run it, or None."""
        r = self.mfc_row[node.name]
        mask = self._has(node.inputs)
        mask &= ~self.done[r]
        mask &= ~self.running[r]
        slots = np.flatnonzero(mask)
        return (slots[: node.n_seqs] + self.base).tolist() if len(slots) >= node.n_seqs else None

    def start(self, node: MFCNode, ids: list[int]) -> None:
        self.running[self.mfc_row[node.name], self._slots(ids)] = True

    def finish(self, node: MFCNode, ids: list[int]) -> None:
        r, slots = self.mfc_row[node.name], self._slots(ids)
        self.running[r, slots] = False
        self.done[r, slots] = True

    def touched(self, node: MFCNode, ids: list[int]) -> bool:
        """Whether `node` ran or runs on any of `ids`."""
        r, slots = self.mfc_row[node.name], self._slots(ids)
        return bool(self.done[r, slots].any() or self.running[r, slots].any())

    def common_keys(self, ids: list[int]) -> set[str]:
        """The keys every one of `ids` holds."""
        every = (self.owner[:, self._slots(ids)] >= 0).all(axis=1)
        return {k for k, r in self.key_row.items() if every[r]}

    def owners(self, ids: list[int], keys) -> dict[str, list[int]]:
        """key -> the worker holding it, for each of `ids`."""
        slots = self._slots(ids)
        return {k: self.owner[self.key_row[k], slots].tolist() for k in keys}

    def costs(self, ids: list[int], keys) -> list[int]:
        """Cost estimate of each sample for an MFC: the longest of its inputs (`keys`) it holds,
        summed over sequences; 1 if it holds none."""
        rows = [self.key_row[k] for k in keys if k in self.key_row]
        if not rows:
            return [1] * len(ids)
        at = np.ix_(rows, self._slots(ids))
        best = np.where(self.owner[at] >= 0, self.tokens[at], -1).max(axis=0)
        return np.where(best < 0, 1, best).tolist()

    def sequences(self, sid: int, key: str) -> int | None:
        """How many sequences sample `sid` has of `key` (None: it has no such key)."""
        r, slot = self.key_row.get(key), sid - self.base
        return None if r is None or self.owner[r, slot] < 0 else int(self.seqs[r, slot])

    def completed(self) -> list[int]:
        """Samples every MFC has run on: ready to be released."""
        return (np.flatnonzero(self.live & self.done.all(axis=0)) + self.base).tolist()

    def holders(self, ids: list[int]) -> dict[int, list[int]]:
        """worker -> the ids among `ids` it stores something of (the owners of their keys)."""
        if not ids or not self.key_row:
            return {}
        slots = self._slots(ids)
        own = self.owner[:, slots]
        held = own >= 0
        # (worker, slot) pairs as one number each, each once, sorted by worker then slot
        pairs = np.unique(own[held] * self.cap + np.broadcast_to(slots, own.shape)[held])
        workers = pairs // self.cap
        cuts = [0, *(np.flatnonzero(workers[1:] != workers[:-1]) + 1).tolist(), len(pairs)]
        sids = (pairs % self.cap + self.base).tolist()  # one conversion, then slices per worker
        return {w: sids[a:b] for w, a, b in zip(workers[cuts[:-1]].tolist(), cuts[:-1], cuts[1:])}

    def release(self, ids: list[int]) -> None:
        slots = self._slots(ids)
        self.live[slots] = False
        self.owner[:, slots] = -1
        self.done[:, slots] = False
        self.running[:, slots] = False


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


def take(col: list, spans: list[tuple[int, int]]) -> list:
    """The entries of `col` in the index ranges `spans` (one slice when there is one range)."""
    return col[spans[0][0]:spans[0][1]] if len(spans) == 1 else [x for a, b in spans for x in col[a:b]]


def spans_of(starts: list[int], ds: list[int]) -> list[tuple[int, int]]:
    """Index ranges [starts[d], starts[d + 1]) of replicas `ds`, adjacent ones merged."""
    spans: list[tuple[int, int]] = []
    for d in ds:
        if spans and spans[-1][1] == starts[d]:
            spans[-1] = (spans[-1][0], starts[d + 1])
        else:
            spans.append((starts[d], starts[d + 1]))
    return spans
