"""The training mesh's torch.distributed rendezvous: rank 0 serves the TCPStore, the others connect.

Why not `init_method="tcp://host:port"` with a port found by binding and closing a socket: between
that close and the store's own bind, another process can take the port (the store fails to start,
or the ranks talk to a stranger); and a store given a port binds every interface, unauthenticated.
Here rank 0 binds `host:0` itself, keeps the socket listening and hands it to the TCPStore
(`master_listen_fd`), then publishes the port the socket really has: no window, one address.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from realcore.api.config import ExperimentConfig
from realcore.backends.weight_group import bind_gloo_to, bind_nccl_to
from realcore.system import keys


def serve_store(host: str, world: int, timeout: timedelta) -> dist.TCPStore:
    """Rank 0's store, listening on `host` only, on a port the OS picked (store.port)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(sockaddr)
        sock.listen(max(128, 2 * world))
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the socket from here
    try:
        # wait_for_workers=False: the others learn the port only after this returns.
        return dist.TCPStore(host, port, world, True, timeout, wait_for_workers=False, master_listen_fd=fd)
    except Exception:
        os.close(fd)
        raise


def store_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def parse_address(address: str) -> tuple[str, int]:
    """'tcp://host:port' or 'tcp://[v6]:port' -> (host, port)."""
    rest = address.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port)


def init_mesh(cfg: ExperimentConfig, resolver, rank: int, world: int, device: torch.device | None = None) -> None:
    """torch.distributed over the run's training mesh: rank 0 serves the store on system.host and
    publishes its address under keys.dist_init; the others wait for it (system.startup_timeout_s).

    `device` (the one the process selected, realcore.backends.device.select_device; None: the CPU):
    on a GPU the group is NCCL, bound to that GPU (`device_id`: its communicator is made at once, on
    the rank's own GPU, not on whatever GPU is current at the first collective); on the CPU gloo.
    Gloo (Megatron adds gloo groups beside NCCL ones) and NCCL open their sockets on system.host's
    interface."""
    host = cfg.system.host
    timeout = timedelta(seconds=cfg.system.request_timeout_s)
    if rank == 0:
        store = serve_store(host, world, timeout)
        resolver.put(keys.dist_init(cfg), store_address(host, store.port), replace=True)
    else:
        peer, port = parse_address(resolver.wait(keys.dist_init(cfg), timeout_s=cfg.system.startup_timeout_s))
        store = dist.TCPStore(peer, port, world, False, timeout)
    bind_gloo_to(host)
    if device is not None and device.type == "cuda":
        bind_nccl_to(host)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world, timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
