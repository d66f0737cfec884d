"""A live asynchronous run receives replayed, misaddressed, stale, forged, unsealed and malformed
messages on every listening ZeroMQ socket of its model workers and its manager; it must finish,
and metrics.jsonl must count each of them as dropped/<process>/<socket>/<reason>, exactly.

The messages are made here with the run's secret (an insider's worst case short of capturing
traffic: tests/test_fuzz.py replays captured packets)."""

import json
import os
import subprocess
import sys
import time

import torch
import zmq

from test_e2e_sync import assert_all_gone, wait_for_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 40  # tiny steps take ~0.2 s: the run goes on for seconds after the injection, so heartbeats report it


def send(address: str, messages: list[list[bytes]], secret: bytes) -> None:
    """Each message on a new connection, as someone other than the run's processes (but with the
    run's CURVE keys: an insider; tests/test_hostile_wire.py sends as an outsider)."""
    from realcore.transport import wire

    for frames in messages:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 2000)
        wire.secure(sock, secret, server=False, limits=wire.Limits.of())
        sock.connect(address)
        sock.send_multipart(frames)
        sock.close()


def test_every_dropped_message_is_counted_in_the_metrics(tmp_path, monkeypatch):
    from realcore.transport import wire
    from realcore.transport.protocol import Ping, request
    from realcore.api.workflow import TRAJECTORY_KEYS

    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "realcore.launch", "experiment=async-ppo-math", "eval.freq_steps=null", "model=tiny", "dataset=tiny-arith",
           "allocation_mode=local.d1p1t1+d2p1t1", "rollout.n_workers=1", f"trainer.total_steps={STEPS}",
           "trainer.batch_size=4", "generation.n_samples=2", "generation.max_new_tokens=8",
           "rollout.weight_update=memory", "rollout.max_head_offpolicyness=1", "system.heartbeat_interval_s=0.5",
           f"output_dir={out}",
           f"model.cache_dir={tmp_path}/cache", f"system.name_resolve.root={tmp_path}/nr", "trial_name=wire"]
    log = open(out + ".log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    expected: dict[str, int] = {}
    try:
        wait_for_metrics(out, 2, proc, timeout=300)
        secret = wire.load_secret(os.path.join(out, ".secret"))
        me = wire.Endpoint(secret, "outsider", socket="test")
        forger = wire.Endpoint(b"not the secret" * 3, "forger", socket="test")
        hour_ago = time.time() - 3600
        monkeypatch.setattr(wire.time, "time", lambda: hour_ago)  # a sender whose messages are an hour old
        old = wire.Endpoint(secret, "late", socket="test")
        stale = {}  # address -> a message stamped an hour ago (sealed now, under the old clock)
        records = {}
        for root, _, files in os.walk(tmp_path / "nr"):
            for f in files:
                try:
                    # A stored entry is its MAC (hex), a newline, then the value (realcore/transport/name_resolve.py).
                    rec = json.loads(open(os.path.join(root, f)).read().split("\n", 1)[-1])
                except ValueError:
                    continue
                if isinstance(rec, dict) and "control" in rec:
                    records[os.path.relpath(root, tmp_path / "nr").split("wire/", 1)[1].split("/", 1)[1]] = rec  # past run-<hash>/
        for rec in records.values():
            for kind in ("control", "data", "stream"):
                if kind in rec:
                    stale[rec[kind]] = old.seal(request(Ping(), -5), to=rec[kind])
        monkeypatch.undo()
        assert set(records) == {"model_worker/0", "model_worker/1", "gserver_manager"}, records

        def expect(process, socket, reason, n):
            key = f"dropped/{process}/{socket}/{reason}"
            expected[key] = expected.get(key, 0) + n

        for process, rec in records.items():
            a = rec["control"]
            ping = me.seal(request(Ping(), -7), to=a)
            send(a, [ping, ping, ping, ping], secret)  # the first is answered, then 3 replays
            send(a, [me.seal(request(Ping(), -8), to="tcp://127.0.0.1:1")] * 2, secret)  # misaddressed, twice
            send(a, [forger.seal(request(Ping(), -9), to=a)] * 2, secret)
            send(a, [wire.encode(request(Ping(), -10), [], secret), stale[a]], secret)
            send(a, [me.seal({"cmd": 999, "rid": 1, "body": {}}, to=a)], secret)
            for reason, n in (("replay", 3), ("misaddressed", 2), ("mac", 2), ("malformed", 1), ("stale", 1), ("body", 1)):
                expect(process, "control", reason, n)
            if "data" in rec:
                d = rec["data"]
                ask = me.seal({"rid": 1, "items": []}, to=d)
                send(d, [ask, ask, ask, forger.seal({"rid": 2, "items": []}, to=d), stale[d],
                         me.seal({"rid": 3}, to=d)], secret)
                for reason, n in (("replay", 2), ("mac", 1), ("stale", 1), ("body", 1)):
                    expect(process, "data", reason, n)
            if "stream" in rec:
                s = rec["stream"]
                bad_group = {"group": 1, "keys": list(TRAJECTORY_KEYS), "uid": "r9:9", "grant": 999}
                send(s, [me.seal(bad_group, [torch.zeros(3)], to=s),  # the wire takes it, the stream refuses it
                         me.seal(bad_group, to="tcp://127.0.0.1:1"), forger.seal(bad_group, to=s), stale[s]], secret)
                for reason in ("body", "misaddressed", "mac", "stale"):
                    expect(process, "stream", reason, 1)
        assert proc.wait(timeout=600) == 0, open(out + ".log").read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_all_gone(out)
    metrics = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(not k.startswith("dropped/") for k in metrics[0]), metrics[0]  # a normal run drops nothing
    counted = {k: v for k, v in metrics[-1].items() if k.startswith("dropped/")}
    assert counted == expected
    # The log is not flooded: the first drop of each (socket, reason) once per process, then summaries.
    logs = os.path.join(out, "logs")
    lines = [x for f in os.listdir(logs) for x in open(os.path.join(logs, f)) if "dropped a message on" in x]
    assert len(lines) == len(expected), lines
