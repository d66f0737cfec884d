"""Wire-format benchmark: control round trip and tensor transfer between two processes.

    python bench/wire.py [--quick]

Prints a markdown table: small-message round trip (wire.send/recv with msgpack + MAC) over tcp
loopback and the same with raw frames (the same ZeroMQ calls without msgpack, envelope or MAC: the
floor the wire's own work adds to), tensor transfer at 1 MB and 64 MB (sender -> peer, timed until
the peer's application ack arrives) and the same sizes as raw ZeroMQ frames (zero-copy on both
sides, no msgpack, no MAC: what the tcp transport alone allows), beside a single-process memcpy, the wire MAC (keyed BLAKE3) and HMAC-SHA256 alone for the same
sizes. Rows are without CURVE (system.wire_curve=false) unless they say "CURVE": those repeat the
round trip and the transfers with CURVE on both sockets (the default in a run).
"""

import hashlib
import hmac
import multiprocessing as mp
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

import torch  # noqa: E402
import zmq  # noqa: E402

from realcore.transport import wire  # noqa: E402

N_PING = 2000
N_PING_WARMUP = 200
SIZES = {"1 MB": (1 << 20, 20), "64 MB": (64 << 20, 5)}  # label -> (bytes, transfers)
TIMEOUT_S = 30.0
PEER = "bench-peer"  # the peer's name as a receiver (it connects, so it has no bound address)


def _pin(cpus) -> None:
    if cpus is not None:  # before the zmq.Context: its I/O thread inherits the mask
        os.sched_setaffinity(0, cpus)


def _limits(curve: bool) -> wire.Limits:
    return wire.Limits(1 << 30, 1 << 20, 30.0, 16, curve)


def _peer(addr: str, secret: bytes, cpus=None, curve: bool = False) -> None:
    """Echo pings; ack tensors with their size; exit on 'stop'."""
    _pin(cpus)
    torch.set_num_threads(1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    wire.secure(sock, secret, server=False, limits=_limits(curve))
    sock.connect(addr)
    ep = wire.Endpoint(secret, "bench-peer", socket="bench", address=PEER)
    try:
        while True:
            p, h, ts = wire.recv(sock, endpoint=ep, timeout_s=TIMEOUT_S, what="bench peer")
            if h["op"] == "ping":
                wire.send(sock, {"op": "pong", "i": h["i"]}, endpoint=ep, to=p)
            elif h["op"] == "tensor":
                wire.send(sock, {"op": "ack", "nbytes": sum(t.nbytes for t in ts)}, endpoint=ep, to=p)
            elif h["op"] == "stop":
                wire.send(sock, {"op": "bye"}, endpoint=ep, to=p)
                return
    finally:
        sock.close(linger=1000)
        ctx.term()


def _raw_peer(addr: str, cpus=None) -> None:
    """Echo raw frames (no msgpack, no MAC): the floor that ZeroMQ and two Python processes set."""
    _pin(cpus)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(addr)
    try:
        while True:
            frames = wire.recv_frames(sock, copy=True)
            if frames == [b"stop"]:
                return
            if frames == [b"tensor"]:  # then the payload in a message of its own, received zero-copy as the wire's tensors
                payload = sock.recv(copy=False)
                wire.send_frames(sock, [b"%d" % len(payload.buffer)])
                continue
            wire.send_frames(sock, frames)
    finally:
        sock.close(linger=1000)
        ctx.term()


def bench_raw(ctx, cpus=None, transfers: bool = True) -> tuple[list[float], dict[str, float]]:
    """Round-trip times (s) of one raw frame of a control message's size: the same ZeroMQ calls
    as the wire (wire.send_frames / recv_frames), without msgpack, envelope or MAC; and {label:
    median GB/s} of each SIZES payload sent zero-copy and received zero-copy until the peer's ack,
    without msgpack or MAC: what ZeroMQ's tcp alone allows."""
    sock = ctx.socket(zmq.DEALER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.setsockopt(zmq.RCVTIMEO, int(TIMEOUT_S * 1000))
    peer = mp.get_context("spawn").Process(target=_raw_peer, args=(f"tcp://127.0.0.1:{port}", cpus), daemon=True)
    peer.start()
    frames, times = [b"h" * 156], []  # a ping's size: length, header and MAC in one frame
    try:
        for i in range(N_PING_WARMUP + N_PING):
            t0 = time.perf_counter()
            wire.send_frames(sock, frames)
            wire.recv_frames(sock, copy=True)
            if i >= N_PING_WARMUP:
                times.append(time.perf_counter() - t0)
        rates = {}
        for label, (nbytes, reps) in (SIZES.items() if transfers else ()):
            x = torch.ones(nbytes, dtype=torch.uint8)
            got = []
            for i in range(reps + 1):  # the first is warm-up
                t0 = time.perf_counter()
                wire.send_frames(sock, [b"tensor"])
                sock.send(x.numpy(), copy=False)
                ack = wire.recv_frames(sock, copy=True)
                assert ack == [b"%d" % nbytes], ack
                if i:
                    got.append(nbytes / (time.perf_counter() - t0) / 1e9)
            rates[label] = statistics.median(got)
        sock.send_multipart([b"stop"])
    finally:
        peer.join(timeout=10)
        if peer.is_alive():
            peer.kill()
        sock.close(linger=0)
    return times, rates


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_ping(sock, ep: wire.Endpoint) -> list[float]:
    """Round-trip times (s) of a small control message."""
    times = []
    for i in range(N_PING_WARMUP + N_PING):
        t0 = time.perf_counter()
        wire.send(sock, {"op": "ping", "i": i, "ids": [1, 2, 3]}, endpoint=ep, to=PEER)
        _, h, _ = wire.recv(sock, endpoint=ep, timeout_s=TIMEOUT_S, what="pong")
        dt = time.perf_counter() - t0
        assert h == {"op": "pong", "i": i}
        if i >= N_PING_WARMUP:
            times.append(dt)
    return times


def bench_transfer(sock, ep: wire.Endpoint, nbytes: int, reps: int) -> float:
    """Median GB/s of sending one uint8 tensor of nbytes and receiving the peer's ack."""
    x = torch.ones(nbytes, dtype=torch.uint8)
    rates = []
    for i in range(reps + 1):  # the first is warm-up
        t0 = time.perf_counter()
        wire.send(sock, {"op": "tensor"}, [x], endpoint=ep, to=PEER, zero_copy=True)  # as the data plane
        _, h, _ = wire.recv(sock, endpoint=ep, timeout_s=TIMEOUT_S, what="tensor ack")
        dt = time.perf_counter() - t0
        assert h == {"op": "ack", "nbytes": nbytes}
        if i:
            rates.append(nbytes / dt / 1e9)
    return statistics.median(rates)


def bench_local(nbytes: int, reps: int) -> tuple[float, float, float]:
    """Median GB/s of copy_ into a preallocated tensor, into a fresh tensor, the wire MAC and HMAC-SHA256 alone."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    pre, fresh, mac, sha = [], [], [], []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        t1 = time.perf_counter()
        torch.empty_like(src).copy_(src)
        t2 = time.perf_counter()
        wire.mac([memoryview(src.numpy())], b"k" * 32)
        t3 = time.perf_counter()
        hmac.new(b"k" * 32, memoryview(src.numpy()), hashlib.sha256).digest()  # the wire's MAC until Nov 2026
        t4 = time.perf_counter()
        pre.append(nbytes / (t1 - t0) / 1e9)
        fresh.append(nbytes / (t2 - t1) / 1e9)
        mac.append(nbytes / (t3 - t2) / 1e9)
        sha.append(nbytes / (t4 - t3) / 1e9)
    return tuple(statistics.median(r[1:]) for r in (pre, fresh, mac, sha))


def run_pair(secret: bytes, cpus=None, transfers: bool = True, curve: bool = False, raw: bool = True):
    """(control round trips, raw round trips, {label: GB/s}, {label: raw GB/s}) between this
    process and a peer, both on `cpus` (None: wherever the scheduler puts them); `curve`: both
    sockets CURVE (wire.secure), as in a run by default; `raw`: measure raw frames too."""
    before = os.sched_getaffinity(0)
    _pin(cpus)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    wire.secure(sock, secret, server=True, limits=_limits(curve))
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    peer = mp.get_context("spawn").Process(target=_peer, args=(f"tcp://127.0.0.1:{port}", secret, cpus, curve),
                                           daemon=True)
    peer.start()
    try:
        ep = wire.Endpoint(secret, "bench", socket="bench", limits=_limits(curve))
        rtt = bench_ping(sock, ep)
        xfer = {label: bench_transfer(sock, ep, n, reps) for label, (n, reps) in SIZES.items()} if transfers else {}
        wire.send(sock, {"op": "stop"}, endpoint=ep, to=PEER)
        wire.recv(sock, endpoint=ep, timeout_s=TIMEOUT_S, what="peer bye")
    finally:
        peer.join(timeout=10)
        if peer.is_alive():
            peer.kill()
        sock.close(linger=0)
    try:
        raw_rtt, raw_xfer = bench_raw(ctx, cpus, transfers) if raw else ([], {})
    finally:
        ctx.term()
        os.sched_setaffinity(0, before)
    return rtt, raw_rtt, xfer, raw_xfer


def main() -> None:
    global N_PING, N_PING_WARMUP, SIZES
    if "--quick" in sys.argv:  # the smoke test's seconds-long version
        N_PING, N_PING_WARMUP, SIZES = 50, 10, {"1 MB": (1 << 20, 3)}
    torch.set_num_threads(1)
    secret = os.urandom(32)
    t_start = time.perf_counter()
    rtt, raw, xfer, raw_xfer = run_pair(secret)
    # Both processes (and their ZeroMQ I/O threads) on one core: no wake-up of an idle core per
    # message, whose cost on this VM varies from run to run more than the wire's own work.
    one = {min(os.sched_getaffinity(0))}
    rtt1, raw1, _, _ = run_pair(secret, one, transfers=False)
    rtt_c, _, xfer_c, _ = run_pair(secret, curve=True, raw=False)
    local = {label: bench_local(n, reps) for label, (n, reps) in SIZES.items()}

    us = [t * 1e6 for t in rtt]
    print(f"wire benchmark: tcp://127.0.0.1, 2 processes, torch threads 1, pid {os.getpid()}\n")
    print("| measurement | value |")
    print("|---|---|")
    print(f"| control round trip, median ({N_PING} trips, msgpack + MAC) | {statistics.median(us):.0f} us |")
    print(f"| control round trip, p99 | {_percentile(us, 0.99):.0f} us |")
    raw_us = [t * 1e6 for t in raw]
    print(f"| raw frames round trip, median (same sizes and ZeroMQ calls, no msgpack, no MAC: the floor) "
          f"| {statistics.median(raw_us):.0f} us |")
    print(f"| control round trip, median, both processes on one core (cpu {min(one)}) "
          f"| {statistics.median(rtt1) * 1e6:.0f} us |")
    print(f"| raw frames round trip, median, both processes on one core | {statistics.median(raw1) * 1e6:.0f} us |")
    us_c = [t * 1e6 for t in rtt_c]
    print(f"| CURVE: control round trip, median | {statistics.median(us_c):.0f} us |")
    print(f"| CURVE: control round trip, p99 | {_percentile(us_c, 0.99):.0f} us |")
    for label in SIZES:
        pre, fresh, mac, sha = local[label]
        print(f"| tensor {label} over tcp, sender -> ack (median) | {xfer[label]:.2f} GB/s |")
        print(f"| CURVE: tensor {label} over tcp, sender -> ack (median) | {xfer_c[label]:.2f} GB/s |")
        print(f"| raw {label} over tcp, zero-copy both sides, no msgpack, no MAC (ZeroMQ's ceiling) "
              f"| {raw_xfer[label]:.2f} GB/s |")
        print(f"| memcpy {label}, copy_ into preallocated | {pre:.2f} GB/s |")
        print(f"| memcpy {label}, copy_ into fresh tensor | {fresh:.2f} GB/s |")
        print(f"| wire MAC (keyed BLAKE3) {label}, one side (paid by sender and receiver) | {mac:.2f} GB/s |")
        print(f"| HMAC-SHA256 {label}, one side (for comparison) | {sha:.2f} GB/s |")
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
