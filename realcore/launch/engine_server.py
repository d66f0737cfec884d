"""An SGLang or vLLM server as one task of a cluster run (`run_worker --type gen_server` when the
allocation is `sglang.*` or `vllm.*` under scheduler=slurm or ray).

The local launcher starts these servers itself (launcher.start_engine_servers); on a cluster the
server must start on the node (and the GPUs) its job step or placement-group bundle was given, so
the task that Slurm or Ray starts there runs this function, which:
- checks that the node's interpreter (rollout.server_python) has the engine: one line in the log
  and exit 1 otherwise (the login node need not have it);
- starts the engine on a free port of this node, on the GPUs its task was given (CUDA_VISIBLE_DEVICES,
  set by Slurm or Ray; the CPU route where it sees none), with its memory share and dtype
  (rollout.server_mem_fraction, else SERVER_MEM_FRACTION: Slurm and Ray give it GPUs of its own;
  generation.dtype), with the run's bearer token (off the command line:
  SGLang's key file goes to OUTPUT_DIR/.engine/gen_server-I, mode 0600), in its own session, dying
  with this process (PDEATHSIG), its output in this task's log (the token filtered out);
- waits until it listens on its port and answers (system.startup_timeout_s), then publishes its address where the gserver
  manager looks for every server ({"http": URL, "weights": None}: no in-memory weight socket);
- stays with it: SIGTERM (or the task runner's kill) stops the engine's whole process group; the
  engine ending unasked ends this task with an error (exit 1 for an engine that exited 0), so the
  task runner restarts both in place, and the manager catches the restarted server up.
Health is watched by the gserver manager (its /health probes), as for every server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import threading
import time

from realcore.api.alloc import parse_allocation_mode
from realcore.api.config import ExperimentConfig
from realcore.backends.clients.registry import engine_available, server_command
from realcore.backends.server_launch import SERVER_MEM_FRACTION, copy_redacted, wait_http_ready, wait_own_listener
from realcore.transport import addresses
from realcore.transport.name_resolve import make_name_resolver
from realcore.launch.process import die_with_parent

log = logging.getLogger("realcore.engine_server")
_POLL_S = 0.5


def private_dir(cfg: ExperimentConfig, index: int) -> str:
    """This server's own folder for its key file (mode 0700; a restart reuses it)."""
    path = os.path.join(os.path.abspath(cfg.output_dir), ".engine", f"gen_server-{index}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the engine's process group (its schedulers and detokenizer too), SIGKILL after grace."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def serve_engine(cfg: ExperimentConfig, index: int) -> int:
    """Run server `index` of the run's engine until stopped; the exit code of the task."""
    alloc = parse_allocation_mode(cfg.allocation_mode)
    engine = alloc.backend
    missing = engine_available(engine, cfg.rollout.server_python)
    if missing:
        log.error("cannot start the %s server on this node: %s", engine, missing)
        return 1
    host = cfg.system.host
    port = free_port(host)  # a restart gets a new port: the manager finds it by the published address
    argv, extra_env = server_command(
        engine, model_path=cfg.model.path, host=host, port=port, tp=alloc.gen.tp, pp=alloc.gen.pp,
        seed=cfg.seed + 1000 * index, max_batch_size=cfg.generation.max_batch_size,
        api_key=cfg.rollout.server_token, private_dir=private_dir(cfg, index), python=cfg.rollout.server_python,
        lora=cfg.actor.lora, mem_fraction=cfg.rollout.server_mem_fraction or SERVER_MEM_FRACTION,
        dtype=cfg.generation.dtype)
    url = f"http://{host}:{port}"
    log.info("starting %s server %d at %s (tp %d, pp %d, CUDA_VISIBLE_DEVICES=%s)", engine, index, url, alloc.gen.tp,
             alloc.gen.pp, os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
    # Its output reaches this task's log through a filter: SGLang logs its api_key (docs/security.md).
    proc = subprocess.Popen(argv, env={**os.environ, **extra_env}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)
    threading.Thread(target=copy_redacted, args=(proc.stdout, os.fdopen(os.dup(1), "ab"), (cfg.rollout.server_token,)),
                     name="engine log", daemon=True).start()
    try:
        started = time.monotonic()
        try:  # the token goes with every probe: only to a listener of ours
            wait_own_listener(proc, port, timeout_s=cfg.system.startup_timeout_s)
            asyncio.run(wait_http_ready(url, timeout_s=max(0.1, cfg.system.startup_timeout_s - (time.monotonic() - started)),
                                        proc=proc, token=cfg.rollout.server_token))
        except (RuntimeError, TimeoutError) as e:
            log.error("%s server %d did not start: %s", engine, index, e)
            return 1
        log.info("%s server %d ready at %s after %.1f s", engine, index, url, time.monotonic() - started)
        addresses.publish_gen_server(make_name_resolver(cfg.system.name_resolve), cfg, index, addresses.GenServerAddress(url))
        while (rc := proc.poll()) is None:
            time.sleep(_POLL_S)
        log.error("%s server %d exited on its own (exit code %d)", engine, index, rc)
        return rc if rc > 0 else 1  # an engine that ends unasked is a failure, whatever its code
    finally:
        _stop(proc, cfg.system.shutdown_timeout_s)
