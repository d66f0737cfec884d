"""One FETCH or RUN_MFC for several workers of a node as columns (protocol.Split), and their
replies joined into one.

The master's requests in a step differ per worker only in which samples they name. It sends a
node's workers one request over all their samples (every per-sample list of theirs concatenated,
in order, with how many samples each worker gets: Master.dispatch builds it so, pool.Columns)
and gets one reply back (their replies concatenated the same way, their stats merged): it builds,
signs and parses one message per node instead of one per worker. The relay (node_relay.NodeRelay)
cuts the request into each worker's own (`cut`) and joins their replies (`join`); the workers see
the requests they always did. Plain dicts at the relay: it never parses what it passes on; each
worker validates its request and the master the joined reply.
"""

from __future__ import annotations

from typing import Any

from realcore.transport.protocol import Cmd, Fetch, RunMFC


def merged_stats(parts: list[tuple[dict[str, Any], int]]) -> dict[str, Any]:
    """Stats of several workers' replies as one, from (stats, n) pairs: counts (ints) summed, maxima
    (keys ending in _max) the largest, means (other floats) weighted by the sequences each worker
    processed (a worker without the key counts as 0). Merging merged groups gives what merging all
    workers at once gives."""
    total = sum(n for _, n in parts) or 1
    out: dict[str, Any] = {}
    for k in {k for stats, _ in parts for k in stats}:
        values = [stats[k] for stats, _ in parts if k in stats]
        if all(type(v) is int for v in values):
            out[k] = sum(values)
        elif k.endswith("_max"):  # a maximum (gen/response_len_max, ppo/ratio_max): the largest worker's
            out[k] = max(values)
        else:
            out[k] = sum(stats.get(k, 0.0) * n for stats, n in parts) / total
    return out


def check(msg: Fetch | RunMFC, sizes: list[int]) -> None:
    """ValueError unless `msg` can be cut by `sizes`: a Fetch of sum(sizes) samples, or a RunMFC
    (and each MFC chained to it) on sum(sizes) ids with an owner per id for every input."""
    if type(msg) is Fetch:
        if msg.n != sum(sizes):
            raise ValueError(f"a Fetch of {msg.n} samples cut into {sizes}")
        return
    if type(msg) is not RunMFC:
        raise ValueError(f"a {type(msg).__name__} does not split")
    _check_mfc(msg, sum(sizes), sizes)


def _check_mfc(m: RunMFC, n: int, sizes: list[int]) -> None:
    bad = [k for k, v in m.owners.items() if len(v) != len(m.ids)]
    if len(m.ids) != n or bad:
        raise ValueError(f"RunMFC {m.mfc}: {len(m.ids)} ids cut into {sizes}" + (f", owners of {bad} not one per id" if bad else ""))
    for t in m.then:
        _check_mfc(t, n, sizes)


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
        out["tokens"] = _columns(bodies, "tokens", sizes)
        out["seqs"] = _columns(bodies, "seqs", sizes)
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
        "tokens": _columns(bodies, "tokens", sizes),
        "seqs": _columns(bodies, "seqs", sizes),
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
