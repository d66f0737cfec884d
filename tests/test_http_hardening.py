"""The built-in server against slow clients and bad weight files (docs/security.md, the built-in
server's limits): a connection that trickles its headers is closed at the header deadline, a body
that trickles answers 408 at the body deadline, a declared oversize body 413 before it is sent, a
garbage, truncated or wrongly shaped safetensors file (full weights or a LoRA adapter) a 400 naming
the file while the old weights still serve, and a weight-update group to a dead port a 400 at the
connect deadline. One real server process, raw sockets."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import aiohttp
import pytest
import torch
from safetensors.torch import load_file, save_file

from realcore.api.config import LoraConfig, ModelConfig, SystemConfig
from realcore.backends import lora
from realcore.backends.generation import read_hf_weights
from realcore.backends.models import prepare_model

pytestmark = pytest.mark.timeout(120)  # the module fixture (a model, a server) counts in the first test
TOKEN = "hardening-token"
MAX_BODY = 2**17
HEADER_S, BODY_S, CONNECT_S = 1.0, 1.0, 2.0
SLACK_S = 1.5  # a loaded 2-core CI machine's lateness in answering a timer
PROMPT = [5, 17, 42, 9, 100]
PARAMS = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 8}
SERVER = """
import json, sys
from realcore.backends.genserver.http import run_server
run_server(sys.argv[1], seed=3, max_batch_size=4, token=sys.argv[2], max_body_bytes=int(sys.argv[3]),
           header_timeout_s=float(sys.argv[4]), body_timeout_s=float(sys.argv[5]), connect_timeout_s=float(sys.argv[6]),
           on_ready=lambda a: print(json.dumps(a), flush=True), device="cpu")
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return prepare_model(ModelConfig(name="tiny", cache_dir=str(tmp_path_factory.mktemp("cache"))), seed=0)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w+")
    argv = [sys.executable, "-c", SERVER, model, TOKEN, str(MAX_BODY), str(HEADER_S), str(BODY_S), str(CONNECT_S)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            text=True)
    line = proc.stdout.readline()  # on_ready's JSON, or "" if the server died
    if not line:
        log.seek(0)
        pytest.fail(f"server did not start:\n{log.read()[-3000:]}")
    url = json.loads(line)["http"]
    yield {"url": url, "port": int(url.rsplit(":", 1)[1])}
    proc.terminate()
    assert proc.wait(timeout=30) == 0


def call(method: str, url: str, body=None, token: str | None = TOKEN) -> tuple[int, dict]:
    async def go():
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as s:
            async with s.request(method, url, json=body) as r:
                return r.status, await r.json(content_type=None)

    return asyncio.run(go())


def generate(server) -> list[int]:
    status, out = call("POST", server["url"] + "/generate", {"input_ids": PROMPT, "sampling_params": PARAMS})
    assert status == 200, out
    return out["output_ids"]


def slow_drops(server) -> int:
    return call("GET", server["url"] + "/get_server_info")[1]["drops"].get("http/slow", 0)


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server["port"]), timeout=10)
    sock.settimeout(10)
    return sock


def closed_after(sock: socket.socket, trickle: bytes = b"", every_s: float = 0.2) -> tuple[float, bytes]:
    """Send `trickle` one byte every `every_s`, reading meanwhile; (seconds until the server
    closed the connection, what it sent). Fails the test at 10 s."""
    t0, got, i = time.monotonic(), b"", 0
    sock.settimeout(every_s)
    while time.monotonic() - t0 < 10:
        if i < len(trickle):
            try:
                sock.sendall(trickle[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - t0, got
            i += 1
        try:
            data = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return time.monotonic() - t0, got
        if not data:
            return time.monotonic() - t0, got
        got += data
    pytest.fail(f"the server kept the connection open 10 s (got {got[:200]!r})")


def test_the_keys_are_in_the_config():
    fields = SystemConfig.model_fields
    assert {"http_header_timeout_s", "http_body_timeout_s", "weight_group_connect_timeout_s"} <= set(fields)


def test_trickled_headers_are_closed_at_the_deadline_and_a_long_request_is_not(server):
    before = slow_drops(server)
    # Headers one byte every 0.2 s, forever: closed at the deadline, with nothing answered.
    sock = connect(server)
    took, got = closed_after(sock, b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200)
    assert HEADER_S * 0.5 <= took <= HEADER_S + SLACK_S and got == b"", (took, got)
    # A connection that sends nothing; and a keep-alive connection after an answered (401) request.
    took, got = closed_after(connect(server))
    assert took <= HEADER_S + SLACK_S and got == b"", took
    sock = connect(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    took, got = closed_after(sock, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200)
    assert took <= HEADER_S + SLACK_S and got.startswith(b"HTTP/1.1 401"), (took, got[:100])
    assert slow_drops(server) >= before + 2  # the two half-sent requests (the idle connection is not counted)
    # A request longer than the header deadline is not cut: /generate waits while generation is paused.
    status, _ = call("POST", server["url"] + "/pause_generation", {"mode": "in_place"})
    assert status == 200

    async def paused_generate():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as s:
            job = asyncio.ensure_future(s.post(server["url"] + "/generate",
                                               json={"input_ids": PROMPT, "sampling_params": PARAMS}))
            await asyncio.sleep(HEADER_S * 2.5)
            async with s.post(server["url"] + "/continue_generation", json={}) as r:
                assert r.status == 200
            async with await job as r:
                return r.status, await r.json()

    status, out = asyncio.run(paused_generate())
    assert status == 200 and len(out["output_ids"]) == PARAMS["max_new_tokens"], out


def test_bodies_oversize_413_before_sent_and_trickled_408(server):
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
    # Declared over the limit: 413 with no byte of the body sent.
    sock = connect(server)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n" + auth + f"Content-Length: {MAX_BODY + 1}\r\n\r\n".encode())
    answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413") and b"max_http_body_bytes" in answer, answer[:300]
    sock.close()
    # An authenticated body that trickles: 408 at the body deadline, then the connection closes.
    sock = connect(server)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 1000\r\n\r\n")
    took, got = closed_after(sock, b'{"input_ids": [' + b"1, " * 300)
    assert got.startswith(b"HTTP/1.1 408") and b"http_body_timeout_s" in got, got[:300]
    assert BODY_S * 0.5 <= took <= 2 * BODY_S + SLACK_S, took  # + aiohttp's lingering (at most BODY_S here)
    # Without the token the body is never read: 401 at once, and the connection ends within the deadlines.
    sock = connect(server)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
    took, got = closed_after(sock, b"1" * 300)
    assert got.startswith(b"HTTP/1.1 401") and took <= BODY_S + HEADER_S + SLACK_S, (took, got[:100])
    assert generate(server)  # the server goes on


def _write(path, tensors: dict[str, torch.Tensor]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)


def test_bad_weight_files_are_400s_naming_the_file_and_the_old_weights_serve(server, model, tmp_path):
    before = generate(server)
    state = read_hf_weights(model)
    other = {k: torch.randn_like(v) * 0.2 for k, v in state.items()}  # changes the output if it were loaded
    first = sorted(state)[0]

    def folder(name: str) -> str:
        path = tmp_path / name
        shutil.copytree(model, path, ignore=shutil.ignore_patterns("*.safetensors"))
        return str(path)

    garbage, truncated, shaped, missing, good = (folder(n) for n in ("garbage", "truncated", "shaped", "missing", "good"))
    with open(os.path.join(garbage, "model.safetensors"), "wb") as f:
        f.write(os.urandom(4096))
    _write(os.path.join(truncated, "model.safetensors"), other)
    with open(os.path.join(truncated, "model.safetensors"), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    _write(os.path.join(shaped, "model.safetensors"), {**other, first: torch.zeros(3, 5)})
    _write(os.path.join(missing, "model.safetensors"), {k: v for k, v in other.items() if k != first})
    _write(os.path.join(good, "model.safetensors"), other)
    for path, words in ((garbage, "not a safetensors file"), (truncated, "truncated"), (shaped, "wrongly shaped"),
                        (missing, "missing")):
        status, out = call("POST", server["url"] + "/update_weights_from_disk", {"model_path": path})
        assert status == 400 and out["success"] is False and words in out["message"], (path, out)
        assert path in out["message"] and "\n" not in out["message"], out
        assert generate(server) == before  # nothing was loaded
    # The check passes real files: a good one loads (and changes the output), the original restores it.
    status, out = call("POST", server["url"] + "/update_weights_from_disk", {"model_path": good})
    assert status == 200, out
    assert generate(server) != before
    status, out = call("POST", server["url"] + "/update_weights_from_disk", {"model_path": model})
    assert status == 200 and generate(server) == before, out


def test_bad_lora_adapters_are_400s_naming_the_file(server, model, tmp_path):
    before = generate(server)
    good = lora.write_zero_adapter(model, LoraConfig(rank=4), str(tmp_path / "good"))
    weights = os.path.join(good, lora.ADAPTER_WEIGHTS)
    tensors = load_file(weights)
    a_key = sorted(k for k in tensors if k.endswith("lora_A.weight"))[0]

    def variant(name: str, change) -> str:
        path = str(tmp_path / name)
        shutil.copytree(good, path)
        change(os.path.join(path, lora.ADAPTER_WEIGHTS))
        return path

    def garbage(f):
        with open(f, "wb") as out:
            out.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}" + os.urandom(100))

    def truncate(f):
        with open(f, "r+b") as out:
            out.truncate(os.path.getsize(f) - 64)

    def reshape(f):
        save_file({**tensors, a_key: torch.zeros(4, 7)}, f)

    for path, words in ((variant("garbage", garbage), "not a safetensors file"),
                        (variant("truncated", truncate), "truncated"), (variant("shaped", reshape), "do not make")):
        status, out = call("POST", server["url"] + "/load_lora_adapter", {"lora_name": "bad", "lora_path": path})
        message = out.get("error_message", "")
        assert status == 400 and lora.ADAPTER_WEIGHTS in message and path in message and words in message, out
        assert generate(server) == before
    status, out = call("POST", server["url"] + "/load_lora_adapter", {"lora_name": "zero", "lora_path": good})
    assert status == 200, out
    assert generate(server) == before  # a zero adapter changes nothing
    assert call("POST", server["url"] + "/unload_lora_adapter", {"lora_name": "zero"})[0] == 200


def test_a_weight_group_to_a_dead_port_answers_at_the_connect_deadline(server):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    status, out = call("POST", server["url"] + "/init_weights_update_group",
                       {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                        "group_name": "dead", "backend": "gloo"})
    took = time.monotonic() - t0
    assert status == 400 and "weight_group_connect_timeout_s" in out["message"] and str(port) in out["message"], out
    assert CONNECT_S - 0.2 <= took <= CONNECT_S + SLACK_S, took
    assert "dead" not in call("GET", server["url"] + "/get_server_info")[1]["weight_update_groups"]
