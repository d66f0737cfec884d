"""A deadline for a request's headers in an aiohttp server (slowloris), which aiohttp lacks: its
parser waits for the rest of a header indefinitely, and versions before 3.14 do not even time out a
connection that never completes its first request.

Each connection's protocol is wrapped by `Watchdog`, which closes the transport when no request
has started (headers complete, the handler running) within `header_timeout_s` of the connection
opening or of its last answer; `middleware` tells it when a request starts and ends. This runs at
the transport, before aiohttp's handler and so before the token check: a client that never
completes its headers costs a buffer and a timer. A body's deadline is the handler's own (its read
under asyncio.wait_for), and aiohttp's `lingering_time` bounds the discarding of a body no handler read.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from aiohttp import web

from realcore.transport import wire

# The watchdog of each open connection, by aiohttp's protocol (request.protocol); removed on close.
_WATCHDOGS: dict[object, Watchdog] = {}


class Watchdog(asyncio.Protocol):
    """aiohttp's protocol `inner`, closed when a request's headers take longer than `timeout_s`."""

    def __init__(self, inner: asyncio.Protocol, timeout_s: float):
        self.inner, self.timeout_s = inner, timeout_s
        self.transport: asyncio.Transport | None = None
        self.busy = 0  # requests started and not yet answered
        self.partial = False  # bytes came since the deadline was armed: a request is under way
        self.timer: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.partial = False
        self.timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expire)

    def _expire(self) -> None:
        self.timer = None
        if self.busy or self.transport is None:
            return
        if self.partial:  # an idle keep-alive connection is closed quietly; a half-sent request is counted
            wire.count_dropped("http", "slow", f"request headers not complete within {self.timeout_s:g} s "
                                               "(system.http_header_timeout_s)")
        self.transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        _WATCHDOGS[self.inner] = self
        self.inner.connection_made(transport)
        self.arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.transport = None
        _WATCHDOGS.pop(self.inner, None)
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self.busy:
            self.partial = True
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


@web.middleware
async def middleware(request: web.Request, handler):
    """First in the app's chain: a request whose handler runs has its headers; its answer re-arms the deadline."""
    dog = _WATCHDOGS.get(request.protocol)
    if dog is None:  # a connection not served through `listen` (aiohttp's test client)
        return await handler(request)
    dog.busy += 1
    try:
        return await handler(request)
    finally:
        dog.busy -= 1
        if not dog.busy and dog.transport is not None:
            dog.arm()


async def listen(protocol_factory: Callable[[], asyncio.Protocol], host: str, port: int,
                 header_timeout_s: float) -> asyncio.AbstractServer:
    """Serve `protocol_factory` (an aiohttp AppRunner's `server`) on host:port, each connection
    under a Watchdog (as aiohttp's TCPSite would, with a backlog of 128)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: Watchdog(protocol_factory(), header_timeout_s), host, port, backlog=128)
