"""Built-in math workflows and the environments they step through.

- `math-single-step`: `n_samples` answers to the question, each scored by the reward (GRPO's group).
- `math-multi-turn` (AReaL's multi-turn math): a wrong answer gets feedback ("Your answer is wrong,
  try again") and another turn, up to `max_turns`; a right answer in turn t (0-based) earns
  `turn_discount ** t`. The feedback tokens are in the trajectory with loss_mask 0.
- `math-tool`: the model may write Python between `<python>` and `</python>`; the code runs in the
  sandbox (realcore.workflows.sandbox: its own process, CPU/memory/wall limits, no network) and its
  output comes back between `<output>` and `</output>` (loss_mask 0); the last turn's answer is scored.

Observations are plain text appended to the sequence. With `chat: true` (chat models) they are
rendered as a user turn through the tokenizer's chat template instead.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from realcore.api.registry import lookup, register_env, register_workflow
from realcore.api.workflow import Completion, Env, TrajectoryBuilder
from realcore.workflows.sandbox import run_python


def plain_ids(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as data, never markup: a special token's string in it (`<|im_start|>`,
    EOS) is split into ordinary tokens, so a tool's output cannot forge a turn marker or an end."""
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def observation_ids(tokenizer, text: str, *, chat: bool) -> list[int]:
    """Token ids of an observation that follows a model turn. chat: a user turn and the next
    assistant prompt, as the chat template writes them after an assistant message. The
    observation itself is plain text (`plain_ids`); only the template's own markers are special."""
    if not chat:
        return plain_ids(tokenizer, text)
    slot = "OBSERVATION_SLOT"
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "MODEL_TURN"}]
    full = tokenizer.apply_chat_template(turns + [{"role": "user", "content": slot}], add_generation_prompt=True, tokenize=False)
    cut = full.index("MODEL_TURN") + len("MODEL_TURN")
    before, _, after = full[cut:].partition(slot)
    eos = tokenizer.eos_token or ""
    if eos and before.startswith(eos):  # the model's turn ended with EOS: it is in the sequence already
        before = before[len(eos):]
    markup = lambda s: list(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    return markup(before) + plain_ids(tokenizer, text) + markup(after)


def _prompt_text(engine, data: dict) -> str:
    return engine.tokenizer.decode(data["prompt_ids"], skip_special_tokens=True)


async def _group(one, engine, data) -> list[dict]:
    """GRPO's group: `gconfig.n_samples` episodes of `one(engine, data)`, run concurrently."""
    return list(await asyncio.gather(*(one(engine, data) for _ in range(engine.gconfig.n_samples))))


JSON_TYPES = (str, int, float, bool, list, dict, type(None))


def _row(data: dict) -> dict:
    """The row's fields, for the reward's `**data`: its text (answer, question) and its other fields
    (JSON values); not `prompt`/`prompt_ids` (the reward's own arguments) nor tensors (the reward
    runs in a child process that gets JSON)."""
    return {k: v for k, v in data.items() if isinstance(v, JSON_TYPES) and k not in ("prompt", "prompt_ids")}


@register_workflow("math-single-step")
async def math_single_step(engine, data):
    """`gconfig.n_samples` answers to one question, generated concurrently, each scored."""
    prompt_ids, prompt = data["prompt_ids"], _prompt_text(engine, data)

    async def one(engine, data) -> dict:
        c = await engine.agenerate(prompt_ids)
        reward = await engine.reward(prompt, c.text, prompt_ids, c.output_ids, **_row(data))
        t = TrajectoryBuilder(prompt_ids)
        t.add_completion(c)
        return t.to_tensors(reward)

    return await _group(one, engine, data)


@register_env("math-feedback")
class MathFeedbackEnv(Env):
    """Each turn's answer is scored; a wrong one gets `feedback`, until `max_turns` turns."""

    def __init__(self, reward, *, max_turns: int = 3, feedback: str = "\nYour answer is wrong. Try again.\nAnswer:"):
        self.reward, self.max_turns, self.feedback = reward, max_turns, feedback

    async def reset(self, data: dict[str, Any]) -> str:
        self.data, self.turn = data, 0
        return ""

    async def step(self, action: Completion) -> tuple[str, float, bool, dict[str, Any]]:
        d = self.data
        r = await self.reward(d["prompt"], action.text, d["prompt_ids"], action.output_ids, **_row(d))
        self.turn += 1
        if r > 0 or self.turn >= self.max_turns:
            return "", r, True, {"turns": self.turn}
        return self.feedback, r, False, {"turns": self.turn}


@register_workflow("math-multi-turn")
class MathMultiTurn:
    """AReaL's multi-turn math agent on the `math-feedback` environment (any env of that contract:
    `env`, `env_kwargs`)."""

    def __init__(self, max_turns: int = 3, turn_discount: float = 0.9, chat: bool = False,
                 env: str = "math-feedback", env_kwargs: dict | None = None, max_new_tokens: int | None = None):
        if max_turns < 1 or not 0 < turn_discount <= 1:
            raise ValueError(f"math-multi-turn: max_turns={max_turns} (>= 1), turn_discount={turn_discount} (in (0, 1])")
        self.max_turns, self.discount, self.chat = max_turns, turn_discount, chat
        self.env, self.env_kwargs, self.max_new_tokens = env, dict(env_kwargs or {}), max_new_tokens

    async def one(self, engine, data) -> dict:
        env = lookup("env", self.env)(engine.reward, max_turns=self.max_turns, **self.env_kwargs)
        try:
            await env.reset({**data, "prompt": _prompt_text(engine, data)})
            t = TrajectoryBuilder(data["prompt_ids"])
            for turn in range(self.max_turns):
                c = await engine.agenerate(t.ids, max_new_tokens=self.max_new_tokens)
                t.add_completion(c)
                obs, reward, done, _ = await env.step(c)
                if done:
                    break
                t.add_observation(observation_ids(engine.tokenizer, obs, chat=self.chat))
            return t.to_tensors(reward * self.discount ** turn)
        finally:
            await env.close()

    async def arun_episode(self, engine, data):
        return await _group(self.one, engine, data)


TOOL_CALL = re.compile(r"<python>(.*?)</python>", re.DOTALL)


@register_env("python-tool")
class PythonToolEnv(Env):
    """A turn holding `<python>code</python>` runs the code in the sandbox and observes its output;
    a turn without one is the final answer, scored by the reward."""

    def __init__(self, reward, *, cpu_s: float = 2.0, wall_s: float = 5.0, mem_mb: int = 256, max_output_chars: int = 500):
        self.reward = reward
        self.limits = {"cpu_s": cpu_s, "wall_s": wall_s, "mem_mb": mem_mb, "max_output_chars": max_output_chars}

    async def reset(self, data: dict[str, Any]) -> str:
        self.data = data
        return ""

    async def step(self, action: Completion) -> tuple[str, float, bool, dict[str, Any]]:
        calls = TOOL_CALL.findall(action.text)
        if calls:
            result = await run_python(calls[-1], **self.limits)
            return f"\n<output>\n{result.output.strip()}\n</output>\n", 0.0, False, {"tool_ok": result.ok}
        d = self.data
        r = await self.reward(d["prompt"], action.text, d["prompt_ids"], action.output_ids, **_row(d))
        return "", r, True, {}


@register_workflow("math-tool")
class MathTool:
    """A math agent with a Python calculator: up to `max_tool_calls` tool turns, then an answer.
    Generation stops at `</python>` so the tool runs before the model continues."""

    def __init__(self, max_tool_calls: int = 2, chat: bool = False, env_kwargs: dict | None = None,
                 max_new_tokens: int | None = None):
        if max_tool_calls < 0:
            raise ValueError(f"math-tool: max_tool_calls={max_tool_calls} (>= 0)")
        self.max_tool_calls, self.chat, self.env_kwargs = max_tool_calls, chat, dict(env_kwargs or {})
        self.max_new_tokens = max_new_tokens

    async def one(self, engine, data) -> dict:
        env = lookup("env", "python-tool")(engine.reward, **self.env_kwargs)
        try:
            await env.reset({**data, "prompt": _prompt_text(engine, data)})
            t = TrajectoryBuilder(data["prompt_ids"])
            reward = 0.0
            for turn in range(self.max_tool_calls + 1):
                stop = ["</python>"] if turn < self.max_tool_calls else None
                c = await engine.agenerate(t.ids, max_new_tokens=self.max_new_tokens, stop=stop)
                t.add_completion(c)
                if turn == self.max_tool_calls and TOOL_CALL.search(c.text):
                    break  # out of tool calls: the turn is no answer
                obs, reward, done, _ = await env.step(c)
                if done:
                    break
                t.add_observation(observation_ids(engine.tokenizer, obs, chat=self.chat))
            return t.to_tensors(reward)
        finally:
            await env.close()

    async def arun_episode(self, engine, data):
        return await _group(self.one, engine, data)
