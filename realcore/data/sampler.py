"""Which dataset sample comes next on a shard: a fresh seeded shuffle every epoch.

The order is a pure function of (seed, rank, seq): the `seq`-th sample a shard hands out is
`index(seq)`. So a shard's whole data position is one integer, which is what a recover checkpoint
(or the gserver manager, for rollout workers) keeps, and a sample's name `"{shard}:{seq}"` is
stable across restarts.
"""

from __future__ import annotations

import random


class EpochSampler:
    def __init__(self, n: int, seed: int, rank: int):
        if n <= 0:
            raise ValueError(f"dataset shard {rank} is empty")
        self.n, self.seed, self.rank = n, seed, rank
        self.seq = 0  # how many samples next() handed out
        self._epoch, self._order = -1, []

    def index(self, seq: int) -> int:
        """The dataset index of the seq-th sample (epoch seq // n, shuffled per epoch)."""
        epoch = seq // self.n
        if epoch != self._epoch:
            self._order = list(range(self.n))
            random.Random(self.seed * 1000003 + epoch * 7919 + self.rank).shuffle(self._order)
            self._epoch = epoch
        return self._order[seq % self.n]

    def next(self) -> tuple[int, int]:
        """(seq, dataset index) of the next sample."""
        seq = self.seq
        self.seq += 1
        return seq, self.index(seq)
