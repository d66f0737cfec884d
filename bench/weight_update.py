"""Weight-update benchmark: seconds to move a new version of the policy to generation servers by
disk, by memory (the authenticated wire) and by a gloo broadcast (rollout.weight_update=nccl's
protocol on CPU), and the interrupt-to-resume time of each.

    python bench/weight_update.py [--model tiny|smollm2-135m] [--servers N] [--repeats R] [--quick]

Built-in servers (`realcore.backends.genserver`, one thread each) serve the model; this process is
the trainer (its fp32 state dict, as the torch engine holds it). Per method:
- "update s": the trainer's whole update of idle servers. disk: write the HF safetensors, then the
  servers load them; memory: push to every server's update socket; broadcast: the bucketed
  broadcast (rollout.weight_bucket_mb, default 512) through /update_weights_from_distributed, its
  group already built (the first update's group build is the "group join s" column).
- "interrupt-to-resume s": what generation waits: /pause_generation (abort) while the servers
  generate (4 requests each), the update (disk: the load only, the file is written before the
  pause), /continue_generation: how SGLang, vLLM and `nccl` updates go in an async run. The "no
  pause" rows are how an async run updates built-in servers (`abort_all_requests`): the servers
  read or receive the weights while generating, then abort and swap in one engine step; their
  interrupt is that step's duration (the server's `last_weight_update_s`), their "update s" the
  whole update while the servers generate. The "in flight" rows are the same without the abort
  (rollout.inflight_weight_update): the running requests go on under the new weights with their
  KV cache, so their interrupt is the swap alone and nothing is prefilled again (checked: no
  request comes back aborted, and some reply holds tokens of both versions). "broadcast, in flight":
  the servers are paused in `hold` mode instead (decoding stops, the requests keep their KV cache)
  for the broadcast, as an in-flight `nccl` update goes.
- "in flight at pause": output tokens the pause's abort returned with the partial replies. None is
  lost: an async run's rollout workers resubmit prompt + partial output after the update
  (`generate_resumable`, as AReaL's interruptible generation), so what interruption costs is the
  "re-prefill" column: the tokens (prompt + partial) the servers prefill again to resume them.
Medians of `--repeats` (3) updates, each a new version; every method ends with the servers holding
the version it sent (checked). `--quick`: tiny model, 1 repeat (the smoke test's seconds-long run).
"""

import argparse
import asyncio
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

import torch  # noqa: E402

from realcore.api.config import ModelConfig, RolloutConfig  # noqa: E402
from realcore.backends.clients.sglang_api import GenClient, push_weights  # noqa: E402
from realcore.backends.models import load_model, prepare_model  # noqa: E402
from realcore.weights.broadcast import WeightSender  # noqa: E402

TOKEN = "bench-token"
SECRET = os.urandom(32)
TIMEOUT_S = 600.0
LOAD_REQUESTS = 4  # generating on each server while it is interrupted
SERVER = """
import json, os, sys
from realcore.backends.genserver.http import run_server
run_server(sys.argv[1], seed=0, max_batch_size=8, token=sys.argv[2], secret=bytes.fromhex(os.environ["SECRET_HEX"]),
           on_ready=lambda a: print(json.dumps(a), flush=True))
"""


def start_servers(path: str, n: int, log_dir: str) -> list[tuple[subprocess.Popen, dict]]:
    out = []
    for i in range(n):
        log = open(os.path.join(log_dir, f"server-{i}.log"), "w")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SECRET_HEX": SECRET.hex()}
        proc = subprocess.Popen([sys.executable, "-c", SERVER, path, TOKEN], stdout=subprocess.PIPE, stderr=log, env=env,
                                text=True)
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"server {i} did not start; see {log.name}")
        out.append((proc, json.loads(line)))
    return out


async def on_all(urls: list[str], fn):
    clients = [GenClient(u, token=TOKEN, timeout_s=TIMEOUT_S) for u in urls]
    try:
        return await asyncio.gather(*(fn(c) for c in clients))
    finally:
        await asyncio.gather(*(c.close() for c in clients))


class Load:
    """Keeps LOAD_REQUESTS long greedy requests running on every server (a thread with its own loop)."""

    PROMPT = [1, 2, 3, 4]

    def __init__(self, urls: list[str]):
        self.urls, self.stop = urls, threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.aborted: list[tuple[float, int]] = []  # (when it came back, output tokens) of aborted replies
        self.spanning: list[float] = []  # when each reply whose tokens came from two or more versions came back

    async def _run(self):
        async def keep(client, k):
            while not self.stop.is_set():
                params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 512}
                try:
                    reply = await client.generate(self.PROMPT, params, rid=f"load-{k}-{time.monotonic_ns()}")
                except Exception:
                    await asyncio.sleep(0.05)
                    continue
                if reply.finish_reason == "abort":
                    self.aborted.append((time.perf_counter(), len(reply.output_ids)))
                if len(set(reply.token_versions())) > 1:
                    self.spanning.append(time.perf_counter())

        await on_all(self.urls, lambda c: asyncio.gather(*(keep(c, k) for k in range(LOAD_REQUESTS))))

    def __enter__(self):
        self.thread.start()
        time.sleep(1.0)  # requests running
        return self

    def __exit__(self, *exc):
        self.stop.set()
        asyncio.run(on_all(self.urls, lambda c: c.abort()))
        self.thread.join(timeout=60)


def interrupted(urls: list[str], update, mode: str = "abort") -> tuple[float, int, int]:
    """(seconds from pause (abort) to continue around `update()`, output tokens in flight at the
    pause, tokens to prefill again to resume those requests), with the servers generating.
    `mode` hold: the in-flight pause (checked: nothing aborted, requests went on across it)."""
    with Load(urls) as load:
        t0 = time.perf_counter()
        asyncio.run(on_all(urls, lambda c: c.pause(mode)))
        update()
        asyncio.run(on_all(urls, lambda c: c.resume()))
        t1 = time.perf_counter()
        if mode == "abort":  # a fast update resumes before the aborted replies are back: wait for them
            deadline = time.monotonic() + 10.0
            while sum(t >= t0 for t, _ in load.aborted) < LOAD_REQUESTS * len(urls) and time.monotonic() < deadline:
                time.sleep(0.01)
        partial = [n for t, n in load.aborted if t >= t0]
    if mode == "hold" and (partial or not any(t >= t0 for t in load.spanning)):
        raise RuntimeError("held update: a request was aborted, or none went on under the new version")
    return t1 - t0, sum(partial), sum(len(Load.PROMPT) + n for n in partial)


def interrupted_no_pause(urls: list[str], update, inflight: bool = False) -> tuple[float, float, int, int]:
    """(seconds of the whole `update()`, the longest engine-thread stall of a server (abort + swap,
    from its server info), output tokens the abort returned, tokens to prefill again), with the
    servers generating: the async path of built-in servers (abort_all_requests, no pause).
    `inflight`: the update aborts nothing (rollout.inflight_weight_update); checked: no request
    came back aborted, and the running ones went on under the new version."""
    with Load(urls) as load:
        t0 = time.perf_counter()
        update()
        t1 = time.perf_counter()
        # The aborted replies reach the load's thread just after the update returns: wait for them
        # (the load's own aborts at the end of this block come later and are not counted).
        while not inflight and not any(t >= t0 for t, _ in load.aborted) and time.perf_counter() < t1 + 5.0:
            time.sleep(0.01)
        time.sleep(0.1)  # the other requests' and servers' replies
        t2 = time.perf_counter()
    # In flight, the load's replies finish later (up to 512 tokens): the ones running at the update
    # came back at the end of this block, with the tokens of both versions.
    if inflight and (any(t >= t0 for t, _ in load.aborted if t <= t2) or not any(t >= t0 for t in load.spanning)):
        raise RuntimeError("in-flight update: a request was aborted, or none went on under the new version")
    stall = max(i["last_weight_update_s"] for i in asyncio.run(on_all(urls, lambda c: c.server_info())))
    partial = [n for t, n in load.aborted if t0 <= t <= t2]
    return t1 - t0, stall, sum(partial), sum(len(Load.PROMPT) + n for n in partial)


def versions(urls: list[str]) -> list[str]:
    return [i["weight_version"] for i in asyncio.run(on_all(urls, lambda c: c.server_info()))]


def _row(method: str, upd: list[float], intr: list[tuple[float, int, int]], note: str = "") -> tuple:
    """(method, median update s, median interrupt-to-resume s, median in-flight tokens, median re-prefill tokens, note)"""
    return (method, statistics.median(upd), *(statistics.median(x[i] for x in intr) for i in range(3)), note)


def bench(path: str, n_servers: int, repeats: int, bucket_mb: float) -> tuple[list[tuple], int]:
    model = load_model(path)
    state = model.state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in state.values()}.values())
    work = tempfile.mkdtemp(prefix="bench-weights-")
    servers = start_servers(path, n_servers, work)
    urls = [a["http"] for _, a in servers]
    version = 0
    rows = []
    try:
        asyncio.run(on_all(urls, lambda c: c.wait_ready(60)))

        # disk: the trainer writes an HF folder (safetensors), the servers load it
        def write(v):
            out = os.path.join(work, f"v{v}")
            model.save_pretrained(out, safe_serialization=True)
            return out

        def disk_load(out, v, abort_all=False):
            asyncio.run(on_all(urls, lambda c: c.update_weights_from_disk(out, v, abort_all_requests=abort_all)))

        def no_pause_row(method: str, prepare, note: str, inflight: bool = False) -> None:
            """`prepare(v)()` `repeats` times while the servers generate (`prepare` runs before)."""
            nonlocal version
            runs = []
            for _ in range(repeats):
                version += 1
                runs.append(interrupted_no_pause(urls, prepare(version), inflight))
            assert versions(urls) == [str(version)] * n_servers
            how, what = (("in flight (rollout.inflight_weight_update)", "swap, running requests go on with their KV cache")
                         if inflight else ("no pause (abort_all_requests: async runs)", "abort + swap"))
            rows.append(_row(f"{method}, {how}", [r[0] for r in runs], [r[1:] for r in runs],
                             f"update s: {note} while generating; interrupt: the engine's {what}"))

        upd, intr = [], []
        for _ in range(repeats):
            version += 1
            t0 = time.perf_counter()
            disk_load(write(version), version)
            upd.append(time.perf_counter() - t0)
            version += 1
            out = write(version)
            intr.append(interrupted(urls, lambda: disk_load(out, version)))
        assert versions(urls) == [str(version)] * n_servers
        rows.append(_row("disk (safetensors)", upd, intr))

        no_pause_row("disk", lambda v: functools.partial(disk_load, write(v), v, True), "the load")
        no_pause_row("disk", lambda v: functools.partial(disk_load, write(v), v), "the load", inflight=True)

        # memory: pushed over the authenticated wire to every server's update socket
        def push(v, abort_all=False):
            for _, a in servers:
                push_weights(a["weights"], SECRET, str(v), state, TIMEOUT_S, abort_all_requests=abort_all)

        upd, intr = [], []
        for _ in range(repeats):
            version += 1
            t0 = time.perf_counter()
            push(version)
            upd.append(time.perf_counter() - t0)
            version += 1
            intr.append(interrupted(urls, lambda: push(version)))
        assert versions(urls) == [str(version)] * n_servers
        rows.append(_row("memory (MAC'd wire)", upd, intr))

        no_pause_row("memory", lambda v: functools.partial(push, v, True), "the pushes")
        no_pause_row("memory", lambda v: functools.partial(push, v), "the pushes", inflight=True)

        # broadcast: rollout.weight_update=nccl's protocol over gloo
        cfg = SimpleNamespace(
            system=SimpleNamespace(host="127.0.0.1", startup_timeout_s=TIMEOUT_S, request_timeout_s=TIMEOUT_S),
            rollout=SimpleNamespace(server_token=TOKEN, request_timeout_s=TIMEOUT_S, weight_bucket_mb=bucket_mb))
        sender = WeightSender(cfg, engine="local", tp=1)
        version += 1
        assert sender.send(state, version, urls) == []
        join_s = sender.stats["join_s"]

        def broadcast(v):
            if sender.send(state, v, urls):
                raise RuntimeError("broadcast failed (see the log)")

        upd, intr = [], []
        for _ in range(repeats):
            version += 1
            t0 = time.perf_counter()
            broadcast(version)
            upd.append(time.perf_counter() - t0)
            version += 1
            intr.append(interrupted(urls, lambda: broadcast(version)))
        assert versions(urls) == [str(version)] * n_servers and sender.n_groups == 1
        rows.append(_row(f"broadcast (gloo, {bucket_mb:g} MiB buckets)", upd, intr,
                         f"group join {join_s:.2f} s (first update only)"))
        held = []
        for _ in range(repeats):
            version += 1
            held.append(interrupted(urls, lambda: broadcast(version), mode="hold"))
        assert versions(urls) == [str(version)] * n_servers
        rows.append(_row("broadcast, in flight (hold)", [float("nan")] * repeats, held,
                         "interrupt: pause hold + broadcast + continue; the requests wait with their KV cache"))
    finally:
        for proc, _ in servers:
            proc.terminate()
        for proc, _ in servers:
            proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    return rows, nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, choices=["tiny", "smollm2-135m"], help="default smollm2-135m, tiny with --quick")
    p.add_argument("--servers", type=int, default=1, help="generation servers (each a process with one thread)")
    p.add_argument("--repeats", type=int, default=None, help="updates per method (default 3, 1 with --quick)")
    p.add_argument("--bucket-mb", type=float, default=RolloutConfig.model_fields["weight_bucket_mb"].default)
    p.add_argument("--quick", action="store_true", help="tiny model, 1 repeat: a smoke test")
    args = p.parse_args()
    torch.set_num_threads(1)
    name = args.model or ("tiny" if args.quick else "smollm2-135m")
    repeats = args.repeats or (1 if args.quick else 3)
    path = prepare_model(ModelConfig(name=name), seed=0)
    rows, nbytes = bench(path, args.servers, repeats, args.bucket_mb)
    print(f"\nweight update of {name} ({nbytes / 2**20:.1f} MiB fp32) to {args.servers} built-in server(s), "
          f"median of {repeats}\n")
    print("| method | update s | interrupt-to-resume s | in flight at pause (tokens, kept) | re-prefill to resume "
          "(tokens) | note |")
    print("|---|---|---|---|---|---|")
    for method, upd, intr, partial, prefill, note in rows:
        upd = "-" if upd != upd else f"{upd:.2f}"  # NaN: the row times the interrupt only
        print(f"| {method} | {upd} | {intr:.2f} | {partial:.0f} | {prefill:.0f} | {note} |")


if __name__ == "__main__":
    main()
