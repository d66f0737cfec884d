"""Control-plane messages: a typed command enum and the request/reply header layout (msgpack maps)."""

from __future__ import annotations

from enum import IntEnum


class Cmd(IntEnum):
    CONFIGURE = 1  # build models, join the process group, load the dataset shard
    START = 2  # resume executing requests after PAUSE
    PAUSE = 3  # hold requests (queued) until START
    EXIT = 4  # reply, then leave the main loop
    PING = 5  # answered by the I/O thread even while the worker computes
    FETCH = 6  # take the next samples of this worker's dataset shard into its storage
    RUN_MFC = 7  # run one MFC on the given sample ids
    CLEAR = 8  # drop the given sample ids from storage
    SAVE = 9  # write an HF checkpoint of the trainable roles
    ALLOCATE = 10  # rollout worker -> manager: may I start a rollout? (staleness admission)
    FINISH = 11  # rollout worker -> manager: a rollout ended (accepted into the stream or filtered)
    UPDATE_WEIGHTS = 12  # master -> manager: interrupt generation, load version N, resume
    PUBLISH_WEIGHTS = 13  # master -> model worker: write the trainable weights for the servers
    DROP = 14  # master -> manager: n accepted samples arrived too stale and were dropped


def request(cmd: Cmd, rid: int, body: dict) -> dict:
    return {"cmd": int(cmd), "rid": rid, "body": body}


def reply(rid: int, body: dict | None = None, error: str | None = None) -> dict:
    return {"rid": rid, "ok": error is None, "body": body or {}, "error": error}


class RemoteError(RuntimeError):
    """A worker replied with an error."""


class WorkerLost(RuntimeError):
    """A worker stopped answering heartbeats."""
