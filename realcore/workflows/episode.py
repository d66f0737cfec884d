"""One episode: the run's workflow on one dataset row, against a `RolloutEngine`
(realcore.workflows.engines) that generates and scores through the run's reward runner, its
return value checked against the workflow's declared keys: a typed `EpisodeResult`.

Every caller runs episodes through here: the rollout worker (async mode, one episode per admitted
prompt, retried), the `generate` MFC (sync mode, a batch decoded together), evaluation during
training (realcore.trainer.evaluation) and `python -m realcore.eval` (both through
realcore.workflows.evaluate).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from realcore.api.registry import make_workflow, workflow_keys
from realcore.api.workflow import BadTrajectory, EpisodeOutcome, RolloutEngine, check_trajectories
from realcore.workflows.engines import BatchingEngine, RewardFn, run_batched
from realcore.workflows.reward_runner import RewardCall, RewardRunner

# The workflow as make_workflow returns it: async (engine, data) -> trajectory, group or None.
Workflow = Callable[[RolloutEngine, dict], Awaitable[Any]]


@dataclass
class EpisodeResult:
    outcome: EpisodeOutcome  # DONE, REJECTED or FAILED (STALE is the rollout worker's to say)
    group: dict[str, list[Any]] | None = None  # DONE: {key: one tensor per sequence}
    error: BaseException | None = None  # FAILED: what the workflow raised (TimeoutError: the deadline), or BadTrajectory

    def why(self) -> str:
        """A failed or rejected episode, in a few words for a log line."""
        if self.outcome is EpisodeOutcome.REJECTED:
            return "rejected (returned None)"
        if isinstance(self.error, BadTrajectory):
            return f"bad trajectory: {self.error}"
        if isinstance(self.error, asyncio.TimeoutError):
            return "timed out"
        return f"{type(self.error).__name__}: {self.error}"


def workflow_of(cfg) -> tuple[Workflow, tuple[str, ...]]:
    """The run's workflow (`rollout.workflow` with `rollout.workflow_kwargs`) and the keys it declares.
    KeyError: no such workflow; TypeError: kwargs it does not take."""
    return make_workflow(cfg.rollout.workflow, cfg.rollout.workflow_kwargs), workflow_keys(cfg.rollout.workflow)


def reward_fn(runner: RewardRunner, counters: dict[str, int] | None = None) -> RewardFn:
    """The engines' reward: a call to `runner`; a call that failed or timed out scores 0 and adds
    one to counters["reward/errors"] or counters["reward/timeouts"]."""

    async def score(prompt, completion, prompt_ids, completion_ids, row) -> float:
        outcome = await runner.ascore(RewardCall(prompt, completion, prompt_ids, completion_ids, row))
        if outcome.error is not None and counters is not None:
            key = "reward/errors" if outcome.error == "error" else "reward/timeouts"
            counters[key] = counters.get(key, 0) + 1
        return outcome.reward

    return score


async def run_episode(workflow: Workflow, engine: RolloutEngine, data: dict, keys: tuple[str, ...], *,
                      deadline: float | None = None) -> EpisodeResult:
    """One episode of `workflow` on `data`. Never raises for the workflow's faults (a user workflow
    may raise anything): an exception, an overrun of `deadline` (time.monotonic()) or a malformed
    trajectory is FAILED; None is REJECTED."""
    try:
        run = workflow(engine, data)
        result = await (run if deadline is None else asyncio.wait_for(run, max(0.0, deadline - time.monotonic())))
        if result is None:
            return EpisodeResult(EpisodeOutcome.REJECTED)
        return EpisodeResult(EpisodeOutcome.DONE, check_trajectories(result, keys))
    except Exception as e:
        return EpisodeResult(EpisodeOutcome.FAILED, error=e)


async def run_episodes(workflow: Workflow, engine: RolloutEngine, rows: list[dict], keys: tuple[str, ...], *,
                       deadline: float | None = None, max_concurrent: int | None = None) -> list[EpisodeResult]:
    """Every row's episode on `engine`, concurrently, in the order of `rows`. A BatchingEngine runs
    them all at once, so their requests decode in shared batches; any other engine at most
    `max_concurrent` at a time (None: no bound)."""
    if isinstance(engine, BatchingEngine):
        return await run_batched(engine, [run_episode(workflow, engine, d, keys, deadline=deadline) for d in rows])
    sem = asyncio.Semaphore(max_concurrent or len(rows) or 1)

    async def one(data):
        async with sem:
            return await run_episode(workflow, engine, data, keys, deadline=deadline)

    return list(await asyncio.gather(*(one(d) for d in rows)))
