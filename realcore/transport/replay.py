"""Replay protection of the wire (wire.Endpoint): each (sender, seq) accepted once, within a
window below the sender's highest seq, nothing stamped before the receiver's start minus the
clock skew. docs/wire.md, "Wire security"."""

from __future__ import annotations

import collections
import threading

from realcore.transport.drops import BadMessage


class ReplayGuard:
    """Which (sender, seq) a receiver has accepted: per sender the highest seq and a bitmask of
    the `window` below it, least recently heard senders forgotten past `max_senders` (the wire's
    REPLAY_WINDOW and MAX_SENDERS)."""

    def __init__(self, not_before: float, window: int, max_senders: int):
        self.not_before = not_before  # reject anything stamped earlier (this receiver's start - skew)
        self.window, self.max_senders = window, max_senders
        self._window_mask = (1 << window) - 1
        self.forgotten_until = float("-inf")  # the last stamp of the senders forgotten so far
        self._senders: collections.OrderedDict[str, list] = collections.OrderedDict()  # id -> [highest, mask, last ts]
        self._lock = threading.Lock()

    def accept(self, sender: str, seq: int, ts: float) -> None:
        """Record (sender, seq) as received, or raise BadMessage (replay or stale)."""
        if ts < self.not_before:
            raise BadMessage("stale", f"{sender} #{seq} was sent {self.not_before - ts:.1f} s before this receiver's "
                             "start minus system.clock_skew_s")
        with self._lock:
            state = self._senders.get(sender)
            if state is None:
                if ts <= self.forgotten_until:
                    raise BadMessage("stale", f"{sender} #{seq}: an unknown sender's message older than the senders "
                                     "this receiver forgot")
                self._senders[sender] = [seq, 1, ts]
                if len(self._senders) > self.max_senders:
                    _, (_, _, last_ts) = self._senders.popitem(last=False)
                    self.forgotten_until = max(self.forgotten_until, last_ts)
                return
            highest, mask, _ = state
            if seq > highest:
                state[0], state[1] = seq, ((mask << (seq - highest)) | 1) & self._window_mask
            else:
                back = highest - seq
                if back >= self.window:
                    raise BadMessage("replay", f"{sender} #{seq} is {back} behind its latest, outside the replay window")
                if mask >> back & 1:
                    raise BadMessage("replay", f"{sender} #{seq} was received already")
                state[1] = mask | (1 << back)
            state[2] = max(state[2], ts)
            self._senders.move_to_end(sender)
