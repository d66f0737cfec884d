"""The version rules every side agrees on: when a trajectory is too stale to train, and how a
server takes new weights without generating tokens that would be dropped.

The trainer's version is the number of completed updates; a sequence knows the versions that
produced its first and last tokens. The admission of new rollouts (the other half of the staleness
bound) lives with the manager, in `realcore.rollout.admission`.
"""

from __future__ import annotations


def drop_bound(rollout) -> int | None:
    """The staleness past which a trajectory is dropped (rollout config): max_head_offpolicyness,
    or None with drop_stale=false, where admission alone bounds it (AReaL's rule: a slow rollout
    is trained however stale it arrives)."""
    return rollout.max_head_offpolicyness if rollout.drop_stale else None


def is_stale(version_start: int, *, current_version: int, max_head_offpolicyness: int | None) -> bool:
    """Past the bound (None: no bound, nothing is stale)."""
    return max_head_offpolicyness is not None and current_version - version_start > max_head_offpolicyness


def update_mode(cfg, version: int) -> dict:
    """How a built-in server takes the weights of `version` in async mode: interrupting every
    running request (`abort_all_requests`), or in flight (rollout.inflight_weight_update), ending
    only the requests too stale to be trained."""
    r = cfg.rollout
    if not r.inflight_weight_update:
        return {"abort_all_requests": True}
    bound = drop_bound(r)
    if bound is None:  # nothing will be dropped: every request goes on
        return {}
    # A first token older than version - eta is stale for a trainer at `version` or later (is_stale).
    return {"abort_started_before": max(0, version - bound)}


def doomed(first_version: int, reply_version: int, *, aborted: bool, max_head_offpolicyness: int | None) -> bool:
    """Will a rollout whose first token came from `first_version` be dropped as stale, whatever
    happens next? The trainer takes it at a version no older than any a server has shown (the
    servers only get versions the trainer published), and one newer than a reply aborted by a
    weight update (that update is under way). So once that lower bound is past the bound, the
    stream's drop is certain: the rollout worker stops generating it (`rollout/stale_cancelled`)."""
    now_at_least = reply_version + (1 if aborted else 0)
    return is_stale(first_version, current_version=now_at_least, max_head_offpolicyness=max_head_offpolicyness)
