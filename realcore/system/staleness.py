"""Admission of new rollouts under a staleness bound (AReaL, arXiv 2505.24298, section 5).

A rollout admitted now will be trained in batch `expected_version = (trained + running) //
batch_size`; it is admitted only if that is at most `current_version + max_head_offpolicyness`,
so that, in expectation, no trained sample is more than `max_head_offpolicyness` versions older
than the policy that trains on it. Rollouts finish out of order, so a slow one can still arrive
after its batch: the trajectory stream drops such samples (`is_stale`) and the manager forgets
them (`drop`), which makes the bound hard. Concurrency is capped by `max_concurrent_rollouts`.
"""

from __future__ import annotations

from dataclasses import dataclass


def admit(*, trained: int, running: int, batch_size: int, current_version: int, max_head_offpolicyness: int,
          max_concurrent_rollouts: int) -> bool:
    if running >= max_concurrent_rollouts:
        return False
    expected_version = (trained + running) // batch_size
    return expected_version <= current_version + max_head_offpolicyness


def is_stale(version_start: int, *, current_version: int, max_head_offpolicyness: int) -> bool:
    return current_version - version_start > max_head_offpolicyness


@dataclass
class StalenessController:
    """The manager's counters: trained (accepted) rollouts, running rollouts, current version."""

    batch_size: int
    max_head_offpolicyness: int
    max_concurrent_rollouts: int
    trained: int = 0
    running: int = 0
    version: int = 0

    def try_allocate(self) -> bool:
        ok = admit(trained=self.trained, running=self.running, batch_size=self.batch_size, current_version=self.version,
                   max_head_offpolicyness=self.max_head_offpolicyness, max_concurrent_rollouts=self.max_concurrent_rollouts)
        if ok:
            self.running += 1
        return ok

    def drop(self, n: int) -> None:
        """n accepted samples were too stale to train on: they no longer count as trained."""
        self.trained -= n

    def finish(self, accepted: bool) -> None:
        assert self.running > 0, "finish() without a running rollout"
        self.running -= 1
        if accepted:
            self.trained += 1
