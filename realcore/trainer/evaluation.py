"""Evaluation during training (`eval.freq_steps`): the master asks model worker 0 between steps,
after the new weights reached the generation servers, and logs the figures with the step.

Model worker 0 runs the rollout workflow on the held-out prompts (realcore.workflows.evaluate):
on the generation servers when the run has them (async mode, or sync with a generation part; the
requests share the servers with the rollouts, which keep running), otherwise on its own actor
engine (sync, colocated). Reward calls go to a reward runner of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import time

from realcore.api.registry import make_workflow


class RoundRobin:
    """SGLang's `generate` spread over every generation server of the run, one request at a time each."""

    def __init__(self, clients: list):
        self.clients, self._next = clients, itertools.cycle(range(len(clients)))

    async def generate(self, input_ids, sampling_params, *, rid: str, return_logprob: bool = True):
        return await self.clients[next(self._next)].generate(input_ids, sampling_params, rid=rid, return_logprob=return_logprob)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)


class Evaluator:
    """Lives in model worker 0; `run(version, generator)` returns the eval/* metrics."""

    def __init__(self, cfg, tokenizer):
        from realcore.workflows.reward_runner import reward_runner_for
        from realcore.workflows.evaluate import eval_rows

        self.cfg, self.tokenizer = cfg, tokenizer
        self.rows = eval_rows(cfg, tokenizer)
        self.episode = make_workflow(cfg.rollout.workflow, cfg.rollout.workflow_kwargs)
        self.rewards = reward_runner_for(cfg)

    async def _reward(self, prompt, completion, prompt_ids, completion_ids, row) -> float:
        from realcore.workflows.reward_runner import RewardCall

        return (await self.rewards.ascore(RewardCall(prompt, completion, prompt_ids, completion_ids, row))).reward

    def run(self, version: int, *, model=None, servers: list[str] | None = None) -> dict[str, float]:
        """On `servers` (http addresses) if given, else with `model.generate` (an engine)."""
        return asyncio.run(self._run(version, model, servers))

    async def _run(self, version: int, model, servers) -> dict[str, float]:
        from realcore.workflows.engines import BatchingEngine, ServerEngine
        from realcore.workflows.evaluate import evaluate

        t0 = time.monotonic()
        if servers:
            from realcore.api.alloc import parse_allocation_mode
            from realcore.backends.clients.registry import client_for

            r, backend = self.cfg.rollout, parse_allocation_mode(self.cfg.allocation_mode).backend
            client = RoundRobin([client_for(backend, s, token=r.server_token, timeout_s=r.request_timeout_s,
                                            lora=self.cfg.actor.lora is not None) for s in servers])
            counter = itertools.count()

            def make_engine(gconfig):
                return ServerEngine(client, self.tokenizer, gconfig, self._reward, rid=f"eval-v{version}-{next(counter)}")
        else:
            client = None

            def make_engine(gconfig):
                return BatchingEngine(model, self.tokenizer, gconfig, self._reward, version=version)
        try:
            metrics = await evaluate(self.cfg, self.episode, make_engine, self.rows)
        finally:
            if client is not None:
                await client.close()
        metrics["eval/time_s"] = time.monotonic() - t0
        return metrics

    def close(self) -> None:
        self.rewards.close()
