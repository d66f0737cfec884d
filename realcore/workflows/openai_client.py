"""`ChatClient`: the `openai` package's client shape over a `RolloutEngine`, so that an agent written
against the OpenAI API trains unchanged (AReaL's "ArealOpenAI" idea).

    client = ChatClient(engine)                      # one client per episode
    resp = await client.chat.completions.create(messages=[...], max_tokens=64, temperature=1.0)
    ...                                              # the agent appends resp.choices[0].message,
    resp = await client.chat.completions.create(messages=[...])   # tool/user messages, calls again
    return client.trajectory(reward)                 # the conversation that ends with the last reply

What it does:
- `chat.completions.create` renders the tokenizer's chat template locally (add_generation_prompt)
  and calls `engine.agenerate` with token ids; the answer is a real `openai.types.chat.ChatCompletion`
  (content = the output ids decoded; log-probs in it when `logprobs=True`). Each choice is recorded
  as a `Turn`: the exact prompt ids, output ids, behaviour log-probs and versions.
- No re-tokenisation drift: when a call's messages are an earlier call's messages + that call's
  reply (as an assistant message, content unchanged) + new messages, its prompt ids are the earlier
  prompt ids + the earlier OUTPUT ids as generated + the tokens of what the template writes after the
  reply (end of turn, the new messages, the next generation prompt). That text is found by rendering
  the conversation with a marker in place of the reply's content; if the model's own output already
  ended with the end-of-turn special token the template writes there (EOS, <|im_end|>), it is not
  added twice. Any other call starts a new sequence (`Turn.parent` is None): an agent that edits
  the reply before sending it back gets a new sequence, not a silently re-tokenised one.
- `completions.create(prompt=str | list[int])` is the /v1/completions shape; a prompt that extends
  an earlier prompt + output (the same ids, or the same text) continues that sequence in the same way.
- Supported arguments: messages / prompt, model (echoed), max_tokens / max_completion_tokens,
  temperature (0 = greedy), stop (str or list; the output is cut right after the stop string, which
  stays in the content, so the text the agent sees is the tokens trained on), n (n concurrent
  `agenerate` calls), logprobs, timeout (seconds), and top_p only at the run's `generation.top_p`.
  Any other argument with a value that changes the answer (tools=, stream=True, seed=, ...) is a
  one-line error: TypeError for names the OpenAI API does not have, ValueError for the rest.

Trajectories (the tree of turns: a call that extends a turn is its child):
- `client.trajectory(reward, completion=None, index=0)`: one trajectory (`TrajectoryBuilder`
  layout) of the conversation ending with choice `index` of `completion` (a response of this
  client, its id, or a `Turn`; default the last call): the first prompt with loss_mask 0, each
  generated segment with loss_mask 1 and its behaviour log-probs and versions, the tokens between
  segments (tool/user messages, template glue) with loss_mask 0.
- `client.leaves()`: the turns no later call extended, in the order they were made: every
  conversation's end (with n > 1, each choice is a leaf until it is continued).
  `client.trajectories(rewards)` gives one trajectory per leaf (a group, as GRPO wants);
  `rewards` is one float for all or a list aligned with `leaves()`.
For GRPO over whole agent runs, run `gconfig.n_samples` agents, each with its own client, and
return `[c.trajectory(r) for c, r in ...]`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from openai.types import Completion as TextCompletion
from openai.types.chat import ChatCompletion

from realcore.api.workflow import Completion, RolloutEngine, TrajectoryBuilder

ROLES = ("system", "user", "assistant", "tool")
# Arguments of the OpenAI API we do not implement, with the values that mean "not used" there.
# Any other value is refused; None / NOT_GIVEN / omit always mean "not given".
NEUTRAL: dict[str, tuple] = {
    "stream": (False,), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "top_logprobs": (0,),
    "parallel_tool_calls": (), "tool_choice": ("none",), "tools": ([],), "functions": ([],),
    "function_call": ("none",), "logit_bias": ({},), "response_format": ({"type": "text"},), "seed": (),
    "audio": (), "modalities": (["text"],), "prediction": (), "reasoning_effort": (), "service_tier": (),
    "stream_options": (), "store": (False,), "metadata": ({},), "user": (), "verbosity": (),
    "web_search_options": (), "prompt_cache_key": (), "prompt_cache_options": (), "prompt_cache_retention": (),
    "safety_identifier": (), "moderation": (), "extra_headers": ({},), "extra_query": ({},), "extra_body": ({},),
    "best_of": (1,), "echo": (False,), "suffix": (),
}


@dataclass(eq=False)
class Turn:
    """One choice of one call: exactly what the policy was given and what it generated."""

    id: str  # the response's id (ChatCompletion.id / Completion.id)
    index: int  # the choice's index in that response
    prompt_ids: list[int]  # what agenerate got
    completion: Completion  # what it returned (output ids, behaviour log-probs, versions)
    parent: Turn | None  # the turn whose prompt + output this prompt extends; None: a new sequence
    new_ids: list[int]  # prompt_ids after the parent's prompt + output (all of prompt_ids without a parent)
    messages: list[dict] | None = None  # chat: the request's messages, normalised
    prompt_text: str | None = None  # /v1/completions with a text prompt


class ChatClient:
    """`client.chat.completions.create(...)` and `client.completions.create(...)` as in
    `openai.AsyncOpenAI`, generating with `engine`; the module docstring has the contract.
    `chat_template_kwargs` go to `tokenizer.apply_chat_template` (e.g. enable_thinking=False)."""

    def __init__(self, engine: RolloutEngine, chat_template_kwargs: dict | None = None):
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.turns: list[Turn] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._chat_create))
        self.completions = SimpleNamespace(create=self._text_create)

    # --- the OpenAI surface ---------------------------------------------------------------------

    async def _chat_create(self, *, messages, model: str | None = None, max_tokens: int | None = None,
                           max_completion_tokens: int | None = None, temperature: float | None = None,
                           stop: str | list[str] | None = None, n: int | None = None, logprobs: bool | None = None,
                           top_p: float | None = None, timeout: float | None = None, **other: Any):
        _check_unsupported("chat.completions.create", other)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("chat.completions.create: the tokenizer has no chat template (use completions.create)")
        msgs = normalise_messages(messages)
        parent = chat_parent(self.turns, msgs)
        if parent is None:
            prompt_ids, new_ids = self._encode(self._render(msgs)), None
        else:
            k = len(parent.messages)
            new_ids = tail_ids(self.tokenizer, msgs, k, parent.completion.output_ids, self.template_kwargs)
            prompt_ids = parent.prompt_ids + parent.completion.output_ids + new_ids
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        outs = await self._sample(prompt_ids, n, max_tokens, max_completion_tokens, temperature, stop, top_p, timeout)
        self._record(rid, prompt_ids, outs, parent, new_ids, messages=msgs)
        choices = [{"index": i, "finish_reason": c.finish_reason, "message": {"role": "assistant", "content": c.text},
                    "logprobs": {"content": self._token_logprobs(c)} if logprobs else None}
                   for i, c in enumerate(outs)]
        return ChatCompletion.model_validate({"id": rid, "object": "chat.completion", "created": int(time.time()),
                                              "model": model or "realcore", "choices": choices,
                                              "usage": _usage(prompt_ids, outs)})

    async def _text_create(self, *, prompt: str | list[int], model: str | None = None, max_tokens: int | None = None,
                           temperature: float | None = None, stop: str | list[str] | None = None, n: int | None = None,
                           logprobs: int | None = None, top_p: float | None = None, timeout: float | None = None,
                           **other: Any):
        _check_unsupported("completions.create", other)
        if logprobs not in (None, 0):
            raise ValueError(f"completions.create: logprobs={logprobs!r}: only 0 (the sampled tokens' log-probs) "
                             "is available, no top alternatives")
        parent, text = None, None
        if isinstance(prompt, str):
            text, parent = prompt, text_parent(self.turns, prompt)
            rest = None if parent is None else prompt[len(parent.prompt_text) + len(parent.completion.text):]
            new_ids = None if parent is None else self._encode(rest)
            fresh = list(self.tokenizer(prompt).input_ids) if parent is None else None  # as vLLM: special tokens added
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            parent = ids_parent(self.turns, prompt)
            new_ids = None if parent is None else prompt[len(parent.prompt_ids) + len(parent.completion.output_ids):]
            fresh = list(prompt)
        else:
            raise ValueError("completions.create: prompt must be a string or a non-empty list of token ids")
        prompt_ids = fresh if parent is None else parent.prompt_ids + parent.completion.output_ids + new_ids
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        outs = await self._sample(prompt_ids, n, max_tokens, None, temperature, stop, top_p, timeout)
        self._record(rid, prompt_ids, outs, parent, new_ids, prompt_text=text)
        choices = [{"index": i, "text": c.text, "finish_reason": c.finish_reason,
                    "logprobs": None if logprobs is None else self._text_logprobs(c)} for i, c in enumerate(outs)]
        return TextCompletion.model_validate({"id": rid, "object": "text_completion", "created": int(time.time()),
                                              "model": model or "realcore", "choices": choices,
                                              "usage": _usage(prompt_ids, outs)})

    # --- trajectories ----------------------------------------------------------------------------

    def trajectory(self, reward: float, completion: Any = None, *, index: int = 0) -> dict[str, torch.Tensor]:
        """The trajectory of the conversation ending with choice `index` of `completion` (a response
        of this client, its id, or a Turn; default: the last call)."""
        turn = self.find(completion, index)
        chain = []
        t: Turn | None = turn
        while t is not None:
            chain.append(t)
            t = t.parent
        chain.reverse()
        b = TrajectoryBuilder(chain[0].prompt_ids)
        for i, t in enumerate(chain):
            if i:
                b.add_observation(t.new_ids)
            b.add_completion(t.completion)
        assert b.ids == turn.prompt_ids + turn.completion.output_ids, "a turn's prompt does not extend its parent's"
        return b.to_tensors(reward)

    def leaves(self) -> list[Turn]:
        """The turns no later call extended (each conversation's end), in the order they were made."""
        extended = {id(t.parent) for t in self.turns if t.parent is not None}
        return [t for t in self.turns if id(t) not in extended]

    def trajectories(self, rewards: float | Sequence[float]) -> list[dict[str, torch.Tensor]]:
        """One trajectory per leaf; `rewards`: one float for all, or a list aligned with `leaves()`."""
        leaves = self.leaves()
        if not leaves:
            raise ValueError("trajectories: nothing was generated with this client")
        if isinstance(rewards, (int, float)):
            rewards = [float(rewards)] * len(leaves)
        if len(rewards) != len(leaves):
            raise ValueError(f"trajectories: {len(rewards)} rewards for {len(leaves)} conversations (client.leaves())")
        return [self.trajectory(r, t) for t, r in zip(leaves, rewards)]

    def find(self, completion: Any = None, index: int = 0) -> Turn:
        """The Turn of choice `index` of `completion` (a response of this client, its id, a Turn;
        None: the last call)."""
        if isinstance(completion, Turn):
            return completion
        if not self.turns:
            raise ValueError("nothing was generated with this client")
        rid = self.turns[-1].id if completion is None else completion if isinstance(completion, str) else \
            getattr(completion, "id", None)
        for t in self.turns:
            if t.id == rid and t.index == index:
                return t
        raise ValueError(f"no choice {index} of a completion {rid!r} made by this client")

    # --- helpers ---------------------------------------------------------------------------------

    async def _sample(self, prompt_ids, n, max_tokens, max_completion_tokens, temperature, stop, top_p,
                      timeout) -> list[Completion]:
        kwargs = generation_kwargs(self.engine.gconfig, max_tokens, max_completion_tokens, temperature, stop, top_p)
        n = 1 if n is None else n
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n={n!r}: must be an integer >= 1")
        calls = asyncio.gather(*(self.engine.agenerate(prompt_ids, **kwargs) for _ in range(n)))
        return list(await (calls if timeout is None else asyncio.wait_for(calls, float(timeout))))

    def _record(self, rid, prompt_ids, outs, parent, new_ids, **kind) -> None:
        for i, c in enumerate(outs):
            self.turns.append(Turn(rid, i, list(prompt_ids), c, parent,
                                   list(prompt_ids) if new_ids is None else list(new_ids), **kind))

    def _render(self, msgs: list[dict]) -> str:
        return render(self.tokenizer, msgs, self.template_kwargs)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _text_logprobs(self, c: Completion) -> dict:
        tokens = [self.tokenizer.decode([t]) for t in c.output_ids]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": list(c.output_logprobs), "text_offset": offsets, "top_logprobs": None}

    def _token_logprobs(self, c: Completion) -> list[dict]:
        out = []
        for t, lp in zip(c.output_ids, c.output_logprobs):
            tok = self.tokenizer.decode([t])
            out.append({"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")), "top_logprobs": []})
        return out


def generation_kwargs(gconfig, max_tokens, max_completion_tokens, temperature, stop, top_p) -> dict:
    """OpenAI sampling arguments -> `agenerate` keyword arguments (None: the run's default)."""
    if max_tokens is not None and max_completion_tokens is not None and max_tokens != max_completion_tokens:
        raise ValueError(f"max_tokens={max_tokens} and max_completion_tokens={max_completion_tokens} disagree")
    limit = max_completion_tokens if max_completion_tokens is not None else max_tokens
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"max_tokens={limit!r}: must be an integer >= 1")
    if temperature is not None and (not isinstance(temperature, (int, float)) or temperature < 0):
        raise ValueError(f"temperature={temperature!r}: must be a number >= 0")
    if top_p is not None and top_p != gconfig.top_p:
        raise ValueError(f"top_p={top_p}: this run samples with generation.top_p={gconfig.top_p} (set it there)")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise ValueError(f"stop={stop!r}: must be a string or a list of non-empty strings")
    kwargs: dict[str, Any] = {"max_new_tokens": limit, "stop": stop or None}
    if temperature is not None:  # 0 means greedy in the OpenAI API (and SGLang's)
        kwargs.update(greedy=temperature == 0, temperature=None if temperature == 0 else float(temperature))
    return kwargs


def _check_unsupported(where: str, other: dict) -> None:
    for name, value in other.items():
        if name not in NEUTRAL:
            raise TypeError(f"{where}: unexpected argument {name!r}")
        if value is None or type(value).__name__ in ("NotGiven", "Omit") or value in NEUTRAL[name]:
            continue
        raise ValueError(f"{where}: {name}={value!r} is not supported by realcore's ChatClient "
                         "(it generates plain text with the policy; leave it unset)")


def normalise_messages(messages: Any) -> list[dict]:
    """OpenAI messages (dicts or the package's message objects) -> plain dicts with str content;
    ValueError on roles, content parts or tool calls this client does not support."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if hasattr(m, "model_dump"):  # e.g. resp.choices[0].message appended as is
            m = m.model_dump(exclude_none=True)
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}]: a message is a dict with role and content, got {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None and v != []}
        role, content = m.get("role"), m.get("content", "")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]: role {role!r} is not one of {list(ROLES)}")
        if m.get("tool_calls") or m.get("function_call"):
            raise ValueError(f"messages[{i}]: tool calls are not supported (tools are text the agent parses)")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ValueError(f"messages[{i}]: only text content parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}]: content must be a string, got {type(content).__name__}")
        out.append({**m, "content": content})
    return out


def render(tokenizer, msgs: list[dict], template_kwargs: dict) -> str:
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **template_kwargs)


def chat_parent(turns: list[Turn], msgs: list[dict]) -> Turn | None:
    """The turn these messages continue: its messages, then its reply as an assistant message with
    the content unchanged, then more. The longest such turn (the latest of equals)."""
    best = None
    for t in turns:
        k = len(t.messages) if t.messages is not None else None
        if k is None or len(msgs) <= k or (best is not None and k < len(best.messages)):
            continue
        reply = msgs[k]
        if reply["role"] == "assistant" and reply["content"] == t.completion.text and msgs[:k] == t.messages:
            best = t
    return best


def text_parent(turns: list[Turn], prompt: str) -> Turn | None:
    """The /v1/completions turn whose text prompt + output text this prompt starts with (the longest)."""
    found = [t for t in turns if t.prompt_text is not None and prompt.startswith(t.prompt_text + t.completion.text)]
    return max(found, key=lambda t: len(t.prompt_text) + len(t.completion.text), default=None)


def ids_parent(turns: list[Turn], prompt: list[int]) -> Turn | None:
    """The turn whose prompt ids + output ids this prompt starts with (the longest)."""
    def extends(t: Turn) -> bool:
        n = len(t.prompt_ids) + len(t.completion.output_ids)
        return len(prompt) >= n and prompt[:n] == t.prompt_ids + t.completion.output_ids

    return max((t for t in turns if extends(t)), key=lambda t: len(t.prompt_ids) + len(t.completion.output_ids),
               default=None)


def tail_ids(tokenizer, msgs: list[dict], k: int, output_ids: list[int], template_kwargs: dict) -> list[int]:
    """Token ids of what the chat template writes after the assistant message `msgs[k]` (whose
    tokens are `output_ids`, as generated): its end of turn, msgs[k+1:], the generation prompt.

    The reply is rendered as a marker so that its text is never re-tokenised. If the output ends
    with special tokens (EOS, <|im_end|>) and the template writes the same text right after the
    content, they are in the sequence already and are not added again."""
    marker = f"<<realcore-reply-{uuid.uuid4().hex}>>"
    text = render(tokenizer, msgs[:k] + [{**msgs[k], "content": marker}] + msgs[k + 1:], template_kwargs)
    if text.count(marker) != 1:
        raise ValueError(f"the chat template writes an assistant message's content {text.count(marker)} times, "
                         "not once: a conversation cannot be extended token by token with it")
    tail = text[text.index(marker) + len(marker):]
    special = set(tokenizer.all_special_ids)
    i = len(output_ids)
    while i > 0 and output_ids[i - 1] in special:
        i -= 1
    end = tokenizer.decode(output_ids[i:], skip_special_tokens=False) if i < len(output_ids) else ""
    if end and tail.startswith(end):
        tail = tail[len(end):]
    return list(tokenizer.encode(tail, add_special_tokens=False))


def _usage(prompt_ids: list[int], outs: list[Completion]) -> dict:
    n_out = sum(len(c.output_ids) for c in outs)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": n_out, "total_tokens": len(prompt_ids) + n_out}
