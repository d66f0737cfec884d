"""`python -m realcore.serve`: the built-in engine stand-alone, with SGLang's flag names.

The real-process tests start it with the very command line realcore's launcher gives SGLang
(server_command("sglang", ...) with `python -m realcore.serve` in place of `python -m
sglang.launch_server`): the key reaches it through SGLang's --config file, SGLang's CPU flags
are accepted, and SIGTERM stops it cleanly.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys

import psutil
import pytest
import torch

from realcore.api.config import ModelConfig
from realcore.backends.clients.sglang_api import GenClient
from realcore.backends.models import prepare_model
from realcore.backends.clients.registry import server_command
from realcore.backends.server_launch import wait_http_ready
from realcore.serve import API_KEY_ENV, api_key, config_argv, parse_args

pytestmark = pytest.mark.timeout(120)
TOKEN = "serve-test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return prepare_model(ModelConfig(name="tiny", cache_dir=str(tmp_path_factory.mktemp("models"))), seed=0)


def serve(argv: list[str], log_path, env: dict | None = None) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "realcore.serve", *argv], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM, then the exit code; fails if the server or anything it started is still alive."""
    family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError("realcore.serve did not stop within 30 s of SIGTERM") from None
    assert not [pid for pid in family if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    return rc


def with_keyless_client(server: subprocess.Popen, port: int, check) -> None:
    """Once `server` (started without a key) answers, run `await check(client)`; then stop it (exit 0)."""
    url = f"http://127.0.0.1:{port}"

    async def main():
        await wait_http_ready(url, timeout_s=90, proc=server)
        client = GenClient(url, token=None, timeout_s=60)
        try:
            await check(client)
        finally:
            await client.close()

    try:
        asyncio.run(main())
    finally:
        assert stop(server) == 0


def test_realcore_launch_line_for_sglang_serves_the_built_in_engine(tiny, tmp_path):
    port = free_port()
    argv, env = server_command("sglang", model_path=tiny, host="127.0.0.1", port=port, tp=1, seed=1, max_batch_size=8,
                               cuda=False, api_key=TOKEN, private_dir=str(tmp_path))
    assert argv[1:3] == ["-m", "sglang.launch_server"] and "--config" in argv and TOKEN not in argv
    proc = serve(argv[3:], tmp_path / "serve.log", env)  # the same flags, our module
    url = f"http://127.0.0.1:{port}"

    async def main():
        await wait_http_ready(url, timeout_s=90, proc=proc, token=TOKEN)
        client = GenClient(url, token=TOKEN, timeout_s=60)
        intruder = GenClient(url, token=None, timeout_s=10)
        try:
            reply = await client.generate([5, 17, 42], {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
                                          rid="r1")
            assert reply.finish_reason == "length" and len(reply.output_ids) == 6 == len(reply.output_logprobs)
            assert all(lp <= 0.0 for lp in reply.output_logprobs) and reply.weight_version == "0"
            with pytest.raises(RuntimeError, match="HTTP 401"):
                await intruder.generate([5], {"max_new_tokens": 1}, rid="r2")
        finally:
            await client.close()
            await intruder.close()

    try:
        asyncio.run(main())
    finally:
        rc = stop(proc)
    log = (tmp_path / "serve.log").read_text()
    assert rc == 0, log[-3000:]
    for flag in ("skip-server-warmup", "attention-backend", "max-total-tokens"):  # SGLang's CPU flags: said, not silent
        assert f"--{flag} is an SGLang flag with no meaning for the built-in engine: ignored" in log
    assert "no API key" not in log and "visible to every user" not in log  # the key came from --config
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # the port is free again


def test_no_key_is_allowed_on_loopback_only_and_said(tiny, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "realcore.serve", "--model-path", tiny, "--host", "0.0.0.0"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, API_KEY_ENV: ""}, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "realcore.serve: --host 0.0.0.0 is not a loopback address: an API key is required "
        f"(--config FILE with `api-key: ...`, ${API_KEY_ENV}, or --api-key)")

    port = free_port()
    server = serve(["--model-path", tiny, "--port", str(port)], tmp_path / "open.log", {API_KEY_ENV: ""})

    async def check(client):
        reply = await client.generate([1, 2], {"max_new_tokens": 2}, rid="open")
        assert len(reply.output_ids) == 2
        info = await client.server_info()
        # no --device, no --dtype (auto): the process's GPU in bf16 where it has one, else the CPU in float32
        expected = ("cuda", "bfloat16") if torch.cuda.is_available() else ("cpu", "float32")
        assert (info["device"], info["dtype"]) == expected

    with_keyless_client(server, port, check)
    text = (tmp_path / "open.log").read_text()
    assert "no API key: every endpoint (weight loading included) answers any user of this machine" in text
    assert text.count("gen_server: the engine runs on ") == 1  # the device and dtype, once


def test_dtype_bfloat16_serves_the_bf16_engine(tiny, tmp_path):
    """--dtype bfloat16 is not an ignored SGLang flag: the engine serves in its bf16 mode (on a CPU
    without bf16 instructions the server refuses in one line instead)."""
    from realcore.backends.precision import compute_dtype

    port = free_port()
    server = serve(["--model-path", tiny, "--port", str(port), "--dtype", "bfloat16"], tmp_path / "bf16.log",
                   {API_KEY_ENV: ""})
    try:
        compute_dtype("bfloat16", torch.device("cpu"))
    except ValueError as e:  # this CPU has no bf16: the server says so and exits
        assert server.wait(timeout=90) == 1
        assert f"realcore.serve: ValueError: {e}" in (tmp_path / "bf16.log").read_text()
        return

    async def check(client):
        assert (await client.server_info())["dtype"] == "bfloat16"
        reply = await client.generate([5, 17, 42], {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
                                      rid="bf16")
        assert len(reply.output_ids) == 4 and all(lp <= 0.0 for lp in reply.output_logprobs)

    with_keyless_client(server, port, check)
    assert "--dtype is an SGLang flag" not in (tmp_path / "bf16.log").read_text()


def test_flags_config_file_and_key_sources(tmp_path, monkeypatch):
    cfg = tmp_path / "sglang.yaml"
    cfg.write_text('api-key: "from-file"\nport: 31000\nrandom_seed: 5\nskip-server-warmup: true\n'
                   "trust-remote-code: false\n")
    assert config_argv(str(cfg)) == ["--api-key", "from-file", "--port", "31000", "--random-seed", "5",
                                     "--skip-server-warmup"]
    args = parse_args(["--model-path", "m", "--config", str(cfg), "--port", "32000"])
    assert (args.port, args.random_seed, args.api_key, args.skip_server_warmup) == (32000, 5, "from-file", True)

    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert api_key(parse_args(["--model-path", "m"])) == "from-env"
    assert api_key(parse_args(["--model-path", "m", "--config", str(cfg)])) == "from-file"  # the file wins
    monkeypatch.delenv(API_KEY_ENV)
    assert api_key(parse_args(["--model-path", "m"])) is None
    args = parse_args(["--model", "m", "--tensor-parallel-size", "1", "--device", "cpu", "--max-running-requests", "3"])
    assert (args.model_path, args.tp_size, args.max_running_requests, args.dtype, args.device) == \
        ("m", 1, 3, "auto", "cpu")
    assert [parse_args(["--model", "m", "--dtype", d]).dtype for d in ("auto", "float", "float32", "bfloat16")] == \
        ["auto", "float32", "float32", "bfloat16"]  # auto: bfloat16 on a GPU, float32 on a CPU (run_server)
    assert parse_args(["--model", "m"]).device == "auto"


@pytest.mark.parametrize("argv, message", [
    (["--model-path", "m", "--tp-size", "2"], "--tp-size 2 --dp-size 1: the built-in engine serves one model copy"),
    (["--model-path", "m", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--model-path", "m", "--speculative-algorithm", "EAGLE"], "unrecognized arguments: --speculative-algorithm EAGLE"),
    (["--model-path", "m", "--max-running-requests", "0"], "--max-running-requests must be >= 1"),
    (["--model-path", "m", "--dtype", "half"], "--dtype half: the built-in engine serves float32 or bfloat16"),
    (["--port", "1"], "the following arguments are required: --model-path/--model"),
])  # fmt: skip
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("python -m realcore.serve: error: ")


def test_bad_config_file_is_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    for path, message in ((bad, "expected a mapping of flag names to values, got list"),
                          (tmp_path / "missing.yaml", "FileNotFoundError")):
        with pytest.raises(SystemExit):
            parse_args(["--model-path", "m", "--config", str(path)])
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--config {path}: " in err and message in err
