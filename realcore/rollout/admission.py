"""Admission of new rollouts under a staleness bound (AReaL, arXiv 2505.24298, section 5), and the
bookkeeping that lets it survive any process dying.

A rollout admitted now will be trained in batch `expected_version = (trained + running) //
batch_size`; it is admitted only if that is at most `current_version + max_head_offpolicyness`,
so that, in expectation, no trained sample is more than `max_head_offpolicyness` versions older
than the policy that trains on it. Rollouts finish out of order, so a slow one can still arrive
after its batch: the trajectory stream drops such samples (`is_stale`) and the master tells the
manager which (`resolve`, by the grant of each admission), which makes the bound hard. With
`rollout.drop_stale=false` nothing is dropped (AReaL's bound: admission alone; `drop_bound`).
Concurrency is capped by `max_concurrent_rollouts`.

Which prompt a rollout runs is decided here too: rollout worker w's rollouts are numbered by
`seq`, its position in the worker's (deterministic) prompt order. The manager knows every seq in
flight, so when a rollout worker dies its rollouts are admitted again (`redo`) and counted once;
when the manager itself dies, its journal (every change, one JSON line, written before the reply)
rebuilds the same state.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from realcore.transport.protocol import ManagerState, parse


def admit(*, trained: int, running: int, batch_size: int, current_version: int, max_head_offpolicyness: int,
          max_concurrent_rollouts: int) -> bool:
    if running >= max_concurrent_rollouts:
        return False
    expected_version = (trained + running) // batch_size
    return expected_version <= current_version + max_head_offpolicyness


class Admission:
    """The manager's state machine. Every change is an event applied by `apply` (also when the
    journal is replayed), so the live path and the recovery path are the same code."""

    def __init__(self, batch_size: int, max_head_offpolicyness: int, max_concurrent_rollouts: int,
                 journal_path: str | None = None):
        self.batch_size, self.eta, self.max_running = batch_size, max_head_offpolicyness, max_concurrent_rollouts
        self.state = ManagerState()
        self.restored = False  # admits nothing until the master restored it (or the journal did)
        self.weights_path: str | None = None  # the current version's weights (disk), for restarted servers
        self.journal_path = journal_path
        self._journal = None
        if journal_path is not None and os.path.exists(journal_path):
            self._replay(journal_path)
        if journal_path is not None:
            self._journal = open(journal_path, "a", buffering=1)

    # --- counts ---------------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return sum(len(v) for v in self.state.running.values())

    @property
    def trained(self) -> int:
        """Accepted rollouts the trainer will use: accepted, minus those dropped as too stale."""
        return self.state.accepted - self.state.dropped

    # --- decisions (live only) --------------------------------------------------------------------

    def allocate(self, worker: int) -> tuple[int, int] | None:
        """(seq, grant) of an admitted rollout of `worker` (rollouts to run again come first), or None."""
        if not self.restored or not admit(trained=self.trained, running=self.running, batch_size=self.batch_size,
                                          current_version=self.state.version, max_head_offpolicyness=self.eta,
                                          max_concurrent_rollouts=self.max_running):
            return None
        redo = self.state.redo.get(worker)
        seq = redo[0] if redo else self.state.cursor.get(worker, 0)
        grant = self.state.next_grant
        self._do({"op": "alloc", "w": worker, "seq": seq, "grant": grant})
        return seq, grant

    def finish(self, worker: int, seq: int, grant: int, accepted: bool, counters: dict[str, int]) -> None:
        self._do({"op": "finish", "w": worker, "seq": seq, "grant": grant, "accepted": accepted, "counters": counters})

    def register(self, worker: int, running: list[int]) -> None:
        self._do({"op": "register", "w": worker, "running": sorted(running)})

    def resolve(self, trained: list[int], dropped: list[int]) -> None:
        self._do({"op": "resolve", "trained": trained, "dropped": dropped})

    def set_version(self, version: int, path: str | None) -> None:
        self._do({"op": "version", "v": version, "path": path})
        self._compact()

    def restore(self, state: ManagerState, weights_path: str | None) -> None:
        self._do({"op": "restore", "state": asdict(state), "path": weights_path})

    # --- events ---------------------------------------------------------------------------------

    def _do(self, event: dict) -> None:
        if self._journal is not None:  # written before it takes effect: a reply never outruns its record
            self._journal.write(json.dumps(event) + "\n")
            self._journal.flush()
        self.apply(event)

    def apply(self, e: dict) -> None:
        s, op = self.state, e["op"]
        if op == "alloc":
            w, seq = e["w"], e["seq"]
            redo = s.redo.get(w, [])
            if seq in redo:
                redo.remove(seq)
            else:
                s.cursor[w] = max(s.cursor.get(w, 0), seq + 1)
            s.running.setdefault(w, {})[seq] = e["grant"]
            s.next_grant = max(s.next_grant, e["grant"] + 1)
        elif op == "finish":
            w, seq = e["w"], e["seq"]
            if s.running.get(w, {}).get(seq) == e["grant"]:
                del s.running[w][seq]
            elif seq in s.redo.get(w, []):  # its worker was declared dead, yet it finished: fine
                s.redo[w].remove(seq)
            else:  # finished already (a message sent twice): count it once
                return
            if e["accepted"]:
                s.accepted += 1
                if e["grant"] in s.taken_early:
                    s.dropped += s.taken_early.pop(e["grant"])
                else:
                    s.unresolved.append(e["grant"])
            for k, v in e["counters"].items():
                s.counters[k] = s.counters.get(k, 0) + v
        elif op == "register":
            # What the worker says it runs is the truth: a seq we think it runs but it does not (it
            # restarted, or the grant was lost with a dead manager) runs again, first.
            w, theirs = e["w"], set(e["running"])
            mine = s.running.get(w, {})
            s.running[w] = {q: g for q, g in mine.items() if q in theirs}
            s.redo[w] = sorted(set(s.redo.get(w, [])) | {q for q in mine if q not in theirs})
        elif op == "resolve":
            # Only a counted copy uncounts: a group that reached a stream without its FINISH (its
            # worker died; the prompt ran again under another grant) was never counted.
            for g in e["trained"] + e["dropped"]:
                if g in s.unresolved:
                    s.unresolved.remove(g)
                    s.dropped += g in e["dropped"]
                elif any(g in grants.values() for grants in s.running.values()):
                    s.taken_early[g] = g in e["dropped"]
        elif op == "version":
            s.version = e["v"]
            self.weights_path = e["path"] if e["path"] is not None else self.weights_path
        elif op == "restore":
            if self.restored:  # a master that retried its RESTORE: the first one holds
                return
            self.state = s = parse(ManagerState, e["state"])
            self.weights_path = e.get("path")
            # The rollouts that ran when the checkpoint was taken died with their workers: again, first.
            for w, grants in s.running.items():
                s.redo[w] = sorted(set(s.redo.get(w, [])) | set(grants))
            s.running, s.taken_early = {}, {}
            self.restored = True
        elif op == "snapshot":  # the first line of a compacted journal
            self.state = parse(ManagerState, e["state"])
            self.weights_path = e.get("path")
            self.restored = True
        else:
            raise ValueError(f"journal: unknown event {op!r}")

    def _replay(self, path: str) -> None:
        with open(path) as f:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:  # a line torn by the kill that ended the last manager
                    continue
                self.apply(event)

    def _compact(self) -> None:
        """Start a new journal holding only a snapshot (once per step: the journal stays small)."""
        if self._journal is None:
            return
        tmp = f"{self.journal_path}.tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps({"op": "snapshot", "state": asdict(self.state), "path": self.weights_path}) + "\n")
        self._journal.close()
        os.replace(tmp, self.journal_path)
        self._journal = open(self.journal_path, "a", buffering=1)

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()
