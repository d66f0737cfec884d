"""One FETCH or RUN_MFC for several workers of a node as columns (protocol.Split), and their
replies joined into one.

The master's requests in a step differ per worker only in which samples they name; sent as one
body per node (each per-sample list of the workers' requests concatenated, in order) and answered
with one reply (the workers' replies concatenated the same way, their stats merged), the master
builds, signs and parses one message per node instead of one per worker. The relay
(control.NodeRelay) cuts the body into each worker's own request (`cut`) and joins their replies
(`join`); the workers see the requests they always did. Plain dicts throughout: the relay never
parses what it passes on, each worker validates its request and the master the joined reply.
"""

from __future__ import annotations

from typing import Any

from realcore.system.protocol import Cmd, Fetch, RunMFC


def merged_stats(parts: list[tuple[dict[str, Any], int]]) -> dict[str, Any]:
    """Stats of several workers' replies as one, from (stats, n) pairs: counts (ints) summed, means
    (floats) weighted by the sequences each worker processed (a worker without the key counts as 0).
    Merging merged groups gives what merging all workers at once gives."""
    total = sum(n for _, n in parts) or 1
    out: dict[str, Any] = {}
    for k in {k for stats, _ in parts for k in stats}:
        values = [stats[k] for stats, _ in parts if k in stats]
        if all(type(v) is int for v in values):
            out[k] = sum(values)
        else:
            out[k] = sum(stats.get(k, 0.0) * n for stats, n in parts) / total
    return out


def pack(msgs: list[Fetch | RunMFC]) -> tuple[int, list[int], dict, list[list[int]]] | None:
    """(cmd, sizes, body, clears) of one Split carrying these requests (each worker's, in order), or
    None when they cannot travel as one: different commands or MFCs, or fetches of ids that do
    not follow each other."""
    clears = [list(m.clear) for m in msgs]
    if all(type(m) is Fetch for m in msgs):
        first = msgs[0]
        nxt = first.first_id
        for m in msgs:
            if m.first_id != nxt or m.version != first.version:
                return None
            nxt += m.n
        return int(Cmd.FETCH), [m.n for m in msgs], {"first_id": first.first_id, "n": nxt - first.first_id,
                                                     "version": first.version}, clears
    if all(type(m) is RunMFC for m in msgs):
        sizes = [len(m.ids) for m in msgs]
        body = _pack_mfc(msgs, sizes)
        return (int(Cmd.RUN_MFC), sizes, body, clears) if body is not None else None
    return None


def _pack_mfc(msgs: list[RunMFC], sizes: list[int]) -> dict | None:
    first = msgs[0]
    keys = first.owners.keys()
    ids: list[int] = []
    owners: dict[str, list[int]] = {k: [] for k in keys}
    for m, size in zip(msgs, sizes):
        if m.mfc != first.mfc or len(m.ids) != size or m.owners.keys() != keys or len(m.then) != len(first.then):
            return None
        ids += m.ids
        for k, v in m.owners.items():
            if len(v) != size:
                return None
            owners[k] += v
    then = [_pack_mfc([m.then[j] for m in msgs], sizes) for j in range(len(first.then))]
    if any(t is None for t in then):
        return None
    return {"mfc": first.mfc, "ids": ids, "owners": owners, "then": then}


def cut(cmd: int, body: dict, sizes: list[int], clears: list[list[int]], k: int) -> dict:
    """The k-th worker's request body of a Split. Raises KeyError/TypeError/ValueError on a
    malformed one."""
    offset = sum(sizes[:k])
    if cmd == Cmd.FETCH:
        return {"first_id": body["first_id"] + offset, "n": sizes[k], "version": body["version"], "clear": clears[k]}
    if cmd == Cmd.RUN_MFC:
        if sum(sizes) != len(body["ids"]):
            raise ValueError(f"sizes add up to {sum(sizes)}, the body has {len(body['ids'])} ids")
        return {**_cut_mfc(body, offset, sizes[k]), "clear": clears[k]}
    raise ValueError(f"command {cmd} does not split")


def _cut_mfc(body: dict, o: int, n: int) -> dict:
    return {"mfc": body["mfc"], "ids": body["ids"][o:o + n],
            "owners": {key: v[o:o + n] for key, v in body["owners"].items()},
            "then": [_cut_mfc(t, o, n) for t in body["then"]]}


_FETCHED_LISTS = ("ids", "uids", "grants", "version_start", "version_end", "rewards")


def join(cmd: int, bodies: list[dict]) -> tuple[list[int], dict]:
    """(sizes, body): the workers' reply bodies of a Split as one reply of the same type (their
    per-sample lists concatenated in order), and how many samples each answered with. Raises
    KeyError/TypeError/ValueError when they do not fit together."""
    sizes = [len(b["ids"]) for b in bodies]
    if cmd == Cmd.FETCH:
        out: dict[str, Any] = {f: [] for f in _FETCHED_LISTS}
        for b, size in zip(bodies, sizes):
            for f in _FETCHED_LISTS:
                v = b.get(f, [])
                if v and len(v) != size:  # optional lists (async) are empty or one entry per sample
                    raise ValueError(f"{f} has {len(v)} entries for {size} samples")
                out[f] += v
        out["seqlens"] = _columns(bodies, "seqlens", sizes)
        out["dropped"] = [g for b in bodies for g in b.get("dropped", [])]  # not per sample: a plain union
        return sizes, out
    if cmd == Cmd.RUN_MFC:
        return sizes, _join_mfc(bodies, sizes)
    raise ValueError(f"command {cmd} does not join")


def _join_mfc(bodies: list[dict], sizes: list[int]) -> dict:
    n_then = len(bodies[0]["then"])
    if any(len(b["then"]) != n_then for b in bodies):
        raise ValueError("the workers answered different numbers of chained MFCs")
    return {
        "ids": [i for b in bodies for i in b["ids"]],
        "outputs": _columns(bodies, "outputs", sizes),
        "stats": merged_stats([(b["stats"], b["n"]) for b in bodies]),
        "n": sum(b["n"] for b in bodies),
        "seconds": max(b.get("seconds", 0.0) for b in bodies),
        "then": [_join_mfc([b["then"][j] for b in bodies], sizes) for j in range(n_then)],
    }


def _columns(bodies: list[dict], field: str, sizes: list[int]) -> dict[str, list]:
    """A {key: per-sample list} field concatenated: every worker that answered samples must give
    every key, one entry per sample (a worker that answered none may leave keys out)."""
    keys = None
    for b, size in zip(bodies, sizes):
        if size:
            if keys is None:
                keys = b[field].keys()
            elif b[field].keys() != keys:
                raise ValueError(f"the workers answered different {field} keys")
    out: dict[str, list] = {k: [] for k in keys or ()}
    for b, size in zip(bodies, sizes):
        if size:
            for k, v in b[field].items():
                if len(v) != size:
                    raise ValueError(f"{field}[{k}] has {len(v)} entries for {size} samples")
                out[k] += v
    return out
