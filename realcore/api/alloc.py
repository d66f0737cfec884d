"""Allocation mode strings (AReaL's form) and validated parallel sizes."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

POLICY_ROLE = "actor"  # the role that generates, whose version counts, whose weights go to generation servers
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
class Mesh:
    """One training mesh: its parallel sizes, the roles placed on it (the actor's mesh is first and
    holds every role that allocation_mode does not place), and the global model-worker index of its
    rank 0 (model workers are numbered mesh after mesh)."""

    dims: ParallelDims
    roles: tuple[str, ...]
    first: int

    @property
    def workers(self) -> range:
        return range(self.first, self.first + self.dims.world_size)

    def heads(self) -> list[int]:
        """Global model-worker index of each data-parallel replica's head."""
        return [self.first + self.dims.dp_head(d) for d in range(self.dims.dp)]


@dataclass(frozen=True)
class AllocationMode:
    backend: str | None  # generation backend for async modes ("local", "sglang", "vllm"); None in sync mode
    gen: ParallelDims | None
    train: ParallelDims  # the actor's (policy's) training mesh
    # role -> its own mesh, in the order given ({} for a plain mesh: every role on `train`)
    role_meshes: dict[str, ParallelDims] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        """Model workers of the run: the sum of the training meshes' sizes."""
        return self.train.world_size + sum(m.world_size for r, m in self.role_meshes.items() if r != POLICY_ROLE)

    def meshes(self, roles: Iterable[str]) -> list[Mesh]:
        """The training meshes with the `roles` placed on each: the actor's first (with every role
        not named), then one per named role in the order given."""
        named = [r for r in self.role_meshes if r != POLICY_ROLE]
        out = [Mesh(self.train, tuple(r for r in roles if r not in named), 0)]
        for r in named:
            out.append(Mesh(self.role_meshes[r], (r,), out[-1].first + out[-1].dims.world_size))
        return out

    def mesh_dims(self, role: str) -> ParallelDims:
        """The parallel sizes of the mesh `role` runs on."""
        return self.role_meshes.get(role, self.train)


def mesh_of_worker(meshes: list[Mesh], index: int) -> Mesh:
    for m in meshes:
        if index in m.workers:
            return m
    raise ValueError(f"model worker {index}: beyond the {meshes[-1].workers.stop} workers of allocation_mode")


def mesh_of_role(meshes: list[Mesh], role: str) -> Mesh:
    for m in meshes:
        if role in m.roles:
            return m
    raise ValueError(f"role {role!r} is on no training mesh")


def parse_mesh(s: str) -> ParallelDims:
    m = _MESH.match(s)
    if not s or m is None:
        raise ValueError(f"allocation_mode: cannot parse mesh {s!r} (expected e.g. d2p1t1, d2p2t2c1e1)")
    d, p, t, c, e = (int(x) if x else 1 for x in m.groups())
    return ParallelDims(dp=d, pp=p, tp=t, cp=c, ep=e)


def parse_training(s: str) -> tuple[ParallelDims, dict[str, ParallelDims]]:
    """`d2p1t1` (every role on one mesh) or `actor:d1p1t1,critic:d1p1t1` (a mesh per named role;
    the actor must be named): (the actor's mesh, role -> mesh)."""
    if ":" not in s:
        return parse_mesh(s), {}
    placed: dict[str, ParallelDims] = {}
    for part in s.split(","):
        role, sep, mesh = part.partition(":")
        role = role.strip()
        if not sep or not role:
            raise ValueError(f"allocation_mode: {part!r} is not ROLE:MESH (e.g. actor:d1p1t1,critic:d1p1t1)")
        if role in placed:
            raise ValueError(f"allocation_mode: role {role!r} is given a mesh twice")
        placed[role] = parse_mesh(mesh.strip())
    if POLICY_ROLE not in placed:
        raise ValueError(f"allocation_mode: {s!r} places roles but not the {POLICY_ROLE} (name its mesh too, e.g. "
                         f"{POLICY_ROLE}:d1p1t1,{s})")
    return placed[POLICY_ROLE], placed


def parse_allocation_mode(s: str) -> AllocationMode:
    """`d2p1t1` (sync: one training mesh, generation colocated), `local.d1p1t1+d2p1t1`
    (generation servers + training mesh); a training mesh may be given per role,
    `actor:d1p1t1,ref:d1p1t1` (roles not named share the actor's)."""
    backend = None
    rest = s
    if "." in s:
        backend, rest = s.split(".", 1)
    parts = rest.split("+")
    if len(parts) == 1:
        if backend is not None:
            raise ValueError(f"allocation_mode: {s!r} names a generation backend but no training mesh")
        return AllocationMode(None, None, *parse_training(parts[0]))
    if len(parts) == 2:
        return AllocationMode(backend or "local", parse_mesh(parts[0]), *parse_training(parts[1]))
    raise ValueError(f"allocation_mode: {s!r} has {len(parts)} parts; at most 2 (generation+training)")
