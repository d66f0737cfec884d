"""The weight-update process group between a trainer and generation servers (SGLang's
`/init_weights_update_group` + `/update_weights_from_distributed` protocol), both sides.

Rank 0 is the trainer, which serves the group's TCPStore; server k joins as ranks
`rank_offset .. rank_offset + tp - 1` (the built-in server has tp 1). The group is NOT the default
process group: each side builds it over its own client of the store the way SGLang's
`init_custom_process_group` does (new_group), so a server keeps its own default group (TP) and the
trainer its training mesh.

An update is a sequence of buckets; each bucket is one HTTP request carrying the names, dtypes and
shapes, and one broadcast from rank 0 per tensor, in that order (what SGLang's receiver does).

Backend: "nccl" when the trainer has CUDA, else "gloo" (CPU runs and tests); the trainer decides
and sends it in the init request. Every collective waits at most `timeout`, and a timed-out NCCL
collective raises in its caller: the group's NCCL watchdog only aborts its communicators
(TORCH_NCCL_ASYNC_ERROR_HANDLING=2 while the group is made, `nccl_errors_raise`) instead of killing
the process, as torch's default (3) does. Both gloo and NCCL open their sockets on `host`'s
interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME), unless the user named one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _new_process_group_helper, _world

from realcore.transport.interfaces import bind_gloo_to, bind_nccl_to

# The dtype names SGLang's clients send (str(dtype) without "torch.").
DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32",
                                                   "int8", "uint8", "bool")}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def new_group(backend: str, store: dist.Store, rank: int, world_size: int, group_name: str, *, host: str,
              timeout: timedelta):
    """A process group over `store`, outside torch.distributed's default group; returns once all
    `world_size` ranks joined (or raises at `timeout`). Built exactly as SGLang's server builds its
    side (its `init_custom_process_group`): the store prefixed with `group_name`, then torch's own
    group constructor, which prefixes again per device and, for gloo, makes one gloo group per device
    type and agrees a sequence number through the store. Any other layout of keys never meets
    SGLang's (seen against SGLang 0.5.23: the join waited until its deadline).
    Gloo listens on `host`'s interface (GLOO_SOCKET_IFNAME), not the machine's hostname, NCCL
    bootstraps there (NCCL_SOCKET_IFNAME). An NCCL group's timed-out collective raises in the caller
    (nccl_errors_raise): `timeout` must cover the longest wait of a collective on it."""
    if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise ValueError("weight update group: backend nccl needs CUDA and a torch built with NCCL (use gloo on CPU)")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"weight update group: backend must be nccl or gloo, got {backend!r}")
    if backend == "gloo":
        bind_gloo_to(host)
        scope = contextlib.nullcontext()
    else:
        bind_nccl_to(host)
        scope = nccl_errors_raise()
    with scope:  # ProcessGroupNCCL reads its error handling once, in its constructor
        pg, _ = _new_process_group_helper(world_size, rank, [], dist.Backend(backend),
                                          dist.PrefixStore(group_name, store), group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def close_group(pg) -> None:
    """Shut a new_group's group down and forget its name (torch refuses a name twice while it is known)."""
    try:
        dist.destroy_process_group(pg)
    except Exception:  # broken already, or never fully built: nothing more to release
        pass


# torch 2.13's ProcessGroupNCCL (ErrorHandlingMode in ProcessGroupNCCL.hpp): 0 no handling, 1 abort
# and tear the process down, 2 (CleanUpOnly) abort the communicators and keep the process, 3 (the
# default, SkipCleanUp) tear down without aborting. The watchdog rethrows a timed-out work's error
# on its own thread (killing the process) only when tearing down; under 2 it aborts the
# communicators and marks the work failed, and `work.wait(timeout)` rethrows that error in the
# caller (its blocking-wait branch: "throw exception from the main CPU thread").
NCCL_ERRORS_RAISE = "2"
_env_lock = threading.Lock()


@contextlib.contextmanager
def nccl_errors_raise():
    """Within the block, a new NCCL process group raises a timed-out collective in its caller
    instead of killing the process (TORCH_NCCL_ASYNC_ERROR_HANDLING=2); the variable is restored after."""
    with _env_lock:
        before = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = NCCL_ERRORS_RAISE
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
            else:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = before


def wait_listening(host: str, port: int, timeout_s: float) -> None:
    """Return once `host:port` accepts a TCP connection (the trainer's TCPStore is up); ValueError
    at `timeout_s` (a port where nothing listens, an address that drops packets)."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            socket.create_connection((host, port), timeout=left).close()
            return
        except OSError:  # refused (not yet, or never), unreachable, or timed out
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    raise ValueError(f"weight update group: nothing accepted a connection at {host}:{port} within {timeout_s:g} s "
                     "(system.weight_group_connect_timeout_s)")


def device_of(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def buckets(state: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """Names in order, cut into buckets of at most `bucket_bytes` (a larger tensor is a bucket alone).
    A tensor that shares storage with an earlier one (tied embeddings) is sent once, under its first name."""
    out: list[list[str]] = [[]]
    size, seen = 0, set()
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.numel() else None
        if key in seen:
            continue
        seen.add(key)
        nbytes = t.numel() * t.element_size()
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += nbytes
    return [b for b in out if b]


def send(group, tensors: list[torch.Tensor], timeout: timedelta) -> None:
    """Rank 0: broadcast each tensor in order (contiguous, on the group's device)."""
    works = [group.broadcast(t, 0) for t in tensors]
    for w in works:
        w.wait(timeout)


def receive(group, dtypes: list[str], shapes: list[list[int]], device: torch.device, timeout: timedelta
            ) -> list[torch.Tensor]:
    """A server's rank: the tensors of one bucket, as rank 0 broadcasts them."""
    tensors = [torch.empty(shape, dtype=DTYPES[d], device=device) for d, shape in zip(dtypes, shapes)]
    works = [group.broadcast(t, 0) for t in tensors]
    for w in works:
        w.wait(timeout)
    return tensors


def in_thread(fn, *args, **kwargs) -> asyncio.Future:
    """`fn(*args, **kwargs)` on a daemon thread of its own, awaitable: a collective that waits until its
    deadline must neither hold a thread of the event loop's executor nor keep asyncio.run (which
    joins those) from returning once its caller gave up on it."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:
                fut.set_exception(e)
            else:
                fut.set_result(result)
        except concurrent.futures.InvalidStateError:  # given up on (cancelled) meanwhile
            pass

    threading.Thread(target=run, name="weight-group", daemon=True).start()
    return asyncio.wrap_future(fut)
