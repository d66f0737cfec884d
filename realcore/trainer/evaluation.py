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

from realcore.api.alloc import parse_allocation_mode
from realcore.backends.clients.registry import client_for
from realcore.workflows.engines import BatchingEngine, ServerEngine
from realcore.workflows.episode import reward_fn, workflow_of
from realcore.workflows.evaluate import eval_rows, evaluate
from realcore.workflows.reward_runner import reward_runner_for


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
        self.cfg, self.tokenizer = cfg, tokenizer
        self.rows = eval_rows(cfg, tokenizer)
        self.episode, _ = workflow_of(cfg)
        self.rewards = reward_runner_for(cfg)
        self._reward = reward_fn(self.rewards)  # failed reward calls score 0, uncounted here

    def run(self, version: int, *, model=None, servers: list[str] | None = None) -> dict[str, float]:
        """On `servers` (http addresses) if given, else with `model.generate` (an engine)."""
        return asyncio.run(self._run(version, model, servers))

    async def _run(self, version: int, model, servers) -> dict[str, float]:
        t0 = time.monotonic()
        if servers:
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
