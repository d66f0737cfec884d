"""Rollout-side agents: how one prompt becomes a group of scored trajectories.

An agent is `async fn(prompt_ids, answer, *, client, gconfig, tokenizer, reward_fn, rid) ->
list[(Trajectory, reward)]`, registered with `@register_agent(name)` and chosen by
`rollout.agent`. `client` speaks SGLang's HTTP API (built-in server, SGLang or vLLM adapter).
`reward_fn` is `async (response_text, answer_text) -> float`: the registered reward, run in a
child process with a deadline (a reward that raises or hangs gives 0 and is counted).
"""

from __future__ import annotations

import asyncio

from realcore.api.registry import register_agent
from realcore.backends.gen_client import sampling_params


@register_agent("math-single-step")
async def math_single_step(prompt_ids, answer, *, client, gconfig, tokenizer, reward_fn, rid):
    """`n_samples` answers to one question, generated concurrently, each scored by the verifier.
    Interrupted generations (weight updates) resume from their prefix (generate_resumable)."""
    from realcore.backends.gen_client import generate_resumable

    params = sampling_params(gconfig)
    trajs = await asyncio.gather(
        *(generate_resumable(client, prompt_ids, params, rid=f"{rid}-{j}") for j in range(gconfig.n_samples))
    )
    texts = [tokenizer.decode(t.output_ids, skip_special_tokens=True) for t in trajs]
    rewards = await asyncio.gather(*(reward_fn(text, answer) for text in texts))
    return list(zip(trajs, rewards))
