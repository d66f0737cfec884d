"""Dropped messages: one process-wide count per (socket, reason), and a log that cannot flood.

Every receiver that rejects a message calls `count(socket, reason, detail)`. The first drop of each
(socket, reason) is logged with its detail; after that at most one summary line per
`system.drop_log_interval_s`. The counts travel to the master (model workers and the manager in
their heartbeat Status, rollout workers in their FINISH counters, generation servers through the
manager), which writes each step's share as `dropped/<socket>/<reason>` in metrics.jsonl.

Reasons (docs/wire.md): mac, malformed, misaddressed, replay, stale, handshake (wire.py: a peer
that failed the CURVE handshake), body (a message the wire accepted but whose content its
receiver refused).
"""

from __future__ import annotations

import collections
import logging
import threading
import time

log = logging.getLogger("realcore.drops")

_lock = threading.Lock()
_counts: collections.Counter[str] = collections.Counter()  # "socket/reason" -> drops since the process started
_logged: collections.Counter[str] = collections.Counter()  # what the log has reported so far
_interval_s = 60.0
_last_summary = time.monotonic()



class BadMessage(ValueError):
    """A message the receiver drops (and counts): `reason` is one word (mac, malformed,
    misaddressed, replay, stale), `detail` says what exactly."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


def set_log_interval(seconds: float) -> None:
    """system.drop_log_interval_s, set once by each process's main object."""
    global _interval_s
    _interval_s = seconds


def count(socket: str, reason: str, detail: str = "") -> None:
    """Count one dropped message on `socket` (e.g. "control") for `reason` (e.g. "replay")."""
    key = f"{socket}/{reason}"
    with _lock:
        _counts[key] += 1
        first = _counts[key] == 1
        if first:
            _logged[key] = 1
    if first:
        log.warning("dropped a message on %s: %s (%s); further drops are summarised every %g s",
                    socket, reason, detail or "no detail", _interval_s)
    _maybe_summarise()


def snapshot() -> dict[str, int]:
    """Drops of this process so far, {"socket/reason": n} (also logs a summary if one is due)."""
    _maybe_summarise()
    with _lock:
        return dict(_counts)


def _maybe_summarise() -> None:
    global _last_summary
    now = time.monotonic()
    with _lock:
        if now - _last_summary < _interval_s:
            return
        _last_summary = now
        new = {k: n - _logged[k] for k, n in _counts.items() if n > _logged[k]}
        _logged.update(new)
        totals = dict(_counts)
    if new:
        log.warning("dropped messages in the last %g s: %s (totals: %s)", _interval_s,
                    ", ".join(f"{k} {n}" for k, n in sorted(new.items())),
                    ", ".join(f"{k} {n}" for k, n in sorted(totals.items())))


class Tally:
    """The master's view of other processes' totals: turns each process's running counts into the
    increments since the last call. A process is (name, pid): a restarted one starts from zero."""

    def __init__(self):
        self._seen: dict[tuple[str, int], dict[str, int]] = {}

    def update(self, process: tuple[str, int], totals: dict[str, int]) -> dict[str, int]:
        last = self._seen.get(process, {})
        self._seen[process] = dict(totals)
        return {k: n - last.get(k, 0) for k, n in totals.items() if n > last.get(k, 0)}
