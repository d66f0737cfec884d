"""Allocation mode strings (AReaL's form) and validated parallel sizes."""

from __future__ import annotations

import re
from dataclasses import dataclass

_MESH = re.compile(r"^(?:d(\d+))?(?:[pP](\d+))?(?:[tm](\d+))?(?:c(\d+))?(?:e(\d+))?$")


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self):
        for k in ("dp", "pp", "tp", "cp", "ep"):
            if getattr(self, k) < 1:
                raise ValueError(f"allocation_mode: {k} must be >= 1, got {getattr(self, k)}")

    @property
    def world_size(self) -> int:
        # Expert parallelism reuses the data x tensor ranks (Megatron); it does not add processes.
        return self.dp * self.pp * self.tp * self.cp

    # Ranks follow Megatron's default order "tp-cp-ep-dp-pp" (TP fastest, PP slowest); EP is
    # carved out of the dp x cp ranks, so it does not change where a dense rank sits.
    def dp_rank(self, rank: int) -> int:
        """The data-parallel replica a global rank of this mesh belongs to."""
        return (rank // (self.tp * self.cp)) % self.dp

    def dp_head(self, dp_rank: int) -> int:
        """The global rank that speaks for a data-parallel replica (TP 0, CP 0, first PP stage)."""
        return dp_rank * self.tp * self.cp

    def is_dp_head(self, rank: int) -> bool:
        return rank == self.dp_head(self.dp_rank(rank))


@dataclass(frozen=True)
class AllocationMode:
    backend: str | None  # generation backend for async modes ("local", "sglang", "vllm"); None in sync mode
    gen: ParallelDims | None
    train: ParallelDims


def parse_mesh(s: str) -> ParallelDims:
    m = _MESH.match(s)
    if not s or m is None:
        raise ValueError(f"allocation_mode: cannot parse mesh {s!r} (expected e.g. d2p1t1, d2p2t2c1e1)")
    d, p, t, c, e = (int(x) if x else 1 for x in m.groups())
    return ParallelDims(dp=d, pp=p, tp=t, cp=c, ep=e)


def parse_allocation_mode(s: str) -> AllocationMode:
    """`d2p1t1` (sync: one training mesh, generation colocated) or `local.d1p1t1+d2p1t1`
    (generation servers + training mesh)."""
    backend = None
    rest = s
    if "." in s:
        backend, rest = s.split(".", 1)
    parts = rest.split("+")
    if len(parts) == 1:
        if backend is not None:
            raise ValueError(f"allocation_mode: {s!r} names a generation backend but no training mesh")
        return AllocationMode(None, None, parse_mesh(parts[0]))
    if len(parts) == 2:
        return AllocationMode(backend or "local", parse_mesh(parts[0]), parse_mesh(parts[1]))
    raise ValueError(f"allocation_mode: {s!r} has {len(parts)} parts; at most 2 (generation+training)")
