"""`ChatClient`: an agent written against the OpenAI API, generating through a real built-in server
(`python -m realcore.serve`, tiny model), trains on exactly the tokens and log-probs it sampled.

The tiny tokenizer has a chat template (realcore.backends.models.TINY_CHAT_TEMPLATE: "Role: content"
lines, "Assistant:" as generation prompt). It renders an earlier reply as "Assistant: <content>",
with a space the model never generated after "Assistant:", so re-rendering a conversation does not
reproduce the sampled tokens: the drift the client must avoid shows here.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from types import SimpleNamespace

import openai
import pytest
import torch

from realcore.api.config import GenerationConfig, ModelConfig
from realcore.backends.clients.sglang_api import GenClient
from realcore.backends.models import load_tokenizer, prepare_model
from realcore.backends.server_launch import wait_http_ready
from realcore.serve import API_KEY_ENV
from realcore.workflows.engines import ServerEngine
from realcore.workflows.openai_client import ChatClient, tail_ids

pytestmark = pytest.mark.timeout(120)
TOKEN = "openai-client-test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return prepare_model(ModelConfig(name="tiny", cache_dir=str(tmp_path_factory.mktemp("models"))), seed=0)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    port, log = free_port(), open(tmp_path_factory.mktemp("openai-client") / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "realcore.serve", "--model-path", model_dir, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", API_KEY_ENV: TOKEN})
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_http_ready(url, timeout_s=90, proc=proc, token=TOKEN))
        yield SimpleNamespace(url=url, model_dir=model_dir, tokenizer=load_tokenizer(model_dir))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def with_client(server, body, **gconfig):
    """Run `await body(client)` against the server; temperature 1 unless said (the policy's own
    distribution, which the trainer recomputes)."""
    async def reward_fn(*_):
        return 1.0

    async def main():
        gen = GenClient(server.url, token=TOKEN, timeout_s=60)
        engine = ServerEngine(gen, server.tokenizer, GenerationConfig(**{"max_new_tokens": 8, **gconfig}), reward_fn,
                              rid="t")
        try:
            return await body(ChatClient(engine))
        finally:
            await gen.close()

    return asyncio.run(main())


@pytest.fixture(scope="module")
def conversation(server):
    """system + user -> reply -> tool result -> reply -> user -> reply (all sampled at temperature 1)."""
    async def agent(client):
        msgs = [{"role": "system", "content": "You are a calculator."}, {"role": "user", "content": "What is 2 + 3?"}]
        r1 = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=6, temperature=1.0,
                                                  logprobs=True)
        msgs += [r1.choices[0].message, {"role": "tool", "content": "5", "tool_call_id": "call-1"}]  # the object itself
        r2 = await client.chat.completions.create(model="policy", messages=msgs, max_completion_tokens=6,
                                                  temperature=1.0, logprobs=True)
        msgs += [{"role": "assistant", "content": r2.choices[0].message.content}, {"role": "user", "content": "Sure?"}]
        r3 = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=5, logprobs=True)
        return SimpleNamespace(responses=[r1, r2, r3], turns=list(client.turns), traj=client.trajectory(1.0),
                               msgs=msgs)

    return with_client(server, agent)


def test_turns_extend_the_sampled_tokens_exactly(server, conversation):
    tok, (t1, t2, t3) = server.tokenizer, conversation.turns

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    assert t1.parent is None and t1.prompt_ids == enc("System: You are a calculator.\nUser: What is 2 + 3?\nAssistant:")
    assert t2.parent is t1 and t3.parent is t2
    # Each prompt = the previous prompt + the previous OUTPUT ids as sampled + only the new messages' tokens.
    assert t2.prompt_ids == t1.prompt_ids + t1.completion.output_ids + enc("\nTool: 5\nAssistant:")
    assert t3.prompt_ids == t2.prompt_ids + t2.completion.output_ids + enc("\nUser: Sure?\nAssistant:")
    assert t3.new_ids == enc("\nUser: Sure?\nAssistant:")
    # Re-rendering the conversation (what the client must not do) gives other tokens.
    msgs = [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in conversation.msgs[:4]]
    rerendered = enc(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    assert rerendered != t2.prompt_ids


def test_trajectory_masks_exactly_the_generated_segments(conversation):
    (t1, t2, t3), traj = conversation.turns, conversation.traj
    assert traj["input_ids"].tolist() == t3.prompt_ids + t3.completion.output_ids
    expected = ([0] * len(t1.prompt_ids) + [1] * len(t1.completion.output_ids) + [0] * len(t2.new_ids)
                + [1] * len(t2.completion.output_ids) + [0] * len(t3.new_ids) + [1] * len(t3.completion.output_ids))
    assert traj["loss_mask"].tolist() == expected
    returned = [lp.logprob for r in conversation.responses for lp in r.choices[0].logprobs.content]
    mask = traj["loss_mask"].bool()
    assert torch.equal(traj["behav_logprobs"][mask], torch.tensor(returned, dtype=torch.float32))
    assert not traj["behav_logprobs"][~mask].any()
    assert traj["rewards"].tolist() == [1.0] and traj["version_start"].item() == traj["version_end"].item() == 0


def test_responses_are_openai_chat_completions(server, conversation):
    for r, t, limit in zip(conversation.responses, conversation.turns, (6, 6, 5)):
        assert isinstance(r, openai.types.chat.ChatCompletion) and r.object == "chat.completion" and r.model == "policy"
        (choice,) = r.choices
        out = t.completion.output_ids
        assert choice.message.role == "assistant"
        assert choice.message.content == server.tokenizer.decode(out, skip_special_tokens=True)
        assert len(choice.logprobs.content) == r.usage.completion_tokens == len(out) and 1 <= len(out) <= limit
        assert [x.logprob for x in choice.logprobs.content] == t.completion.output_logprobs
        assert r.usage.prompt_tokens == len(t.prompt_ids) and choice.finish_reason in ("stop", "length")


def test_recorded_logprobs_are_what_the_policy_recomputes(server, conversation):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32).eval()
    ids, mask = conversation.traj["input_ids"], conversation.traj["loss_mask"].bool()
    with torch.no_grad():
        logits = model(ids[None]).logits[0].float()  # (T, V)
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None]).squeeze(1)  # log p(token t | tokens < t)
    assert not mask[0]
    diff = (logp[mask[1:]] - conversation.traj["behav_logprobs"][mask]).abs().max().item()
    print(f"max |behav - recomputed| over {int(mask.sum())} tokens: {diff:.2e}")
    assert diff < 1e-4, diff


def test_n_choices_greedy_and_one_trajectory_per_leaf(server):
    async def agent(client):
        user = [{"role": "user", "content": "What is 7 * 6?"}]
        r = await client.chat.completions.create(messages=user, n=3, max_tokens=4, temperature=1.0)
        assert [c.index for c in r.choices] == [0, 1, 2] and all(c.logprobs is None for c in r.choices)
        first = list(client.turns)
        assert len(first) == 3 and len({tuple(t.prompt_ids) for t in first}) == 1
        assert all(len(t.completion.output_ids) <= 4 for t in first) and client.leaves() == first
        # The agent goes on with choice 1.
        picked = r.choices[1].message
        await client.chat.completions.create(messages=user + [picked, {"role": "user", "content": "Again."}],
                                             max_tokens=4)
        last = client.turns[-1]
        assert last.parent in first and last.parent.completion.text == picked.content
        assert client.leaves() == [t for t in first if t is not last.parent] + [last]
        trajs = client.trajectories([0.0, 0.5, 1.0])
        assert [t["rewards"].item() for t in trajs] == [0.0, 0.5, 1.0]
        assert trajs[2]["input_ids"].tolist() == last.prompt_ids + last.completion.output_ids
        with pytest.raises(ValueError, match="2 rewards for 3 conversations"):
            client.trajectories([1.0, 1.0])
        g = await client.chat.completions.create(messages=user, n=2, max_tokens=6, temperature=0)
        a, b = client.find(g, 0), client.find(g, 1)
        return a.completion.output_ids, b.completion.output_ids, g

    a, b, g = with_client(server, agent)
    assert a == b and len(a) >= 1 and g.choices[0].message.content == g.choices[1].message.content  # temperature 0: greedy


def test_an_edited_reply_starts_a_new_sequence(server):
    async def agent(client):
        msgs = [{"role": "user", "content": "Hi"}]
        r = await client.chat.completions.create(messages=msgs, max_tokens=4)
        edited = {"role": "assistant", "content": r.choices[0].message.content + " (edited)"}
        await client.chat.completions.create(messages=msgs + [edited, {"role": "user", "content": "Go on"}],
                                             max_tokens=4)
        return client.turns, msgs + [edited, {"role": "user", "content": "Go on"}]

    turns, msgs = with_client(server, agent)
    tok = server.tokenizer
    assert turns[1].parent is None and turns[1].new_ids == turns[1].prompt_ids
    assert turns[1].prompt_ids == tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                                             add_special_tokens=False)


def test_unsupported_arguments_are_one_line_errors(server):
    user = [{"role": "user", "content": "Hi"}]
    bad = [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, ValueError, "tools="),
        ({"stream": True}, ValueError, "stream=True is not supported"),
        ({"frobnicate": 1}, TypeError, "unexpected argument 'frobnicate'"),
        ({"top_logprobs": 3}, ValueError, "top_logprobs=3"),
        ({"top_p": 0.5}, ValueError, "generation.top_p=1.0"),
        ({"max_tokens": 0}, ValueError, "max_tokens=0"),
        ({"n": 0}, ValueError, "n=0"),
        ({"temperature": -1}, ValueError, "temperature=-1"),
        ({"messages": [{"role": "robot", "content": "x"}]}, ValueError, "role 'robot'"),
        ({"messages": user + [{"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}]}, ValueError,
         "tool calls are not supported"),
    ]

    async def agent(client):
        for kwargs, error, message in bad:
            with pytest.raises(error, match=message) as e:
                await client.chat.completions.create(**{"messages": user, **kwargs})
            assert "\n" not in str(e.value)
        with pytest.raises(ValueError, match="only 0"):
            await client.completions.create(prompt="x", logprobs=2)
        assert not client.turns  # nothing was generated
        # "not given" and neutral values are fine
        await client.chat.completions.create(messages=user, tools=None, stream=False, seed=openai.NOT_GIVEN,
                                             max_tokens=2)
        with pytest.raises(ValueError, match="no choice 0 of a completion 'chatcmpl-none'"):
            client.trajectory(1.0, "chatcmpl-none")
        return len(client.turns)

    assert with_client(server, agent) == 1


def test_text_completions_continue_by_text_and_by_ids(server):
    tok = server.tokenizer
    prompt = "Question: What is 2 + 3?\nAnswer:"

    async def agent(client):
        r = await client.completions.create(model="p", prompt=prompt, max_tokens=4, logprobs=0)
        assert isinstance(r, openai.types.Completion) and r.object == "text_completion"
        t1 = client.turns[-1]
        assert r.choices[0].text == tok.decode(t1.completion.output_ids, skip_special_tokens=True)
        assert r.choices[0].logprobs.token_logprobs == t1.completion.output_logprobs
        assert len(r.choices[0].logprobs.tokens) == r.usage.completion_tokens == len(t1.completion.output_ids)
        more = "\nQuestion: And 4 + 4?\nAnswer:"
        await client.completions.create(prompt=prompt + r.choices[0].text + more, max_tokens=4)
        t2 = client.turns[-1]
        assert t2.parent is t1 and t2.new_ids == tok.encode(more, add_special_tokens=False)
        assert t2.prompt_ids == t1.prompt_ids + t1.completion.output_ids + t2.new_ids
        await client.completions.create(prompt=t2.prompt_ids + t2.completion.output_ids + [5, 6], max_tokens=3)
        t3 = client.turns[-1]
        assert t3.parent is t2 and t3.new_ids == [5, 6]
        traj = client.trajectory(0.5)
        assert traj["input_ids"].tolist() == t3.prompt_ids + t3.completion.output_ids
        assert int(traj["loss_mask"].sum()) == sum(len(t.completion.output_ids) for t in (t1, t2, t3))

    with_client(server, agent)


def test_end_of_turn_the_model_generated_is_not_added_twice(model_dir):
    """A template that closes assistant turns with EOS (as Qwen's closes them with <|im_end|>)."""
    tok = load_tokenizer(model_dir)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                         "{% if m['role'] == 'assistant' %}<|endoftext|>{% endif %}{{ '\\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}")
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "Go"}]
    reply = tok.encode(" yo", add_special_tokens=False)
    eos = tok.eos_token_id
    glue = tok.encode("\nuser: Go\nassistant:", add_special_tokens=False)
    assert tail_ids(tok, msgs, 1, reply + [eos], {}) == glue  # the model ended its turn: EOS is in its output
    assert tail_ids(tok, msgs, 1, reply, {}) == [eos] + glue  # cut by length or a stop string: the template's EOS
