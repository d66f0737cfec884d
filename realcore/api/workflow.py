"""The rollout workflow contract: how one dataset row becomes scored trajectories.

A workflow is an async function `async fn(engine, data, **kwargs)` or a class whose instances
(`cls(**kwargs)`) have `async def arun_episode(self, engine, data)`; `kwargs` are the experiment's
`rollout.workflow_kwargs`. It returns

- one trajectory: `dict[str, Tensor]`, each value a 1-D tensor (per-token keys have the length of
  `input_ids`, per-sequence keys one element), or
- a group of them (`list[dict[str, Tensor]]`: e.g. GRPO's `n_samples` answers to one prompt; the
  advantage is normalised within the group), or
- None: the episode is rejected (nothing is trained on it; counted in `rollout/rejected_episodes`).

It lays out its own trajectory, `loss_mask` included: 1 on the tokens the policy generated and is
trained on, 0 on the prompt and on whatever the environment said (tool output, feedback).
`TrajectoryBuilder` does the bookkeeping. A workflow declares the keys it returns
(`@register_workflow(name, keys=...)`); they must include `TRAJECTORY_KEYS`, and they are the
keys of the trajectory stream and the source keys of the async dataflow graph (extra keys reach
the MFCs that ask for them).

`engine` is a `RolloutEngine`: generation (interruptible by weight updates: an interrupted request
resumes from its prefix under the new weights, log-probs and per-token versions stitched), the
run's reward function and the tokenizer. The same workflow runs in async mode (rollout workers,
generation servers) and in sync mode (the `generate` MFC), unchanged.

`data` is the dataset row: `prompt_ids` as `list[int]`, text keys (`answer`, `question`, ...) as
`str`, the row's other fields by their own names (a built-in dataset's `fields` key, unpacked),
any other key as its tensor.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from realcore.api.data import merge_row_fields

if TYPE_CHECKING:  # imported where a tensor is made: the master loads the workflows and starts without torch
    import torch


# What every trajectory carries. Per token: input_ids, loss_mask, behav_logprobs; per sequence
# (1 element): rewards, version_start, version_end (the policy versions of its first and last
# generated tokens: staleness is measured from version_start).
TRAJECTORY_KEYS = ("input_ids", "loss_mask", "behav_logprobs", "rewards", "version_start", "version_end")
PER_SEQUENCE_KEYS = ("rewards", "version_start", "version_end")


@dataclass
class Completion:
    """One generated continuation, stitched across interruptions."""

    output_ids: list[int]
    output_logprobs: list[float]  # log p of each token under the policy that sampled it
    output_versions: list[int]  # per token: the policy version that sampled it
    finish_reason: str  # "stop" (EOS, a stop token or a stop string) | "length"
    text: str  # output_ids decoded (special tokens skipped)


class EpisodeOutcome(enum.Enum):
    """How one episode ended (realcore.workflows.episode runs it; the rollout worker counts it)."""

    DONE = "done"  # trajectories to train on (or to score, in evaluation)
    REJECTED = "rejected"  # the workflow returned None: nothing is trained on it
    FAILED = "failed"  # it raised, outlived its deadline or returned a malformed trajectory
    STALE = "stale"  # too stale to be trained (realcore.api.versions.doomed): its requests stopped


class BadTrajectory(ValueError):
    """A workflow's return value is not what it declared (check_trajectories)."""


class RolloutEngine(ABC):
    """What a workflow may call. `gconfig` is the run's `generation:` config (defaults of every
    `agenerate` argument); `tokenizer` the policy's HF tokenizer."""

    tokenizer: Any
    gconfig: Any

    @abstractmethod
    async def agenerate(
        self, input_ids: list[int], *, max_new_tokens: int | None = None, temperature: float | None = None,
        greedy: bool | None = None, stop: list[str] | None = None,
    ) -> Completion:
        """Sample one continuation of `input_ids`. `stop`: strings that end the turn; the output is
        cut right after the first token that completes one (finish_reason "stop"). Other sampling
        settings come from `gconfig`."""

    @abstractmethod
    async def reward(self, prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int],
                     **data: Any) -> float:
        """The run's registered reward (`reward.type`), run in a child process with the deadline
        `reward.timeout_s`: a reward that raises, returns a non-number or overruns gives 0 and is
        counted (`reward/errors`, `reward/timeouts`)."""


class TrajectoryBuilder:
    """One sequence, turn by turn: tokens the policy generated (trained on) and tokens it was
    given (prompt, tool output, feedback: loss_mask 0, behaviour log-prob 0)."""

    def __init__(self, prompt_ids: list[int]):
        self.ids: list[int] = list(prompt_ids)
        self.mask: list[int] = [0] * len(self.ids)
        self.logprobs: list[float] = [0.0] * len(self.ids)
        self.versions: list[int] = []

    def add_completion(self, c: Completion) -> None:
        self.ids += c.output_ids
        self.mask += [1] * len(c.output_ids)
        self.logprobs += list(c.output_logprobs)
        self.versions += list(c.output_versions)

    def add_observation(self, ids: list[int]) -> None:
        self.ids += list(ids)
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def __len__(self) -> int:
        return len(self.ids)

    def to_tensors(self, reward: float, **extra: torch.Tensor) -> dict[str, torch.Tensor]:
        import torch  # why: the master imports this module and starts without torch

        if not self.versions:
            raise ValueError("a trajectory needs at least one generated token")
        return {
            "input_ids": torch.tensor(self.ids, dtype=torch.int64),
            "loss_mask": torch.tensor(self.mask, dtype=torch.int64),
            "behav_logprobs": torch.tensor(self.logprobs, dtype=torch.float32),
            "rewards": torch.tensor([float(reward)], dtype=torch.float32),
            "version_start": torch.tensor([min(self.versions)], dtype=torch.int64),
            "version_end": torch.tensor([max(self.versions)], dtype=torch.int64),
            **extra,
        }


def check_trajectories(result: Any, keys: tuple[str, ...]) -> dict[str, list[torch.Tensor]]:
    """A workflow's return value (one trajectory or a group) -> {key: one tensor per sequence};
    BadTrajectory (a ValueError) naming what is wrong (a missing or undeclared key, a bad shape or
    length)."""
    import torch  # why: the master imports this module and starts without torch

    group = [result] if isinstance(result, dict) else result
    if not isinstance(group, list) or not group or not all(isinstance(t, dict) for t in group):
        raise BadTrajectory(f"a workflow returns a dict of tensors, a non-empty list of them, or None; got {type(result).__name__}")
    out: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
    for i, traj in enumerate(group):
        if set(traj) != set(keys):
            missing, extra = sorted(set(keys) - set(traj)), sorted(set(traj) - set(keys))
            raise BadTrajectory(f"trajectory {i}: keys differ from the workflow's declaration (missing {missing}, undeclared {extra})")
        n = None
        for k in keys:
            t = traj[k]
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise BadTrajectory(f"trajectory {i}: {k!r} is not a 1-D tensor")
            if k == "input_ids":
                n = t.numel()
        for k in keys:
            t = traj[k]
            if k in PER_SEQUENCE_KEYS and t.numel() != 1:
                raise BadTrajectory(f"trajectory {i}: {k!r} has {t.numel()} elements; it is one per sequence")
            if k in ("loss_mask", "behav_logprobs") and t.numel() != n:
                raise BadTrajectory(f"trajectory {i}: {k!r} has {t.numel()} elements for {n} tokens")
            if k not in TRAJECTORY_KEYS and t.numel() not in (1, n):
                raise BadTrajectory(f"trajectory {i}: {k!r} has {t.numel()} elements: per token ({n}) or per sequence (1)")
            out[k].append(t.detach())
        if not bool(traj["loss_mask"].any()):
            raise BadTrajectory(f"trajectory {i}: loss_mask is all 0 (nothing to train on)")
    return out


def workflow_data(sample: dict[str, list[torch.Tensor]]) -> dict[str, Any]:
    """A dataset sample (one sequence per key) -> the `data` a workflow receives."""
    import torch  # why: the master imports this module and starts without torch

    out: dict[str, Any] = {}
    for k, v in sample.items():
        t = v[0]
        if k == "prompt_ids":
            out[k] = [int(x) for x in t.tolist()]
        elif t.dtype == torch.uint8:
            out[k] = bytes(t.tolist()).decode("utf-8", errors="replace")
        else:
            out[k] = t
    return merge_row_fields(out)


class Env(ABC):
    """An environment a multi-turn workflow steps through (`@register_env(name)`); workflows make
    one per episode: `lookup("env", name)(**kwargs)`."""

    @abstractmethod
    async def reset(self, data: dict[str, Any]) -> str:
        """Start an episode for this dataset row; returns the first observation (text)."""

    @abstractmethod
    async def step(self, action: Completion) -> tuple[str, float, bool, dict[str, Any]]:
        """The policy's turn, as `agenerate` returned it (`action.text`, `action.output_ids`) ->
        (observation: text the workflow appends as loss-masked tokens, reward: float, done: bool,
        info: dict of anything the workflow may want)."""

    async def close(self) -> None:
        """Release what the episode holds (processes, files)."""
