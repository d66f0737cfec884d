"""`generate`: run the rollout workflow (`rollout.workflow`, realcore.api.workflow) on each prompt of
the batch, in sync mode: the same workflow the rollout workers run in async mode.

The batch's episodes run concurrently (realcore.workflows.episode); their generation requests are decoded together by the role's
engine (or the generation servers) whenever every episode waits (realcore.workflows.engines). The
MFC writes the workflow keys it declares as outputs (e.g. input_ids, loss_mask, behav_logprobs,
rewards). An episode that raises is tried again `rollout.episode_retries` times; a sync batch cannot
lose a sample, so an episode that still fails, or that the workflow rejects (None), fails the call.
"""

from __future__ import annotations

import asyncio

from realcore.api.data import SequenceSample
from realcore.api.registry import MFCSpec, register_mfc, workflow_keys
from realcore.api.workflow import BadTrajectory, EpisodeOutcome, workflow_data
from realcore.workflows import sandbox
from realcore.workflows.engines import BatchingEngine
from realcore.workflows.episode import reward_fn, run_episodes, workflow_of
from realcore.workflows.reward_runner import RewardRunner, reward_runner_for


@register_mfc("generate")
class Generate:
    """dataset keys (prompt_ids, answer, ...) -> the workflow's keys named in `outputs`."""

    spec = MFCSpec(generates=True, head="policy")  # samples only: runs on generation servers when the experiment has them

    def __init__(self, cfg, mfc):
        self.cfg, self.outputs = cfg, list(mfc.outputs)
        self.workflow, self.keys = workflow_of(cfg)
        self.runner: RewardRunner | None = None  # started on first use

    @classmethod
    def check_config(cls, cfg, mfc) -> None:
        keys = workflow_keys(cfg.rollout.workflow)
        extra = [k for k in mfc.outputs if k not in keys]
        if extra:
            raise ValueError(f"outputs {extra} are not produced by workflow {cfg.rollout.workflow!r} (it declares {list(keys)})")

    def run(self, model, batch: SequenceSample):
        # Tool calls share the node's bound with the other processes of the run (docs/tools.md).
        with sandbox.node_bound(sandbox.node_slots_folder(self.cfg.output_dir), self.cfg.rollout.max_concurrent_tool_calls):
            return self._run(model, batch)

    def _run(self, model, batch: SequenceSample):
        import torch  # why: realcore.mfc registers this MFC in the master, which starts without torch

        if self.runner is None:
            self.runner = reward_runner_for(self.cfg)
        counters = {"reward/errors": 0, "reward/timeouts": 0}
        engine = BatchingEngine(model, model.tokenizer, self.cfg.generation, reward_fn(self.runner, counters),
                                version=getattr(model, "version", 0))
        datas = [workflow_data(s) for s in batch.samples]
        results = asyncio.run(run_episodes(self.workflow, engine, datas, self.keys))
        for attempt in range(self.cfg.rollout.episode_retries):
            failed = [i for i, r in enumerate(results) if r.outcome is EpisodeOutcome.FAILED
                      and not isinstance(r.error, BadTrajectory)]  # a malformed trajectory fails the call at once
            if not failed:
                break
            again = asyncio.run(run_episodes(self.workflow, engine, [datas[i] for i in failed], self.keys))
            for i, r in zip(failed, again):
                results[i] = r
        groups = []
        for sid, r in zip(batch.ids, results):
            if isinstance(r.error, BadTrajectory):
                raise r.error
            if r.outcome is EpisodeOutcome.FAILED:
                e = r.error
                raise RuntimeError(f"workflow {self.cfg.rollout.workflow!r}: the episode of sample {sid} failed "
                                   f"{self.cfg.rollout.episode_retries + 1} times: {type(e).__name__}: {e}") from e
            if r.outcome is EpisodeOutcome.REJECTED:
                raise RuntimeError(f"workflow {self.cfg.rollout.workflow!r} rejected sample {sid} (returned None): "
                                   "a sync batch cannot drop a sample (async mode can)")
            groups.append(r.group)
        out = SequenceSample(list(batch.ids), [{k: g[k] for k in self.outputs} for g in groups])
        mask_lens = [int(m.sum()) for g in groups for m in g["loss_mask"]]
        rewards = torch.cat([t for g in groups for t in g["rewards"]])
        stats = {
            "gen/response_len": sum(mask_lens) / max(len(mask_lens), 1),
            "gen/no_eos_frac": engine.n_length / max(engine.n_completions, 1),
            "reward/mean": rewards.mean().item(),
            **counters,
        }
        return out, stats
