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

from realcore.api.data import ROW_FIELDS, SequenceSample
from realcore.api.registry import MFCSpec, register_mfc, workflow_keys
from realcore.api.workflow import BadTrajectory, EpisodeOutcome, workflow_data
from realcore.workflows import sandbox
from realcore.workflows.engines import BatchingEngine
from realcore.workflows.episode import reward_fn, run_episodes, workflow_of
from realcore.workflows.reward_runner import RewardRunner, reward_runner_for


def sequence_lengths(loss_masks) -> tuple[list[int], list[int]]:
    """(prompt lengths, response lengths) of sequences given by their loss masks: the prompt is what
    comes before the first trained token, the response the trained tokens (a multi-turn episode's
    tool and feedback tokens, untrained, count in neither)."""
    prompts, responses = [], []
    for m in loss_masks:
        on = m.nonzero()
        prompts.append(int(on[0, 0]) if len(on) else len(m))
        responses.append(int(m.sum()))
    return prompts, responses


def length_stats(prompt_lens: list[int], response_lens: list[int]) -> dict[str, int | float]:
    """A step's length metrics (sync: the generate MFC's; async: the master's, over the streamed
    batch). gen/response_tokens is an int: summed over workers, it makes perf/gen_tokens_per_s."""
    n = max(len(response_lens), 1)
    return {
        "gen/response_len": sum(response_lens) / n,
        "gen/response_len_max": float(max(response_lens, default=0)),
        "gen/prompt_len": sum(prompt_lens) / max(len(prompt_lens), 1),
        "gen/response_tokens": int(sum(response_lens)),
    }


@register_mfc("generate")
class Generate:
    """dataset keys (prompt_ids, answer, ...) -> the workflow's keys named in `outputs`."""

    spec = MFCSpec(generates=True, head="policy", optional_inputs=("question", ROW_FIELDS))  # samples only: runs on generation servers when the experiment has them

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
        prompt_lens, response_lens = sequence_lengths([m for g in groups for m in g["loss_mask"]])
        rewards = torch.cat([t for g in groups for t in g["rewards"]])
        stats = {
            **length_stats(prompt_lens, response_lens),
            "gen/no_eos_frac": engine.n_length / max(engine.n_completions, 1),
            "reward/mean": rewards.mean().item(),
            **counters,
        }
        return out, stats
