"""The training mesh's torch.distributed rendezvous: rank 0 serves the TCPStore, the others connect.

Each training mesh of allocation_mode (one per role placed on its own, api/alloc.py) is a
torch.distributed world of its own, with its own store: the engines take their groups from the
default group (Megatron's parallel_state, FSDP's device mesh, the torch engine's all-reduce), so
each sees exactly its mesh. Data between meshes goes through the data plane, never a collective.

Why not `init_method="tcp://host:port"` with a port found by binding and closing a socket: between
that close and the store's own bind, another process can take the port (the store fails to start,
or the ranks talk to a stranger); and a store given a port binds every interface, unauthenticated.
Here rank 0 binds `host:0` itself, keeps the socket listening and hands it to the TCPStore
(`master_listen_fd`), then publishes the port the socket really has: no window, one address.

Who can reach it (docs/security.md, "The rendezvous"): a TCPStore has no authentication. What
realcore adds: the address reaches the ranks through the name store (MAC'd: nobody can send them
elsewhere); a run on one machine (scheduler=local) binds the store and gloo to loopback, whatever
system.host says, so no other host reaches them; and rank 0 writes into its store a proof derived
from the run's secret and the store's address, which every other rank checks before it trusts the
store (a port that another process holds, after rank 0 died, is refused rather than joined).
"""

from __future__ import annotations

import hmac
import os
import socket
from datetime import timedelta

import blake3
import torch
import torch.distributed as dist

from realcore.api.config import ExperimentConfig
from realcore.transport.interfaces import bind_gloo_to, bind_nccl_to
from realcore.transport import keys
from realcore.transport.wire import mac

PROOF_KEY = "realcore/run_proof"
_PROOF_CONTEXT = "realcore 2026-11 rendezvous store proof"  # BLAKE3 key derivation  # the store key holding rank 0's proof (proof())
LOOPBACK = "127.0.0.1"


def mesh_host(cfg: ExperimentConfig) -> str:
    """The address the training mesh binds: loopback when every rank runs on this machine
    (scheduler=local), else system.host (other nodes must reach it)."""
    return LOOPBACK if cfg.scheduler == "local" else cfg.system.host


def proof(secret: bytes, address: str) -> bytes:
    """What rank 0 stores under PROOF_KEY: a MAC of the store's address under a key derived from
    the run's secret for this use only (anyone connected can read the proof: it must never pass as
    a wire message's MAC)."""
    key = blake3.blake3(secret, derive_key_context=_PROOF_CONTEXT).digest()
    return mac([address.encode()], key).hex().encode()


def check_proof(store: dist.TCPStore, secret: bytes, address: str) -> None:
    """Refuse a store that does not hold rank 0's proof for `address` (RuntimeError, one line)."""
    # Rank 0 stores the proof before it publishes the address: absent now means never (check()
    # does not wait; get() would, for request_timeout_s).
    if not store.check([PROOF_KEY]):
        raise RuntimeError(f"rendezvous: the store at {address} holds no run proof: it is not this run's")
    if not hmac.compare_digest(store.get(PROOF_KEY), proof(secret, address)):
        raise RuntimeError(f"rendezvous: the store at {address} holds a wrong run proof: it is not this run's")


def serve_store(host: str, world: int, timeout: timedelta, secret: bytes | None = None) -> dist.TCPStore:
    """Rank 0's store, listening on `host` only, on a port the OS picked (store.port); with
    `secret`, holding the run's proof for its address (check_proof)."""
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
        store = dist.TCPStore(host, port, world, True, timeout, wait_for_workers=False, master_listen_fd=fd)
    except Exception:
        os.close(fd)
        raise
    if secret is not None:
        store.set(PROOF_KEY, proof(secret, store_address(host, port)))
    return store


def store_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def parse_address(address: str) -> tuple[str, int]:
    """'tcp://host:port' or 'tcp://[v6]:port' -> (host, port)."""
    rest = address.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port)


def init_mesh(cfg: ExperimentConfig, resolver, rank: int, world: int, device: torch.device | None = None,
              mesh: int = 0) -> None:
    """torch.distributed over training mesh number `mesh` (`rank` and `world` within it): its rank 0
    serves the store on system.host and publishes its address under the mesh's dist_init key; the
    others wait for it (system.startup_timeout_s).

    `device` (the one the process selected, realcore.backends.device.select_device; None: the CPU):
    on a GPU the group is NCCL, bound to that GPU (`device_id`: its communicator is made at once, on
    the rank's own GPU, not on whatever GPU is current at the first collective); on the CPU gloo.
    Gloo (Megatron adds gloo groups beside NCCL ones) and NCCL open their sockets on system.host's
    interface (loopback on one machine: mesh_host).

    The resolver signs and checks the address with the run's secret; with it rank 0 stores the
    run's proof and every other rank checks it before joining (check_proof)."""
    host = mesh_host(cfg)
    timeout = timedelta(seconds=cfg.system.request_timeout_s)
    secret = resolver.secret
    key = keys.dist_init(cfg) if mesh == 0 else f"{keys.dist_init(cfg)}/mesh{mesh}"
    if rank == 0:
        store = serve_store(host, world, timeout, secret)
        resolver.put(key, store_address(host, store.port), replace=True)
    else:
        address = resolver.wait(key, timeout_s=cfg.system.startup_timeout_s)
        peer, port = parse_address(address)
        store = dist.TCPStore(peer, port, world, False, timeout)
        check_proof(store, secret, address)  # wait() needed the secret: it is there
    bind_gloo_to(host)
    if device is not None and device.type == "cuda":
        bind_nccl_to(host)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world, timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
