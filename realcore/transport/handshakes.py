"""Failed CURVE handshakes, counted: one thread per process reads the monitor sockets of its CURVE
servers (wire.secure) and counts each failed handshake (a peer without the run's keys) in
realcore.transport.drops under the listening socket's name, reason "handshake"."""

from __future__ import annotations

import itertools
import threading
import time

import zmq
from zmq.backend import zmq_poll
from zmq.utils.monitor import parse_monitor_message

from realcore.transport import drops

_POLLIN = int(zmq.POLLIN)


_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


class _HandshakeWatch:
    """One thread per process reading the monitor sockets of its CURVE servers: each failed
    handshake (a peer without the keys) is counted in realcore.transport.drops. A monitor ends (and
    its PAIR is closed here) when its socket closes, or when the context terminates."""

    def __init__(self):
        self._lock = threading.Lock()
        self._new: list[tuple[zmq.Socket, str]] = []
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()

    def watch(self, sock: zmq.Socket, socket: str) -> None:
        # A unique address: pyzmq's get_monitor_socket names it after the socket's fd, which a new
        # socket reuses while the closed one's monitor may still hold that name ("Address in use").
        address = f"inproc://realcore-handshakes-{next(self._ids)}"
        sock.monitor(address, _HANDSHAKE_FAILED | zmq.EVENT_MONITOR_STOPPED)
        monitor = sock.context.socket(zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(address)
        with self._lock:
            self._new.append((monitor, socket))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="wire-handshakes", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        watched: dict[zmq.Socket, str] = {}
        while True:
            with self._lock:
                watched.update(self._new)
                self._new.clear()
            if not watched:
                time.sleep(0.2)
                continue
            try:
                for monitor, _ in zmq_poll([(m, _POLLIN) for m in watched], 200):
                    event = parse_monitor_message(monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                        del watched[monitor]
                        monitor.close(0)
                        continue
                    drops.count(watched[monitor], "handshake",
                                f"a peer failed the CURVE handshake ({event['endpoint'].decode(errors='replace')}, "
                                f"event {event['event']}, value {event['value']})")
            except zmq.ZMQError:  # the context is terminating: let the monitors go
                for monitor in watched:
                    monitor.close(0)
                watched.clear()
                with self._lock:
                    self._thread = None
                return


_handshakes = _HandshakeWatch()


def watch(sock: zmq.Socket, socket: str) -> None:
    """Count `sock`'s failed handshakes under `socket` (its name in drop counts). Call it before bind."""
    _handshakes.watch(sock, socket)
