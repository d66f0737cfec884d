"""The built-in server's OpenAI API (/v1/chat/completions, /v1/completions), driven by the real
`openai` package against `python -m realcore.serve` processes (docs/openai.md).

Two servers run for the whole file: one on a tiny model whose tokenizer has a chat template, one
on a copy without it. The tiny model's weights are redrawn at a larger scale: at HF's init scale
greedy output repeats one token, which would make the stop-string and equality checks vacuous.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from realcore.api.config import ModelConfig
from realcore.backends.models import load_model, load_tokenizer, prepare_model
from realcore.data.datasets import prompt_token_ids
from tiny_models import spread_weights

pytestmark = pytest.mark.timeout(120)
TOKEN = "openai-test-token"
READY = re.compile(r"The server is fired up and ready to roll! \((http://[^)]+)\)")
QUESTION = "What is 7 + 5?"
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("openai_models")
    tiny = prepare_model(ModelConfig(name="tiny", cache_dir=str(root / "cache")), seed=0)
    model, tok = load_model(tiny), load_tokenizer(tiny)
    spread_weights(model, seed=7)
    chat, plain = root / "chat", root / "plain"
    model.save_pretrained(chat, safe_serialization=True)
    tok.save_pretrained(chat)
    shutil.copytree(chat, plain)
    (plain / "chat_template.jinja").unlink()  # where transformers 5 saves it
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(str(chat)).chat_template and load_tokenizer(str(plain)).chat_template is None
    return {"chat": str(chat), "plain": str(plain)}


def start(model_dir: str, log_path) -> tuple[subprocess.Popen, object]:
    log = open(log_path, "w+")
    argv = [sys.executable, "-m", "realcore.serve", "--model-path", model_dir, "--port", "0", "--random-seed", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "REALCORE_API_KEY": TOKEN}
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env), log


def wait_ready(proc: subprocess.Popen, log, timeout_s: float = 90) -> str:
    """The server's URL, from SGLang's readiness line in its log (it was started with --port 0)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log.seek(0)
        found = READY.search(log.read())
        if found:
            return found.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    log.seek(0)
    pytest.fail(f"realcore.serve did not get ready (exit code {proc.poll()}):\n{log.read()[-3000:]}")


@pytest.fixture(scope="module")
def urls(model_dirs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("openai_logs")
    started = {name: start(path, logs / f"{name}.log") for name, path in model_dirs.items()}
    try:
        yield {name: wait_ready(proc, log) for name, (proc, log) in started.items()}
    finally:
        for proc, log in started.values():
            proc.terminate()
            try:
                assert proc.wait(timeout=30) == 0
            finally:
                if proc.poll() is None:
                    proc.kill()
                log.close()


@pytest.fixture(scope="module")
def client(urls) -> openai.OpenAI:
    return openai.OpenAI(base_url=urls["chat"] + "/v1", api_key=TOKEN, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(model_dirs):
    return load_tokenizer(model_dirs["chat"])


def call(url: str, data: bytes | None = None) -> tuple[int, dict]:
    """(status, JSON answer) of a GET (no data) or a POST."""
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def native(url: str, path: str, body: dict | None = None) -> dict:
    """One call to the server's own (SGLang) API."""
    status, answer = call(url + path, None if body is None else json.dumps(body).encode())
    assert status == 200, answer
    return answer


def greedy_ids(url: str, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    reply = native(url, "/generate", {"input_ids": prompt, "return_logprob": True,
                                      "sampling_params": {"max_new_tokens": n, "temperature": 0.0}})
    return reply["output_ids"], [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]


def test_chat_greedy_logprobs_and_ids_match_generate(client, urls, tokenizer):
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, logprobs=True, temperature=0)
    again = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=8, temperature=0)
    (c,) = first.choices
    assert first.object == "chat.completion" and first.model == client.models.list().data[0].id
    assert first.prompt_token_ids == prompt_token_ids(tokenizer, QUESTION, True, "Answer briefly.")
    assert first.usage.prompt_tokens == len(first.prompt_token_ids)
    assert c.message.role == "assistant"
    assert c.message.content == tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert len(c.logprobs.content) == first.usage.completion_tokens == len(c.token_ids) > 0
    assert [e.token for e in c.logprobs.content] == [tokenizer.decode([t]) for t in c.token_ids]
    assert all(e.logprob <= 0 and e.top_logprobs == [] for e in c.logprobs.content)
    assert c.finish_reason == ("length" if len(c.token_ids) == 8 else "stop")
    assert c.weight_version == first.metadata["weight_version"] == "0"
    assert again.choices[0].token_ids == c.token_ids and again.choices[0].logprobs is None  # greedy: deterministic

    ids, logprobs = greedy_ids(urls["chat"], first.prompt_token_ids, 8)  # the same templated ids, SGLang's API
    assert ids == c.token_ids
    assert [e.logprob for e in c.logprobs.content] == pytest.approx(logprobs, abs=1e-5)


def test_n_choices_are_separate_samples(client):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, n=3, temperature=1.0)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in reply.choices}) > 1
    assert reply.usage.completion_tokens == sum(len(c.token_ids) for c in reply.choices)
    assert reply.usage.prompt_tokens == len(reply.prompt_token_ids)  # the prompt counts once


def printable_after(text: str, start: int, n: int) -> str:
    """The first n printable ASCII characters in a row at or after `start` (the tiny model also
    emits lone bytes, which decode to U+FFFD)."""
    found = re.compile(f"[ -~]{{{n}}}").search(text, start)
    assert found, f"no {n} printable characters after {start} in {text!r}"
    return found.group(0)


def test_stop_string_cuts_the_output_after_the_token_that_completes_it(client, tokenizer):
    full = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0).choices[0]
    ids, text = full.token_ids, full.message.content
    assert len(ids) == 24, "the greedy output must be long enough to cut"
    start = len(tokenizer.decode(ids[:12], skip_special_tokens=True))
    stop = printable_after(text, start, 3)  # from the 13th token on: it may span tokens
    assert text.index(stop) > 0
    # the first k tokens whose text holds the stop string
    k = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k], skip_special_tokens=True))

    for stops in (stop, ["never seen \u2603", stop]):
        cut = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0,
                                             stop=stops, logprobs=True).choices[0]
        assert cut.message.content == text[:text.index(stop)] and cut.finish_reason == "stop"
        assert cut.token_ids == ids[:k] and len(cut.logprobs.content) == k < len(ids)
        assert cut.matched_stop == stop

    raw = client.completions.create(model="tiny", prompt=full.token_ids[:4], max_tokens=24, temperature=0).choices[0]
    piece = printable_after(raw.text, len(raw.text) // 2, 2)
    cut = client.completions.create(model="tiny", prompt=full.token_ids[:4], max_tokens=24, temperature=0,
                                    stop=piece).choices[0]
    assert cut.text == raw.text[:raw.text.index(piece)] and cut.finish_reason == "stop"


def test_completions_with_token_ids_text_and_batches(client, urls, tokenizer):
    prompt = [5, 17, 42, 9, 100]
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=0)
    (c,) = reply.choices
    assert reply.object == "text_completion" and c.prompt_token_ids == prompt
    ids, logprobs = greedy_ids(urls["chat"], prompt, 6)
    assert c.token_ids == ids and c.logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-5)
    assert len(c.logprobs.tokens) == reply.usage.completion_tokens == len(ids)
    assert c.logprobs.text_offset == sorted(c.logprobs.text_offset) and c.logprobs.text_offset[0] == 0
    assert c.text == tokenizer.decode(ids, skip_special_tokens=True)

    text = client.completions.create(model="tiny", prompt="Question: What is 3 + 4?\nAnswer:", max_tokens=2)
    assert text.choices[0].prompt_token_ids == tokenizer.encode("Question: What is 3 + 4?\nAnswer:")

    batch = client.completions.create(model="tiny", prompt=[prompt, [7, 8]], n=2, max_tokens=3, temperature=0)
    assert [c.prompt_token_ids for c in batch.choices] == [prompt, prompt, [7, 8], [7, 8]]
    assert batch.choices[0].token_ids == ids[:3] == batch.choices[1].token_ids
    assert batch.usage.prompt_tokens == len(prompt) + 2


def test_an_aborted_request_returns_its_partial_output(client, urls, tokenizer):
    result: dict = {}

    def ask():
        result["reply"] = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1500,
                                                         temperature=0)

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        deadline = time.monotonic() + 30
        while native(urls["chat"], "/get_server_info")["num_running_reqs"] == 0:
            assert time.monotonic() < deadline and asker.is_alive(), "the request never ran"
            time.sleep(0.01)
        time.sleep(0.2)  # some tokens in
        native(urls["chat"], "/pause_generation", {"mode": "abort"})
    finally:
        native(urls["chat"], "/continue_generation", {})
        asker.join(timeout=60)
    c = result["reply"].choices[0]
    assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 1500  # SGLang's and vLLM's reason
    assert c.message.content == tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert greedy_ids(urls["chat"], result["reply"].prompt_token_ids, len(c.token_ids))[0] == c.token_ids


def test_wrong_token_is_an_authentication_error(urls):
    intruder = openai.OpenAI(base_url=urls["chat"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="bearer token"):
        intruder.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        intruder.completions.create(model="tiny", prompt=[1, 2], max_tokens=2)


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 17}, "n: Input should be less than or equal to 16"),
    ({"logprobs": True, "top_logprobs": 2}, "top_logprobs: only 0 is supported"),
    ({"stream": True}, "stream: streaming is not supported"),
    ({"max_tokens": 5000}, "exceeds the model's context of 2048 tokens"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "disagree"),
    ({"temperature": -1}, "temperature: Input should be greater than or equal to 0"),
    ({"messages": []}, "messages: List should have at least 1 item"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role: Input should be"),
    ({"stop": ["x"] * 17}, "at most 16 items"),
    ({"extra_body": {"tools_x": []}}, "tools_x: Extra inputs are not permitted"),
])  # fmt: skip
def test_bad_chat_bodies_are_bad_requests(client, kwargs, message):
    args = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert message in e.value.message and "\n" not in e.value.message
    assert e.value.type == "invalid_request_error"


@pytest.mark.parametrize("kwargs, message", [
    ({"echo": True}, "echo: returning the prompt is not supported"),
    ({"logprobs": 2}, "logprobs: only 0 is supported"),
    ({"prompt": [1, 2, 10**6]}, "prompt: token id 1000000 is outside the vocabulary"),
    ({"prompt": ""}, "prompt: the text has no tokens"),
    ({"prompt": []}, "prompt: an empty list"),
    ({"prompt": [[1]] * 65}, "65 prompts exceed this server's max_batch_size (64)"),
])  # fmt: skip
def test_bad_completion_bodies_are_bad_requests(client, kwargs, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{"model": "tiny", "prompt": [1, 2], "max_tokens": 2, **kwargs})
    assert message in e.value.message and "\n" not in e.value.message


def test_malformed_json_is_a_400_in_openai_shape(urls):
    for raw in (b"not json", b"[1, 2]", b'{"model": "m", "messages": [{"role": "user", "content": 5}]}'):
        status, answer = call(urls["chat"] + "/v1/chat/completions", raw)
        assert status == 400, answer
        error = answer["error"]
        assert error["type"] == "invalid_request_error" and "\n" not in error["message"]
    # more token ids than 64 prompts of 2048 tokens: refused before parsing, as on /generate
    status, answer = call(urls["chat"] + "/v1/completions", b'{"model": "m", "prompt": [' + b"1," * 200_000 + b"1]}")
    assert status == 400 and "more values than 64 prompts of at most 2048 tokens can hold" in answer["error"]["message"]


def test_a_tokenizer_without_chat_template_is_a_400_and_completions_still_work(urls):
    plain = openai.OpenAI(base_url=urls["plain"] + "/v1", api_key=TOKEN, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        plain.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert e.value.message.endswith("/v1/chat/completions: the model's tokenizer has no chat template: send the "
                                    "prompt to /v1/completions instead")
    assert len(plain.completions.create(model="tiny", prompt="Question:", max_tokens=3).choices[0].token_ids) > 0
