"""Which network interface holds an address, and keeping gloo's and NCCL's sockets on it (both
listen on the hostname's address unless told an interface by name)."""

from __future__ import annotations

import os

import psutil


def bind_nccl_to(host: str) -> None:
    """NCCL's bootstrap (and socket transport) on the interface that holds `host`, exactly that one
    ("=name"; process-wide, read when NCCL first starts), unless NCCL_SOCKET_IFNAME is set already.
    A wildcard or unknown address leaves NCCL's default."""
    name = gloo_ifname(host)
    if name is not None and "NCCL_SOCKET_IFNAME" not in os.environ:
        os.environ["NCCL_SOCKET_IFNAME"] = f"={name}"


def bind_gloo_to(host: str) -> None:
    """Gloo listens on the address of the machine's hostname unless GLOO_SOCKET_IFNAME names an
    interface: name the one that holds `host` (process-wide), so gloo's sockets stay on the chosen
    address. A wildcard or unknown address leaves gloo's default."""
    name = gloo_ifname(host)
    if name is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def gloo_ifname(host: str) -> str | None:
    """The network interface that holds address `host`, if any."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == host for a in addrs):
            return name
    return None
