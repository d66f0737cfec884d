"""The two `RolloutEngine`s a workflow runs against (realcore.api.workflow).

- `ServerEngine` (async mode): requests to the generation servers (built-in, SGLang or vLLM through
  the rollout worker's routed client), resumed after interruptions by weight updates
  (`generate_resumable`: log-probs and per-token versions stitched across segments).
- `BatchingEngine` (sync mode, the `generate` MFC; and `python -m realcore.eval`): the episodes of a
  batch run concurrently in one event loop; their generation requests are collected and decoded
  together by the role's `generate(prompts, gconfig)` (the built-in engine, or the servers).

Both cut the output at a stop string on the client side, so `stop=` behaves the same on every
server, and both score through the run's reward runner (a child process with a deadline).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Awaitable, Callable

from realcore.api.workflow import Completion, RolloutEngine
from realcore.backends.clients.sglang_api import generate_resumable, sampling_params

# async (prompt, completion, prompt_ids, completion_ids, data) -> float
RewardFn = Callable[[str, str, list[int], list[int], dict], Awaitable[float]]


def stop_cut(tokenizer, ids: list[int], stop: list[str]) -> int | None:
    """The length of the shortest prefix of `ids` whose text holds one of `stop`, or None.
    A prefix holding a stop string stays holding it as tokens are added, so a binary search finds it."""
    def has(n: int) -> bool:
        text = tokenizer.decode(ids[:n], skip_special_tokens=True)
        return any(s in text for s in stop)

    if not stop or not ids or not has(len(ids)):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if has(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


class _Engine(RolloutEngine):
    def __init__(self, tokenizer, gconfig, reward_fn: RewardFn):
        self.tokenizer, self.gconfig, self._reward_fn = tokenizer, gconfig, reward_fn
        self.n_completions = self.n_length = 0  # for gen/no_eos_frac

    def _params(self, max_new_tokens, temperature, greedy) -> dict:
        p = sampling_params(self.gconfig)  # the call's own settings override the run's
        if max_new_tokens is not None:
            p["max_new_tokens"] = int(max_new_tokens)
        if not (self.gconfig.greedy if greedy is None else greedy):
            p["temperature"] = self.gconfig.temperature if temperature is None else float(temperature)
        else:
            p["temperature"] = 0.0
        return p

    async def _generate(self, input_ids: list[int], params: dict) -> tuple[list[int], list[float], list[int], str]:
        raise NotImplementedError

    async def agenerate(self, input_ids, *, max_new_tokens=None, temperature=None, greedy=None, stop=None) -> Completion:
        if max_new_tokens is not None and max_new_tokens <= 0:
            raise ValueError(f"agenerate: max_new_tokens={max_new_tokens} (must be > 0)")
        ids, logprobs, versions, reason = await self._generate(list(input_ids), self._params(max_new_tokens, temperature, greedy))
        cut = stop_cut(self.tokenizer, ids, list(stop or []))
        if cut is not None:
            ids, logprobs, versions, reason = ids[:cut], logprobs[:cut], versions[:cut], "stop"
        self.n_completions += 1
        self.n_length += reason == "length"
        return Completion(ids, logprobs, versions, reason, self.tokenizer.decode(ids, skip_special_tokens=True))

    async def reward(self, prompt, completion, prompt_ids, completion_ids, **data) -> float:
        return await self._reward_fn(prompt, completion, list(prompt_ids), list(completion_ids), data)


class ServerEngine(_Engine):
    """Async mode: `client` speaks SGLang's `generate` (the rollout worker's RoutedClient)."""

    def __init__(self, client, tokenizer, gconfig, reward_fn: RewardFn, *, rid: str):
        super().__init__(tokenizer, gconfig, reward_fn)
        self.client, self.rid = client, rid
        self._n = itertools.count()

    async def _generate(self, input_ids, params):
        t = await generate_resumable(self.client, input_ids, params, rid=f"{self.rid}.g{next(self._n)}")
        return t.output_ids, t.output_logprobs, t.output_versions, t.finish_reason


class BatchingEngine(_Engine):
    """Sync mode: `model.generate(prompts, gconfig)` (blocking; run in a thread) decodes the
    requests that are waiting together, grouped by their sampling settings. Every token carries
    `version` (the policy that generates the whole batch)."""

    def __init__(self, model, tokenizer, gconfig, reward_fn: RewardFn, *, version: int):
        super().__init__(tokenizer, gconfig, reward_fn)
        self.model, self.version = model, version
        self.pending: list[tuple[list[int], dict, asyncio.Future]] = []

    async def _generate(self, input_ids, params):
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((input_ids, params, fut))
        return await fut

    async def flush(self) -> None:
        """Decode every waiting request: one `generate` call per distinct sampling setting."""
        pending, self.pending = self.pending, []
        by_params: dict[tuple, list] = {}
        for ids, params, fut in pending:
            by_params.setdefault(tuple(sorted((k, str(v)) for k, v in params.items())), []).append((ids, params, fut))
        for reqs in by_params.values():
            p = reqs[0][1]
            g = self.gconfig.model_copy(update={"max_new_tokens": p["max_new_tokens"], "greedy": p["temperature"] == 0.0,
                                                "temperature": p["temperature"] or self.gconfig.temperature})
            try:
                results = await asyncio.to_thread(self.model.generate, [ids for ids, _, _ in reqs], g)
            except BaseException as e:
                for _, _, fut in reqs:
                    fut.set_exception(e) if not fut.done() else None
                raise
            for (_, _, fut), r in zip(reqs, results):
                if not fut.done():
                    fut.set_result((list(r.output_ids), list(r.output_logprobs), [self.version] * len(r.output_ids),
                                    "length" if r.finish_reason == "length" else "stop"))


async def run_batched(engine: BatchingEngine, episodes: list[Awaitable[Any]]) -> list[Any]:
    """Run the episodes concurrently, decoding their requests in batches: once every episode is
    waiting (on generation or on a reward), the waiting generation requests are decoded together.
    An episode that raises gives its exception in its place in the result."""
    tasks = [asyncio.ensure_future(e) for e in episodes]
    while not all(t.done() for t in tasks):
        for _ in range(10):  # let every runnable episode reach its next await
            await asyncio.sleep(0)
        if engine.pending:
            await engine.flush()
        else:
            waiting = [t for t in tasks if not t.done()]
            if waiting:  # the last ones may have finished during the yields above
                await asyncio.wait(waiting, timeout=0.01, return_when=asyncio.FIRST_COMPLETED)
    return [t.exception() or t.result() for t in tasks]
