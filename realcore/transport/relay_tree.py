"""The relay tree of the control plane: which model workers' requests go through which relay
(node_relay.NodeRelay, one per group of a host's workers), which relays go through a top relay
(relays of relays), and how a request for several workers is cut along that tree.

The master builds it from the workers' published addresses (relay_groups, relay_tops); the
WorkerPool routes by it (leaders_of, runs_of, one_relay_or_top); the master groups its
data-parallel replicas by it (replica_groups).
"""

from __future__ import annotations

from typing import NamedTuple


def relay_groups(addresses: dict[str, str], size: int) -> dict[str, list[str]]:
    """Model workers whose requests go through one relay (node_relay.NodeRelay): those of one host
    (their control address's), in order, up to `size` a group; the first of each relays for it.
    A worker alone in its group is sent to directly."""
    by_host: dict[str, list[str]] = {}
    for name, address in addresses.items():
        by_host.setdefault(address.rsplit(":", 1)[0], []).append(name)
    groups = [names[i:i + size] for names in by_host.values() for i in range(0, len(names), size)]
    return {g[0]: g for g in groups if len(g) > 1}


def relay_tops(leaders: list[str], fanout: int) -> dict[str, str]:
    """leader -> the first leader of its run of `fanout` leaders (in order), whose relay passes on
    every message to it (WorkerPool's tops); a leader alone in its run is sent to directly."""
    runs = [leaders[i:i + fanout] for i in range(0, len(leaders), fanout)]
    return {leader: run[0] for run in runs if len(run) > 1 for leader in run}


def leaders_of(relays: dict[str, list[str]]) -> dict[str, str]:
    """worker -> the leader whose relay forwards its requests (relays: leader -> its workers,
    itself included)."""
    return {w: leader for leader, members in relays.items() for w in members}


def replica_groups(heads: list[int], names: list[str], relay_of: dict[str, str], top_of: dict[str, str]) -> list[list[int]]:
    """The data-parallel replicas (indices) whose heads one relay serves (or the relays under one
    top), each group in replica order, groups in the order of their first replica; a head sent to
    directly is a group alone. A step's requests to a group travel as one (WorkerPool.request_columns)."""
    out: list[list[int]] = []
    by_leader: dict[str, list[int]] = {}
    for d, head in enumerate(heads):
        leader = relay_of.get(names[head])
        leader = top_of.get(leader, leader)
        if leader is None:
            out.append([d])
        elif leader in by_leader:
            by_leader[leader].append(d)
        else:
            by_leader[leader] = [d]
            out.append(by_leader[leader])
    return out


class Run(NamedTuple):
    """Consecutive workers of one request served by one relay (or sent to directly: leader None)."""

    leader: str | None
    indices: list[int]  # their positions in the request's workers


def runs_of(workers: list[str], relay_of: dict[str, str]) -> list[Run]:
    """`workers` cut into runs of consecutive workers under one relay, in order."""
    runs: list[Run] = []
    for k, w in enumerate(workers):
        leader = relay_of.get(w)
        if runs and runs[-1].leader == leader and leader is not None:
            runs[-1].indices.append(k)
        else:
            runs.append(Run(leader, [k]))
    return runs


def one_relay_or_top(workers: list[str], runs: list[Run], top_of: dict[str, str]) -> bool:
    """Whether a request for `workers` (cut into `runs`) can travel as one message: one worker sent
    to directly, the workers of one relay, or those of several relays under one top (each relay's
    workers in one run)."""
    leaders = [r.leader for r in runs]
    tops = {top_of.get(leader) for leader in leaders}
    return not (None in leaders and len(workers) != 1 or len(set(leaders)) != len(leaders)
                or len(runs) > 1 and (len(tops) != 1 or None in tops))
