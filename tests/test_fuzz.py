"""A live run attacked as a careless user and an attacker with root on the same host would.

One tiny asynchronous run (a generation server with in-memory weight updates, its manager, a
rollout worker, two model workers, the master) is started while the loopback traffic is captured.
Once it trains, and while it trains:
- the captured ZeroMQ traffic is encrypted (CURVE, system.wire_curve): every connection's greeting
  names CURVE, no frame of a message is in clear, and no sender name of the run's envelopes shows;
- every captured client-to-server connection (to the model workers, the manager, the streams, the
  weights socket) is replayed byte for byte on a new TCP connection: refused at the handshake
  (the server's short-term keys are new), counted as `handshake`;
- thousands of malformed messages go to every listening ZeroMQ socket from a peer holding the
  run's CURVE keys (an insider: an outsider cannot connect, tests/test_hostile_wire.py): random
  frames, forged and flipped MACs, truncated sealed messages, too many frames, frames over
  `system.max_message_bytes`;
- every HTTP endpoint of the generation server is called without the token (401) and with it and
  bad bodies (wrong types, huge and non-finite numbers, out-of-vocabulary ids, deep nesting,
  oversized bodies), also as a concurrent flood.
Then the run must go on training until every rejected message is counted in metrics.jsonl, and
end as asked (a preemption: SIGTERM, exit 75 after a step and a recover checkpoint) with every
step logged, no sample trained twice (ledger), every worker's RSS grown less than 100 MB, and
nothing listening beyond 127.0.0.1.

Real processes, sockets and packets (an AF_PACKET capture on lo: needs root, as CI has).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import aiohttp
import psutil
import pytest
import zmq

from conftest import skip_unless_ci
from loopback_capture import LoopbackCapture, zmtp_messages
from test_e2e_sync import assert_all_gone, wait_for_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 100_000  # never reached: the test ends the run after the fuzz
MAX_MESSAGE_BYTES = 32 * 2**20
MALFORMED_PER_SOCKET = 600
if os.geteuid() != 0:
    skip_unless_ci("capturing loopback packets needs root (CI runs as root)")


def launch(out: str, cache: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "realcore.launch", "experiment=async-ppo-math", "eval.freq_steps=null", "model=tiny", "dataset=tiny-arith",
           "allocation_mode=local.d1p1t1+d2p1t1", "rollout.n_workers=1", f"trainer.total_steps={STEPS}",
           "trainer.batch_size=4", "generation.n_samples=2", "generation.max_new_tokens=8", "actor.optimizer.lr=1e-3",
           "rollout.weight_update=memory", "rollout.max_head_offpolicyness=1",
           f"system.max_message_bytes={MAX_MESSAGE_BYTES}", f"output_dir={out}", f"model.cache_dir={cache}",
           f"system.name_resolve.root={out}/nr", "trial_name=fuzz"]
    log = open(out + ".log", "w")
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def listening(out: str) -> dict[str, str]:
    """Socket name -> address of every server of the run, from its name-resolution records."""
    found = {}
    for root, _, files in os.walk(os.path.join(out, "nr")):
        for f in files:
            try:
                # A stored entry is its MAC (hex), a newline, then the value (realcore/transport/name_resolve.py).
                rec = json.loads(open(os.path.join(root, f)).read().split("\n", 1)[-1])
            except (ValueError, OSError):
                continue
            if not isinstance(rec, dict):
                continue
            who = os.path.relpath(root, os.path.join(out, "nr")).split("fuzz/", 1)[-1].split("/", 1)[-1]  # past run-<hash>/
            for kind in ("control", "data", "stream", "weights", "http"):
                if isinstance(rec.get(kind), str):
                    found[f"{who}:{kind}"] = rec[kind]
    return found


def port(address: str) -> int:
    return int(address.rsplit(":", 1)[1].rstrip("/"))


def rss(pids: dict[str, int]) -> dict[str, int]:
    out = {}
    for name, pid in pids.items():
        try:
            out[name] = psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return out


def send_all(address: str, messages: list[list[bytes]], secret: bytes, pause_every: int = 50) -> None:
    """Each message on one DEALER connection (a ROUTER server sees a new peer), with the run's
    CURVE keys (from `secret`): what an insider who gets past the handshake can send."""
    from realcore.transport import wire

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.SNDHWM, 0)
    wire.secure(sock, secret, server=False, limits=wire.Limits.of())
    sock.connect(address)
    try:
        for i, frames in enumerate(messages):
            sock.send_multipart(frames)
            if i % pause_every == pause_every - 1:
                time.sleep(0.01)  # a flood, but not one that only measures the kernel's buffers
        time.sleep(0.5)
    finally:
        sock.close()


def replay_raw(address: str, stream: bytes) -> None:
    """A captured connection's bytes, as captured, on a new TCP connection."""
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port(address)), timeout=5) as s:
            s.settimeout(5)
            s.sendall(stream)
            time.sleep(0.05)  # let the server read it before the hang-up
    except OSError:  # the server closed the connection
        pass


# Sender names of the run's envelopes (inside every sealed header): in clear only if unencrypted.
CLEAR_MARKERS = (b"master#", b"model_worker/", b"rollout_worker/", b"gserver_manager#")


def malformed(real: list[list[bytes]], rng: random.Random) -> list[list[bytes]]:
    """Messages a receiver must drop: garbage, forged MACs, real (sealed) ones truncated or flipped."""
    import msgpack

    out = []
    for i in range(MALFORMED_PER_SOCKET):
        kind = i % 6
        if kind == 0:  # random frames
            out.append([rng.randbytes(rng.randint(0, 300)) for _ in range(rng.randint(1, 5))])
        elif kind == 1:  # a well-formed header with a forged MAC
            head = msgpack.packb({"cmd": "FETCH", "rid": i, "body": {"ids": [1, 2]}, "_t": []})
            out.append([head, rng.randbytes(32)])
        elif kind == 2 and real:  # a real message, one bit flipped
            m = [bytearray(f) for f in rng.choice(real)]
            f = rng.randrange(len(m))
            if m[f]:
                m[f][rng.randrange(len(m[f]))] ^= 1 << rng.randrange(8)
            out.append([bytes(x) for x in m])
        elif kind == 3 and real:  # a real message without its MAC, or without its header
            m, first = rng.choice(real), rng.random() < 0.5
            if len(m) == 1:  # the one-frame form: the same parts cut off its one frame
                out.append([m[0][:-32] if first else m[0][4 + int.from_bytes(m[0][:4], "big"):]])
            else:
                out.append(m[:-1] if first else m[1:])
        elif kind == 4:  # many frames, huge declared tensor
            head = msgpack.packb({"_t": [["float32", [2**40, 2**40]]]})
            out.append([head, b"x" * 16, *[b"" for _ in range(rng.randint(1, 200))], rng.randbytes(32)])
        else:  # msgpack bombs and non-maps
            out.append([rng.choice([b"\xdf\xff\xff\xff\xff", b"\x91" * 5000, b"\xc1", b"\xdd\xff\xff\xff\xff"]), rng.randbytes(32)])
    return out


HTTP_BAD_BODIES = [
    {"input_ids": [[1, 2, 3]], "sampling_params": {"top_k": 9223372036854775808, "max_new_tokens": 4}},
    {"input_ids": [[1, 2, 3]], "sampling_params": {"top_k": "9" * 400, "max_new_tokens": 4}},
    {"input_ids": [[1, 2, 3]], "sampling_params": {"temperature": float("inf"), "max_new_tokens": 4}},
    {"input_ids": [[1, 2, 3]], "sampling_params": {"temperature": float("nan"), "max_new_tokens": 4}},
    {"input_ids": [[1, 2, 3]], "sampling_params": {"temperature": -1, "max_new_tokens": 4}},
    {"input_ids": [[1, 2, 3]], "sampling_params": {"max_new_tokens": 10**12}},
    {"input_ids": [[1, 2, 10**9]], "sampling_params": {"max_new_tokens": 4}},
    {"input_ids": [[-5]], "sampling_params": {"max_new_tokens": 4}},
    {"input_ids": [[1.5, "a", None]]},
    {"input_ids": "abc"},
    {"input_ids": [[1] * 10] * 100000},
    {"rid": {"a": 1}, "input_ids": [[1]]},
    [1, 2, 3],
    "just a string",
    None,
]


async def http_fuzz(url: str, token: str, vocab: int) -> dict[str, int]:
    """Returns status code counts. Every answer must be 401 (no token) or 4xx (bad body)."""
    statuses: dict[str, int] = {}
    auth = {"Authorization": f"Bearer {token}"}

    def seen(tag: str, status: int) -> None:
        statuses[f"{tag}:{status}"] = statuses.get(f"{tag}:{status}", 0) + 1

    async with aiohttp.ClientSession() as s:
        endpoints = [("POST", "/generate"), ("POST", "/update_weights_from_disk"), ("POST", "/pause_generation"),
                     ("POST", "/continue_generation"), ("POST", "/abort_request"), ("GET", "/v1/models"),
                     ("GET", "/health"), ("GET", "/get_server_info")]
        for method, path in endpoints:  # no token, or a wrong one
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": token}):
                async with s.request(method, url + path, json={"abort_all": True}, headers=headers) as r:
                    seen("noauth", r.status)
        raw = [json.dumps(b, allow_nan=True) for b in HTTP_BAD_BODIES]
        raw += ["[" * 100000 + "]" * 100000, "{" * 5000, "not json", "\x00\xff" * 100, "1" * 5000]
        for path in ("/generate", "/update_weights_from_disk", "/pause_generation", "/abort_request"):
            for body in raw:
                async with s.post(url + path, data=body, headers={**auth, "Content-Type": "application/json"}) as r:
                    seen("bad", r.status)
        big = b'{"input_ids": [[' + b"1," * (40 * 2**20) + b'1]]}'  # ~80 MB
        try:
            async with s.post(url + "/generate", data=big, headers={**auth, "Content-Type": "application/json"}) as r:
                seen("oversized", r.status)
        except aiohttp.ClientError:  # the server may close the connection once the limit is passed
            seen("oversized", 413)

        async def one(i: int) -> None:
            body = HTTP_BAD_BODIES[i % len(HTTP_BAD_BODIES)]
            async with s.post(url + "/generate", data=json.dumps(body), headers={**auth, "Content-Type": "application/json"}) as r:
                seen("flood", r.status)

        await asyncio.gather(*(one(i) for i in range(300)))
        # The server still serves a good request.
        good = {"input_ids": [[1, 2, 3]], "sampling_params": {"max_new_tokens": 3, "temperature": 1.0}}
        async with s.post(url + "/generate", json=good, headers=auth) as r:
            assert r.status == 200, await r.text()
            seen("good", r.status)
    return statuses


@pytest.mark.timeout(900)
def test_a_live_run_survives_malformed_replayed_and_oversized_input(tmp_path):
    from realcore.backends.server_launch import server_token
    from realcore.transport import wire
    from realcore.trainer.ledger import audit

    out, cache = str(tmp_path / "run"), str(tmp_path / "cache")
    capture = LoopbackCapture()
    proc = launch(out, cache)
    try:
        wait_for_metrics(out, 3, proc, timeout=300)
        capture.stop()
        t0 = time.monotonic()
        pids = json.load(open(os.path.join(out, "pids.json")))
        rss_before = rss(pids)
        servers = listening(out)
        zmq_servers = {n: a for n, a in servers.items() if a.startswith("tcp://")}
        assert {n.split(":")[1] for n in zmq_servers} >= {"control", "data", "stream", "weights"}, servers
        secret = wire.load_secret(os.path.join(out, ".secret"))

        # Captured client-to-server connections, by the server socket they went to.
        by_port = {port(a): n for n, a in zmq_servers.items()}
        captured: dict[str, list[bytes]] = {}
        for (sport, dport), stream in capture.streams().items():
            if dport in by_port and len(stream) >= 64:
                captured.setdefault(by_port[dport], []).append(stream)
        assert {n.split(":")[1] for n in captured} >= {"control", "data", "stream"}, sorted(captured)
        for name, streams in captured.items():  # encrypted: nothing of a message in clear
            boxes = [f for stream in streams for m in zmtp_messages(stream) for f in m]
            assert boxes and all(f.startswith(b"\x07MESSAGE") for f in boxes), name  # CURVE boxes only
            for stream in streams:
                assert stream[12:32].rstrip(b"\0") == b"CURVE", (name, stream[:64])
                assert not [m for m in CLEAR_MARKERS if m in stream], name

        sent_bad: dict[str, int] = {}
        rng = random.Random(0)
        me = wire.Endpoint(secret, "fuzzer", socket="test")
        for name, address in zmq_servers.items():
            replays = captured.get(name, [])[:20]
            for stream in replays:
                replay_raw(address, stream)
            sealed = [me.seal({"cmd": 1, "rid": -i, "body": {}}, to=address) for i in range(1, 21)]
            send_all(address, malformed(sealed, rng), secret)
            sent_bad[name] = len(replays) + MALFORMED_PER_SOCKET
        for name, address in zmq_servers.items():  # frames over the limit: refused by ZeroMQ itself
            send_all(address, [[b"h", b"\0" * (MAX_MESSAGE_BYTES + 1), b"m"]], secret)

        http = [a for n, a in servers.items() if n.endswith(":http")][0]
        token = server_token(secret)
        statuses = asyncio.run(http_fuzz(http, token, vocab=512))
        # Python keeps the memory a burst of large bodies once needed (allocator arenas), so a leak
        # shows as growth that repeats: the server's RSS is compared across a second, equal round.
        rss_mid = rss(pids)
        for k, n in asyncio.run(http_fuzz(http, token, vocab=512)).items():
            statuses[k] = statuses.get(k, 0) + n
        assert all(k.split(":")[1] == "401" for k in statuses if k.startswith("noauth")), statuses
        assert all(400 <= int(k.split(":")[1]) < 500 for k in statuses if k.split(":")[0] in ("bad", "flood", "oversized")), statuses
        http_name = [n for n in servers if n.endswith(":http")][0]
        sent_bad[http_name] = sum(n for k, n in statuses.items() if not k.startswith("good"))

        rss_after = rss(pids)
        assert proc.poll() is None, "the run ended during the fuzz"
        at_end = len(open(os.path.join(out, "metrics.jsonl")).readlines())
        print(f"fuzz done after {time.monotonic() - t0:.0f} s, at step {at_end}")
        listen = listening_addresses(pids.values())
        # Training goes on until the metrics count every bad message (workers report theirs with
        # their heartbeats), then the run is preempted (the fastest orderly end).
        deadline = time.monotonic() + 180
        while not (counted := last_counts(out, after=at_end)) or any(counted.get(n, 0) < k for n, k in sent_bad.items()):
            assert proc.poll() is None, "the run ended before it counted the fuzz"
            assert time.monotonic() < deadline, ("not every bad message counted within 180 s", sent_bad, counted)
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        capture.stop() if not capture.stopping.is_set() else None
    log = open(out + ".log").read()
    assert proc.returncode == 75, log[-3000:]  # preempted, as asked
    assert_all_gone(out)
    http_pid = http_name.split(":")[0]
    grown = {n: (rss_after[n] - (rss_mid if n == http_pid else rss_before)[n]) / 2**20 for n in rss_after if n in rss_before}
    print("RSS growth, MB:", {n: round(g, 1) for n, g in grown.items()})
    assert all(g < 100 for g in grown.values()), grown
    assert listen and all(a == "127.0.0.1" for a in listen), listen
    metrics = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1)) and len(metrics) > at_end
    counted = dropped_counts(metrics[-1])
    for name, n in sent_bad.items():
        assert counted.get(name, 0) >= n, (name, n, counted)
    a = audit(out, batch_size=4, max_head_offpolicyness=1)
    assert a.duplicated == 0 and a.short_steps == [] and a.over_stale == 0, a


def last_counts(out: str, after: int) -> dict[str, int] | None:
    """dropped_counts of the last metrics line, once there are more than `after` lines (else None)."""
    lines = open(os.path.join(out, "metrics.jsonl")).read().splitlines()
    try:
        return dropped_counts(json.loads(lines[-1])) if len(lines) > after else None
    except ValueError:  # a line being written
        return None


def dropped_counts(row: dict) -> dict[str, int]:
    """metrics.jsonl's dropped/<process>/<socket>/<reason> totals, summed per "<process>:<socket>"."""
    out: dict[str, int] = {}
    for key, n in row.items():
        if key.startswith("dropped/"):
            process, socket, _ = key.removeprefix("dropped/").rsplit("/", 2)
            out[f"{process}:{socket}"] = out.get(f"{process}:{socket}", 0) + n
    return out


def listening_addresses(pids) -> list[str]:
    """Local addresses of every listening TCP socket of these processes."""
    found = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in set(pids):
            found.append(conn.laddr.ip)
    return found
