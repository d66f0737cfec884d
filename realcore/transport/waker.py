"""A wake-up call for an I/O thread's poller from another thread (the control plane's two sides)."""

from __future__ import annotations

import itertools
import threading

import zmq

from realcore.transport import wire


class Waker:
    """An inproc PAIR so another thread can wake the I/O thread's poller."""

    _ids = itertools.count()

    def __init__(self, ctx: zmq.Context):
        addr = f"inproc://waker-{id(self)}-{next(self._ids)}"
        self.recv_sock = ctx.socket(zmq.PAIR)
        self.recv_sock.bind(addr)
        self.send_sock = ctx.socket(zmq.PAIR)
        self.send_sock.connect(addr)
        self._lock = threading.Lock()
        self._closed = False

    def wake(self) -> None:
        """A no-op once closed: another thread (a worker loop answering late) must not touch a
        closed socket, which libzmq answers with an error or a segfault."""
        with self._lock:
            if not self._closed:
                wire.send_frames(self.send_sock, [b""], noblock=True)

    def drain(self) -> None:
        while wire.recv_waiting(self.recv_sock) is not None:
            pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self.send_sock.close(0)
        self.recv_sock.close(0)