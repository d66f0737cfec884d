"""Control-plane messages: one dataclass per command body and per reply, mapped to msgpack.

A request on the wire is `{"cmd": int, "rid": int, "body": {...}}`; a reply is `{"rid", "ok",
"body", "error"}` (wire.Endpoint adds the envelope that makes each message single-use). `body` is a dataclass's fields; the receiver rebuilds the dataclass with
pydantic, so a missing, unknown or mistyped field is a `BadBody` (dropped and counted by the
control server, never a crash deep in a handler). The reply type of each command is fixed here,
so both sides agree on it in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from functools import cache
from typing import Any

import pydantic


class Cmd(IntEnum):
    CONFIGURE = 1  # build models, join the process group, load the dataset shard (and recover state)
    START = 2  # resume executing requests after PAUSE
    PAUSE = 3  # hold requests (queued) until START; manager: interrupt every server
    EXIT = 4  # reply, then leave the main loop
    PING = 5  # answered by the I/O thread even while the worker computes
    FETCH = 6  # take the next samples of this worker's dataset shard or stream into its storage
    RUN_MFC = 7  # run one MFC on the given sample ids
    CLEAR = 8  # drop the given sample ids from storage
    SAVE = 9  # write an HF checkpoint of the trainable roles
    ALLOCATE = 10  # rollout worker -> manager: may I start a rollout? (staleness admission)
    FINISH = 11  # rollout worker -> manager: a rollout ended (accepted into the stream or not)
    UPDATE_WEIGHTS = 12  # master -> manager: interrupt generation, load version N, resume
    PUBLISH_WEIGHTS = 13  # master -> model worker: write the trainable weights for the servers
    RESOLVE = 14  # master -> manager: these accepted rollouts left the streams (trained, or dropped as too stale)
    SAVE_STATE = 15  # master -> model worker: write this worker's part of a recover checkpoint
    SNAPSHOT = 16  # master -> manager: the admission state, for a recover checkpoint
    RESTORE = 17  # master -> manager: start admitting, from this state (or from scratch)
    REGISTER = 18  # rollout worker -> manager: I (re)started; what must I run first?
    REROUTE = 19  # rollout worker -> manager: a server stopped answering; give me another one
    EVALUATE = 20  # master -> model worker 0: evaluate the current policy on the held-out prompts
    SERVER_VERSION = 21  # rollout worker -> manager: which weight version does this server hold now?
    BROADCAST_WEIGHTS = 22  # master -> model workers: broadcast the trainable weights to the servers (weight-update group)
    RELAY = 23  # master -> a model worker that relays for its node: forward these requests, answer with all replies
    SPLIT = 24  # master -> a relaying model worker: one FETCH or RUN_MFC for several workers as columns (columns.py)


class BadBody(ValueError):
    """A message body that does not match its command's dataclass."""


class RemoteError(RuntimeError):
    """A worker replied with an error."""


class WorkerLost(RuntimeError):
    """A worker stopped answering heartbeats."""


_REQUESTS: dict[Cmd, type] = {}


def body(cls):
    """A dataclass that travels as a message body: unknown fields are refused when parsed."""
    cls.__pydantic_config__ = pydantic.ConfigDict(extra="forbid")
    return dataclass(cls)


def message(cmd: Cmd, reply: type | None = None):
    """Register a dataclass as the body of `cmd`, with `reply` (default Empty) as its reply body."""

    def deco(cls):
        cls = body(cls)
        cls.CMD, cls.REPLY = cmd, reply or Empty
        _REQUESTS[cmd] = cls
        return cls

    return deco


@cache
def _adapter(cls: type) -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(cls)


def parse(cls: type, body: Any):
    """Rebuild a dataclass from a decoded msgpack body; BadBody (one line) if it does not fit."""
    try:
        return _adapter(cls).validate_python(body)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        raise BadBody(f"{cls.__name__}.{'.'.join(map(str, first['loc']))}: {first['msg']}") from None


def to_body(msg) -> dict:
    # pydantic's serializer (compiled) rather than dataclasses.asdict, which deep-copies in Python:
    # 8 vs 1 us for a small request, 2.3 ms vs 95 us for a Clear of 2000 ids.
    return _adapter(type(msg)).dump_python(msg)


def request(msg, rid: int, body: dict | None = None) -> dict:
    """A request header; `body`: to_body(msg) already built (one per distinct message of a fan-out)."""
    return {"cmd": int(msg.CMD), "rid": rid, "body": to_body(msg) if body is None else body}


def parse_request(header: dict):
    """A request header -> (rid, typed body); BadBody / KeyError / ValueError when malformed."""
    cmd = Cmd(header["cmd"])
    rid = header["rid"]
    if type(rid) is not int:
        raise BadBody(f"rid must be an int, got {type(rid).__name__}")
    return rid, parse(_REQUESTS[cmd], header.get("body") or {})


def reply(rid: int, body=None, error: str | None = None) -> dict:
    return {"rid": rid, "ok": error is None, "body": to_body(body) if body is not None else {}, "error": error}


# --- bodies ---------------------------------------------------------------------------------------


@body
class Empty:
    """The reply of commands that answer nothing but success."""


@body
class Status:
    """A PING reply: what a worker is doing, and the messages its process dropped: in all
    (`dropped`) and per "socket/reason" (`drops`, totals since it started), plus those of the
    processes it speaks for (`relayed_drops`, by process name: the manager's generation servers)."""

    state: str
    pid: int
    dropped: int = 0
    info: dict[str, int | float | str] = field(default_factory=dict)
    drops: dict[str, int] = field(default_factory=dict)
    relayed_drops: dict[str, dict[str, int]] = field(default_factory=dict)


@message(Cmd.PING, Status)
class Ping:
    pass


@message(Cmd.EXIT)
class Exit:
    pass


@message(Cmd.START)
class Start:
    pass


@message(Cmd.PAUSE)
class Pause:
    pass


@body
class Configured:
    n_rows: int = 0
    n_samples: int = 0
    skipped: dict[str, int] = field(default_factory=dict)


@message(Cmd.CONFIGURE, Configured)
class Configure:
    recover_from: str | None = None  # a recover checkpoint to load this worker's state from


@body
class Fetched:
    """New samples now stored on the worker: one id per sample (a prompt's group), with what the
    master needs: the size of each key per sample (`tokens`, `seqs`: see MFCDone), a stable name
    per sample (`uids`), and in async mode the versions that generated it, its rewards and its
    sequences' prompt and response lengths (scalars: metadata, like sizes)."""

    ids: list[int]
    tokens: dict[str, list[int]]
    seqs: dict[str, list[int]]
    uids: list[str]
    grants: list[int] = field(default_factory=list)  # async: the admission that produced each sample
    version_start: list[list[int]] = field(default_factory=list)  # per sample, per sequence (async)
    version_end: list[list[int]] = field(default_factory=list)
    rewards: list[list[float]] = field(default_factory=list)  # per sample, per sequence (async)
    prompt_lens: list[list[int]] = field(default_factory=list)  # per sample, per sequence (async)
    response_lens: list[list[int]] = field(default_factory=list)  # trained tokens, per sample, per sequence (async)
    dropped: list[int] = field(default_factory=list)  # grants of samples that arrived too stale to train on


@message(Cmd.FETCH, Fetched)
class Fetch:
    first_id: int
    n: int
    version: int = 0
    clear: list[int] = field(default_factory=list)  # released samples to drop first (see Master.release)


@body
class MFCDone:
    ids: list[int]
    # Per output key, per sample: its tokens (the lengths of its sequences summed: the master's cost
    # estimate when it balances an MFC over workers) and its number of sequences. Sizes, not every
    # sequence's length: they are all the master keeps (SampleBuffer), and a reply of 200 samples
    # x 6 keys x 4 sequences parses ten times faster as flat lists.
    tokens: dict[str, list[int]]
    seqs: dict[str, list[int]]
    stats: dict[str, int | float]  # an int is a count (summed over workers), a float a mean
    n: int
    seconds: float = 0.0  # this worker's time in the MFC
    then: list[MFCDone] = field(default_factory=list)  # the replies of RunMFC.then, in order


@message(Cmd.RUN_MFC, MFCDone)
class RunMFC:
    mfc: str
    ids: list[int]
    owners: dict[str, list[int]]
    clear: list[int] = field(default_factory=list)  # released samples to drop first (see Master.release)
    # MFCs to run right after, on the same ids (Master.chain): one request instead of one each.
    then: list[RunMFC] = field(default_factory=list)


@message(Cmd.CLEAR)
class Clear:
    ids: list[int]


@message(Cmd.SAVE)
class Save:
    path: str


@message(Cmd.SAVE_STATE)
class SaveState:
    path: str  # the recover checkpoint's (temporary) directory; each worker writes its own files


@body
class Published:
    failed: list[str] = field(default_factory=list)  # servers (weights addresses) the push did not reach


@message(Cmd.PUBLISH_WEIGHTS, Published)
class PublishWeights:
    """Disk: write HF weights to `path` (sync mode: then rank 0 tells the servers at `http`).
    Memory: push the tensors to the servers' update sockets `servers`."""

    version: int
    path: str | None = None
    http: list[str] = field(default_factory=list)
    servers: list[str] = field(default_factory=list)


@message(Cmd.BROADCAST_WEIGHTS, Published)
class BroadcastWeights:
    """rollout.weight_update=nccl: rank 0 broadcasts the actor's weights to the servers at `servers`
    (http addresses) over the weight-update group, which it (re)builds when they are not its members."""

    version: int
    servers: list[str]


@body
class Grant:
    ok: bool
    version: int
    server: str | None = None
    seq: int = -1  # which prompt of the worker's shard: its position in the worker's sample order
    grant: int = -1  # this admission's id: a rollout that runs again gets a new one
    # The weight version `server` holds: it runs this one or a newer one from now on. vLLM's replies
    # carry no version, so the rollout worker stamps them with this (realcore.backends.clients.vllm).
    server_version: int = 0


@message(Cmd.ALLOCATE, Grant)
class Allocate:
    worker: int


@message(Cmd.FINISH)
class Finish:
    worker: int
    seq: int
    grant: int
    accepted: bool
    server: str
    counters: dict[str, int] = field(default_factory=dict)  # e.g. reward errors of this rollout, the worker's new drops


@body
class Updated:
    seconds: float
    counters: dict[str, int] = field(default_factory=dict)  # totals reported by rollout workers so far


@message(Cmd.UPDATE_WEIGHTS, Updated)
class UpdateWeights:
    version: int
    path: str | None = None  # None: the trainer pushed the tensors already (in memory)


@message(Cmd.RESOLVE)
class Resolve:
    """Accepted rollouts (by grant) the master took from the streams: `trained` (or discarded as a
    duplicate of a prompt trained already) or `dropped` as too stale. Set-wise, so a retry is harmless."""

    trained: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)


@body
class ManagerState:
    """What admission needs to continue exactly: the version, the rollouts accepted, dropped as
    too stale and running, where each rollout worker is in its prompt order, and the prompts
    whose rollouts were lost (their worker died) and must run again first. A copy of a group that
    reached a stream without its FINISH (its worker died) counts nowhere: only `unresolved`
    grants (accepted, not yet taken by the master) can be dropped from the count."""

    version: int = 0
    accepted: int = 0
    dropped: int = 0
    next_grant: int = 0
    unresolved: list[int] = field(default_factory=list)
    # Grants the master took before their FINISH arrived (the stream acknowledges a group before
    # its worker reports it): True if dropped. Settled by the FINISH.
    taken_early: dict[int, bool] = field(default_factory=dict)
    cursor: dict[int, int] = field(default_factory=dict)  # worker -> next seq
    running: dict[int, dict[int, int]] = field(default_factory=dict)  # worker -> {seq in flight: its grant}
    redo: dict[int, list[int]] = field(default_factory=dict)  # worker -> seqs to run again
    counters: dict[str, int] = field(default_factory=dict)  # totals reported by FINISH


@message(Cmd.SNAPSHOT, ManagerState)
class Snapshot:
    pass


@message(Cmd.RESTORE)
class Restore:
    state: ManagerState
    weights_path: str | None = None  # the current version's weights (disk), for servers that restart


@body
class Registered:
    ok: bool  # False: the manager is not admitting yet (waiting for the master); ask again


@message(Cmd.REGISTER, Registered)
class Register:
    worker: int
    running: list[int] = field(default_factory=list)  # seqs this worker is still running (a manager restart)


@body
class Rerouted:
    server: str | None  # None: no healthy server right now; ask again
    server_version: int = 0  # the weight version `server` holds (as Grant.server_version)


@message(Cmd.REROUTE, Rerouted)
class Reroute:
    worker: int
    seq: int
    failed: str
    report: bool = True  # False: asking again after "none right now" (the failure was reported already)
    error: str = ""  # how the request failed (one line), for the manager's report of a server that keeps failing


@body
class Evaluated:
    metrics: dict[str, float]


@message(Cmd.EVALUATE, Evaluated)
class Evaluate:
    version: int


@body
class ServerVersion:
    version: int  # the weight version the server holds for sure (it may hold a newer one); 0 if not known


@message(Cmd.SERVER_VERSION, ServerVersion)
class AskServerVersion:
    """After a weight update interrupted a request on a vLLM server (whose replies carry no version),
    the rollout worker asks which version the server holds before it resumes the request there.
    Answered once the manager has finished the update it may be running (one command at a time)."""

    server: str


@body
class Relayed:
    """The replies of a RELAY's requests, in their order: each a reply header as `reply()` makes it
    ({rid, ok, body, error}); one a relay made itself (ok false) when a worker did not answer in time."""

    replies: list[dict[str, Any]]


@message(Cmd.RELAY, Relayed)
class Relay:
    """Requests for several workers of one node in one message (node_relay.NodeRelay forwards them, each
    to its worker in the order given, and answers once all replied): the master's messages per step
    grow with nodes, not workers. `requests`: [worker's control address, request header]."""

    requests: list[tuple[str, dict[str, Any]]]
    timeout_s: float  # a worker silent this long gets an error reply in its place


def relay_request(requests: list[tuple[str, dict]], timeout_s: float, rid: int) -> dict:
    """The RELAY request header for already-built request headers (request()): built directly,
    since its body only nests headers that are msgpack-ready already."""
    return {"cmd": int(Cmd.RELAY), "rid": rid, "body": {"requests": requests, "timeout_s": timeout_s}}


@body
class Joined:
    """The replies to a SPLIT as one (columns.join): `body` is one reply of the split command's type
    over every worker's samples, `sizes[k]` of them from its k-th worker, in order."""

    sizes: list[int]
    body: dict[str, Any]


@message(Cmd.SPLIT, Joined)
class Split:
    """One FETCH or RUN_MFC (`cmd`) for several workers of a node (node_relay.NodeRelay cuts it into
    each worker's request, columns.cut, and answers once all replied): `body` is that command's
    body with every per-sample list of the workers' requests concatenated, `sizes[k]` samples of
    them for `workers[k]` (a control address), `clears[k]` its released samples to drop first. A
    worker that fails or stays silent past `timeout_s` fails the whole SPLIT, naming it.

    To a relay of relays (WorkerPool's tops): `relays` [(a relay's control address, how many of
    `workers` it serves)], in order. The top cuts the request per relay, sends each its own SPLIT
    (`relay_timeout_s`), and answers with their Joined replies joined into one: the master neither
    cuts nor signs a request per relay."""

    cmd: int
    workers: list[str]
    sizes: list[int]
    body: dict[str, Any]
    clears: list[list[int]]
    timeout_s: float
    relays: list[tuple[str, int]] = field(default_factory=list)
    relay_timeout_s: float = 0.0


def split_request(cmd: int, workers: list[str], sizes: list[int], body: dict, clears: list[list[int]],
                  timeout_s: float, rid: int, relays: list[tuple[str, int]] = (), relay_timeout_s: float = 0.0) -> dict:
    """The SPLIT request header, built directly (its body is msgpack-ready already: to_body of the
    request over all the workers' samples, WorkerPool.request_columns)."""
    return {"cmd": int(Cmd.SPLIT), "rid": rid, "body": {"cmd": cmd, "workers": workers, "sizes": sizes, "body": body,
                                                       "clears": clears, "timeout_s": timeout_s,
                                                       "relays": list(relays), "relay_timeout_s": relay_timeout_s}}
