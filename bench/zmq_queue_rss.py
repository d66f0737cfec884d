"""How a bare pyzmq ROUTER's RSS grows with the messages each of its connections has carried.

    python bench/zmq_queue_rss.py [--peers 1000] [--rounds 400]

One process binds `--peers` ROUTER sockets on 127.0.0.1 and echoes; this process connects one
ROUTER to all of them (a routing id per connection, as realcore's WorkerPool does) and sends one
control-sized message to each peer per round, then collects the echoes. Prints this process's RSS
every 25 rounds. It is the baseline under bench/master_scale.py's RSS columns: the master's RSS
grows for its first ~50 steps at 1000 workers and then stays flat, as this does with no realcore
code at all (libzmq's per-connection queues reaching their working size).
"""

import argparse
import multiprocessing as mp
import time

import zmq

TIMEOUT_MS = 30_000


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _peers(n: int, q) -> None:
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.ROUTER) for _ in range(n)]
    q.put([f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in socks])
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    while True:
        events = poller.poll(TIMEOUT_MS)
        if not events:
            return  # the sender is gone
        for s, _ in events:
            while True:
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if frames[1] == b"stop":
                    return
                s.send_multipart(frames)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=400)
    args = ap.parse_args()
    q = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=_peers, args=(args.peers, q), daemon=True)
    proc.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    try:
        for i, address in enumerate(q.get(timeout=TIMEOUT_MS / 1000)):
            sock.setsockopt(zmq.CONNECT_ROUTING_ID, f"p{i}".encode())
            sock.connect(address)
        time.sleep(2)  # every connection up
        print(f"bare pyzmq ROUTER -> {args.peers} peers, one 200 + 32 byte message per peer per round\n")
        print("| messages per connection | RSS MB |")
        print("|---|---|")
        print(f"| 0 | {_rss_mb():.1f} |")
        for k in range(1, args.rounds + 1):
            for i in range(args.peers):
                sock.send_multipart([f"p{i}".encode(), b"h" * 200, b"m" * 32])
            for _ in range(args.peers):
                sock.recv_multipart()
            if k % 25 == 0:
                print(f"| {k} | {_rss_mb():.1f} |", flush=True)
        for i in range(args.peers):
            sock.send_multipart([f"p{i}".encode(), b"stop"])
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
        sock.close(0)
        ctx.term()


if __name__ == "__main__":
    main()
