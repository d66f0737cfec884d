"""Which dataset sample comes next on a shard: a fresh seeded shuffle every epoch."""

from __future__ import annotations

import random


class EpochSampler:
    def __init__(self, n: int, seed: int, rank: int):
        if n <= 0:
            raise ValueError(f"dataset shard {rank} is empty")
        self.n, self.seed, self.rank = n, seed, rank
        self.epoch = 0
        self._order: list[int] = []

    def next(self) -> int:
        if not self._order:
            self._order = list(range(self.n))
            random.Random(self.seed * 1000003 + self.epoch * 7919 + self.rank).shuffle(self._order)
            self._order.reverse()  # pop() from the end walks the shuffle in order
            self.epoch += 1
        return self._order.pop()
