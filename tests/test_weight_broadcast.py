"""rollout.weight_update=nccl on CPU: the same protocol over gloo. Built-in servers join the
trainer's weight-update group through SGLang's /init_weights_update_group and receive bucketed
broadcasts through /update_weights_from_distributed (realcore.backends.weight_group, the trainer's
side realcore.weights.broadcast); a restarted server rejoins; an async run ends with every
server at the trainer's version. The NCCL path itself needs GPUs: its test skips here."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from realcore.backends import weight_group
from realcore.transport import interfaces
from realcore.backends.clients.sglang_api import GenClient
from realcore.backends.generation import read_hf_weights
from realcore.weights.broadcast import WeightSender
from test_gen_server import _make_model, started

pytestmark = pytest.mark.timeout(180)
TOKEN = "test-token"
PROMPT = [5, 17, 42, 9, 100]
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 24}
SERVER = """
import json, sys
from realcore.backends.genserver.http import run_server
run_server(sys.argv[1], seed=3, max_batch_size=8, token=sys.argv[2], on_ready=lambda a: print(json.dumps(a), flush=True))
"""
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("broadcast")
    return {name: _make_model(root / "cache", root / name, seed) for name, seed in (("A", 0), ("B", 1))}


class Servers:
    """Built-in server processes serving model A, started and stopped by the test."""

    def __init__(self, model: str, log_dir):
        self.model, self.log_dir, self.procs = model, log_dir, {}

    def start(self) -> str:
        log = open(self.log_dir / f"server-{len(self.procs)}.log", "w+")
        proc = subprocess.Popen([sys.executable, "-c", SERVER, self.model, TOKEN], stdout=subprocess.PIPE, stderr=log,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True)
        line = proc.stdout.readline()
        if not line:
            log.seek(0)
            pytest.fail(f"server did not start:\n{log.read()[-3000:]}")
        url = json.loads(line)["http"]
        self.procs[url] = proc
        return url

    def kill(self, url: str) -> None:
        self.procs[url].kill()
        self.procs[url].wait(timeout=30)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)


@pytest.fixture
def servers(models, tmp_path):
    s = Servers(models["A"], tmp_path)
    yield s
    s.stop_all()


def sender(bucket_mb: float = 0.05) -> WeightSender:
    cfg = SimpleNamespace(
        system=SimpleNamespace(host="127.0.0.1", startup_timeout_s=30.0, request_timeout_s=30.0),
        rollout=SimpleNamespace(server_token=TOKEN, request_timeout_s=30.0, weight_bucket_mb=bucket_mb))
    return WeightSender(cfg, engine="local", tp=1)


def call(url: str, fn):
    async def main():
        client = GenClient(url, token=TOKEN, timeout_s=30)
        try:
            await client.wait_ready(30)
            return await fn(client)
        finally:
            await client.close()

    return asyncio.run(main())


def greedy(url: str):
    return call(url, lambda c: c.generate(PROMPT, GREEDY, rid=os.urandom(4).hex()))


def test_buckets_cut_by_size_and_send_tied_weights_once():
    emb = torch.zeros(10, 4)
    state = {"embed": emb, "a": torch.zeros(3), "b": torch.zeros(20), "c": torch.zeros(2), "lm_head": emb}
    assert weight_group.buckets(state, bucket_bytes=48) == [["embed"], ["a"], ["b"], ["c"]]
    assert weight_group.buckets(state, bucket_bytes=10**6) == [["embed", "a", "b", "c"]]


def test_servers_receive_a_bucketed_broadcast_and_generate_with_it(servers, models):
    """Two servers of model A receive B's weights in many buckets over gloo: their greedy tokens and
    log-probs are those of a server that loads B from disk, and they report the version sent."""
    urls = [servers.start(), servers.start()]
    before = greedy(urls[0])
    state_b = read_hf_weights(models["B"])
    s = sender()
    assert len(weight_group.buckets(state_b, s.bucket_bytes)) > 3  # bucketed for real
    assert s.send(state_b, 1, urls) == []
    got = [greedy(u) for u in urls]
    call(urls[1], lambda c: c.update_weights_from_disk(models["B"], "2"))
    from_disk = greedy(urls[1])
    assert from_disk.output_ids != before.output_ids  # B's weights change the output: the test can fail
    for g in got:
        assert g.weight_version == "1"
        assert g.output_ids == from_disk.output_ids
        torch.testing.assert_close(torch.tensor(g.output_logprobs), torch.tensor(from_disk.output_logprobs), atol=1e-5, rtol=0)
    # A second update reuses the group (same members): no new group is built.
    assert s.send(read_hf_weights(models["A"]), 3, urls) == [] and s.n_groups == 1
    assert greedy(urls[0]).output_ids == before.output_ids


def test_a_held_server_takes_a_broadcast_under_its_running_requests(servers, models):
    """In flight over a broadcast (rollout.inflight_weight_update with nccl): the server holds its
    requests (pause `hold`), no decode step runs while the buckets arrive, and on continue the
    running request goes on with its KV cache under the new version, not aborted; the last bucket's
    abort_started_before ends only the requests that started before it."""
    url = servers.start()
    s = sender()
    params = {**GREEDY, "max_new_tokens": 400}

    async def fn(client):
        async def held_update(state, version, cut=None):
            await client.pause("hold")
            steps = (await client.server_info())["decode_steps"]
            assert await asyncio.to_thread(s.send, state, version, [url], abort_started_before=cut) == []
            held = await client.server_info()
            await client.resume()
            return held["decode_steps"] - steps, held["num_running_reqs"]

        old = await started(client, PROMPT, params, "old")  # first token from version 0
        first = await held_update(read_hf_weights(models["B"]), 1)
        new = await started(client, PROMPT, params, "new")  # from version 1
        second = await held_update(read_hf_weights(models["A"]), 2, cut=1)  # ends "old" only
        return first, second, await old, await new

    first, second, old, new = call(url, fn)
    assert len(weight_group.buckets(read_hf_weights(models["A"]), s.bucket_bytes)) > 3  # many buckets
    # No decode step between the buckets; the requests held through the update, not aborted (the
    # second's cut ended "old" as its last bucket landed).
    assert first == (0, 1) and second == (0, 1)
    v = old.token_versions()  # one request across the first update: its tokens of both versions
    assert old.finish_reason == "abort" and 20 <= len(old.output_ids) < 400
    assert v == sorted(v) and set(v) == {0, 1} and v.count(0) >= 10
    w = new.token_versions()
    assert new.finish_reason == "length" and len(new.output_ids) == 400 and w == sorted(w) and set(w) == {1, 2}



def test_a_broadcast_that_stops_between_buckets_decodes_nothing_on_part_of_a_version(servers, models):
    """The server refuses the last bucket (a parameter it does not have), so the trainer's two
    attempts both stop after the others landed: B's weights are in, its version never came. The
    request held through it must not go on over part of a version, new ones are refused (503)
    until a complete broadcast lands, and then the server serves that version."""
    url = servers.start()
    before = greedy(url)
    state = {**read_hf_weights(models["B"]), "no.such.weight": torch.zeros(3)}  # last in bucket order
    s = sender()
    assert len(weight_group.buckets(state, s.bucket_bytes)) > 3

    async def fn(client):
        held = await started(client, PROMPT, {**GREEDY, "max_new_tokens": 400}, "held")
        await client.pause("hold")
        failed = await asyncio.to_thread(s.send, state, 1, [url])
        info = await client.server_info()
        await client.resume()
        reply = await held
        with pytest.raises(RuntimeError, match="HTTP 503.*incomplete"):
            await client.generate(PROMPT, GREEDY, rid="refused")
        return failed, info, reply

    failed, info, reply = call(url, fn)
    assert failed == [url] and info["weights_incomplete"] and info["weight_version"] == "0"
    assert reply.finish_reason == "abort" and len(reply.output_ids) < 400 and set(reply.token_versions()) == {0}
    assert s.send(read_hf_weights(models["A"]), 2, [url]) == []  # a complete update
    after = greedy(url)
    assert after.weight_version == "2" and after.output_ids == before.output_ids
    assert call(url, lambda c: c.server_info())["weights_incomplete"] is False

def test_a_restarted_server_rejoins_and_a_dead_one_is_left_out(servers, models):
    """Server 1 dies: an update to [0, dead 1] reaches 0 alone (the dead one fails /health and
    is left out of a new group); its restart at a new address joins the next group and gets the
    weights; server 0 holds only the newest group (the old ones destroyed)."""
    state_b = read_hf_weights(models["B"])
    urls = [servers.start(), servers.start()]
    s = sender(bucket_mb=64)
    assert s.send(state_b, 1, urls) == []
    servers.kill(urls[1])
    assert s.send(state_b, 2, urls) == [urls[1]]
    assert greedy(urls[0]).weight_version == "2"
    restarted = servers.start()
    assert greedy(restarted).weight_version == "0"
    assert s.send(state_b, 2, [restarted]) == []  # the catch-up: a group of the restarted server alone
    assert s.send(state_b, 3, [urls[0], restarted]) == []  # the next update: all of them again
    assert [greedy(u).weight_version for u in (urls[0], restarted)] == ["3", "3"]
    assert greedy(restarted).output_ids == greedy(urls[0]).output_ids
    assert s.n_groups == 4
    info = call(urls[0], lambda c: c.server_info())
    assert info["weight_update_groups"] == [s.group_name]


def test_update_without_a_group_is_refused(servers):
    url = servers.start()

    async def fn(client):
        # SGLang's session rule: buckets only between begin_weight_update and end_weight_update.
        with pytest.raises(RuntimeError, match="must run between begin_weight_update"):
            await client.update_weights_from_distributed(["lm_head.weight"], ["float32"], [[1]], "nope", version=1)
        await client.begin_weight_update()
        with pytest.raises(RuntimeError, match="already open"):
            await client.begin_weight_update()
        with pytest.raises(RuntimeError, match="no weight-update group"):
            await client.update_weights_from_distributed(["lm_head.weight"], ["float32"], [[1]], "nope", version=1)
        await client.end_weight_update()
        with pytest.raises(RuntimeError, match="no weight-update session is open"):
            await client.end_weight_update()
        with pytest.raises(RuntimeError, match="world_size"):
            await client.init_weights_update_group("127.0.0.1", 1, 3, 2, "g", "gloo")
        with pytest.raises(RuntimeError, match="needs CUDA|not on a GPU"):
            await client.init_weights_update_group("127.0.0.1", 1, 1, 2, "g", "nccl")
        return await client.server_info()

    info = call(url, fn)
    assert info["weight_version"] == "0" and info["weight_update_groups"] == []


NCCL_SCRIPT = """
import os, sys, time, datetime, torch, torch.distributed as dist
from realcore.backends import weight_group as wg
from realcore.transport.interfaces import gloo_ifname
rank, port = int(sys.argv[1]), int(sys.argv[2])
torch.cuda.set_device(rank)  # NCCL ranks on distinct GPUs (NCCL refuses two ranks of one GPU)
T = datetime.timedelta(seconds=60)
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, T, wait_for_workers=False)
g = wg.new_group("nccl", store, rank, 2, "g", host="127.0.0.1", timeout=T)
assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ  # set for the group's creation only
assert os.environ["NCCL_SOCKET_IFNAME"] == "=" + gloo_ifname("127.0.0.1")
x = torch.arange(1000, device="cuda").to(torch.bfloat16)
if rank == 0:
    wg.send(g, [x], T)
else:
    got, = wg.receive(g, ["bfloat16"], [[1000]], wg.device_of("nccl"), T)
    assert torch.equal(got, x) and got.device == torch.device("cuda", 1)
# Rank 1 posts nothing more: rank 0's next broadcast times out. It must raise here, in the caller,
# and the watchdog must not kill the process afterwards (torch's default error handling would).
if rank == 0:
    t0 = time.monotonic()
    try:
        wg.send(g, [x], datetime.timedelta(seconds=5))
    except Exception as e:
        print(f"raised after {time.monotonic() - t0:.0f} s: {type(e).__name__}", flush=True)
    else:
        sys.exit("the broadcast without a peer did not raise")
    time.sleep(20)  # the watchdog has handled the failed work by now (dump wait shortened below)
    print("alive", flush=True)
    store.set("done", "1")
else:
    store.wait(["done"], datetime.timedelta(seconds=120))
"""


@pytest.mark.gpu(2)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL: one rank per GPU); the gloo tests "
                    "above run the same protocol")
def test_nccl_broadcast_between_two_gpus_and_a_timeout_that_raises(tmp_path):
    """The NCCL group of weight_group, the trainer on GPU 0 and a receiver on GPU 1: a bf16 tensor
    arrives on the receiver's GPU; a broadcast its peer never joins raises in rank 0's caller after
    its deadline and leaves the process alive (TORCH_NCCL_ASYNC_ERROR_HANDLING=2 for the group)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000"}
    procs = [subprocess.Popen([sys.executable, "-c", NCCL_SCRIPT, str(r), str(port)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    raised = re.search(r"raised after (\d+) s", outs[0])
    assert raised and 5 <= int(raised.group(1)) < 30 and "alive" in outs[0], outs[0]


# ---- the trainer's side: timeouts, sockets, dtype ----


def test_nccl_errors_raise_only_while_a_group_is_made(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    with weight_group.nccl_errors_raise():
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    with weight_group.nccl_errors_raise():
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # the user's value, for the other groups


def test_nccl_bootstraps_on_the_interface_of_the_host(monkeypatch):
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    interfaces.bind_nccl_to("127.0.0.1")
    assert os.environ["NCCL_SOCKET_IFNAME"] == "=" + interfaces.gloo_ifname("127.0.0.1")  # that one exactly
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib")
    interfaces.bind_nccl_to("127.0.0.1")
    assert os.environ["NCCL_SOCKET_IFNAME"] == "ib"  # the user's choice stays


def test_the_group_outlives_a_buckets_wait():
    cfg = SimpleNamespace(
        system=SimpleNamespace(host="127.0.0.1", startup_timeout_s=300.0, request_timeout_s=1800.0),
        rollout=SimpleNamespace(server_token=TOKEN, request_timeout_s=30.0, weight_bucket_mb=1))
    s = WeightSender(cfg, engine="local", tp=1)
    assert s.group_timeout.total_seconds() == 1800 and s.join_timeout.total_seconds() == 300


def test_weights_go_in_the_servers_dtype():
    from realcore.weights.broadcast import dtype_of_servers, wire_tensor

    assert dtype_of_servers(["bfloat16", "bfloat16"]) == torch.bfloat16
    assert dtype_of_servers(["float32"]) == torch.float32 and dtype_of_servers(["half"]) == torch.float16
    for mixed in (["bfloat16", "float32"], ["auto"], [None], ["bfloat16", None], ["int8"]):
        assert dtype_of_servers(mixed) is None, mixed  # then the trainer's own dtype
    w, ids = torch.randn(3, 4), torch.arange(5)
    sent = wire_tensor(w.t(), torch.device("cpu"), torch.bfloat16)
    assert sent.dtype == torch.bfloat16 and sent.is_contiguous() and torch.equal(sent, w.t().bfloat16())
    assert wire_tensor(ids, torch.device("cpu"), torch.bfloat16).dtype == torch.int64  # only floating point
    assert wire_tensor(w, torch.device("cpu"), None).dtype == torch.float32


def test_a_broadcast_to_bf16_servers_sends_bf16_in_a_group_that_outlives_a_buckets_wait(servers, models, monkeypatch):
    """Servers that report bf16 (their /get_server_info "dtype", stood in for here: the CPU servers
    hold float32) get every floating-point tensor in bf16, cast by the trainer before the
    broadcast; the group is made with the longer of the join and bucket deadlines."""
    url = servers.start()
    real_info, real_new_group, real_send = GenClient.server_info, weight_group.new_group, weight_group.send
    made, sent = [], []

    async def bf16_info(self):
        return {**(await real_info(self)), "dtype": "bfloat16"}

    def new_group(*args, timeout, **kwargs):
        made.append(timeout)
        return real_new_group(*args, timeout=timeout, **kwargs)

    def send(group, tensors, timeout):
        sent.extend(t.dtype for t in tensors)
        return real_send(group, tensors, timeout)

    monkeypatch.setattr(GenClient, "server_info", bf16_info)
    monkeypatch.setattr(weight_group, "new_group", new_group)
    monkeypatch.setattr(weight_group, "send", send)
    s = sender()
    s.group_timeout = s.timeout * 2  # as if system.request_timeout_s were the longer
    assert s.send(read_hf_weights(models["B"]), 1, [url]) == []
    assert s.dtype == torch.bfloat16 and sent and set(sent) == {torch.bfloat16}
    assert made == [s.timeout * 2]
    assert greedy(url).weight_version == "1"


def test_async_run_with_broadcast_updates(tmp_path):
    """rollout.weight_update=nccl (gloo here): an async run with 2 servers finishes, no weights on
    disk, and after each update the manager finds every server at the trainer's version."""
    from test_e2e_async import run_async

    out, metrics = run_async(tmp_path, "rollout.weight_update=nccl", "rollout.weight_bucket_mb=0.5",
                             "rollout.max_head_offpolicyness=1", steps=3)
    assert metrics[-1]["version"] == 3 and not os.path.exists(out / "weights")
    # Each server ends at the trainer's version, as its own log says (the manager lists only the
    # servers it has seen healthy: one still starting when this tiny run's updates ran is caught up).
    for i in (0, 1):
        server_log = open(out / "logs" / f"gen_server-{i}.log").read()
        assert re.findall(r"now at weight version (\d+)", server_log)[-1:] == ["3"], server_log[-2000:]
    log = open(out / "logs" / "gserver_manager.log").read()
    held = {int(v): json.loads(ids) for v, ids in re.findall(r"weights v(\d+): held by servers (\[[\d, ]*\])", log)}
    assert set(held) == {1, 2, 3} and all(held[v] for v in held), log[-2000:]  # every update reached a server
    assert "weight-update group realcore-weights-" in open(out / "logs" / "model_worker-0.log").read()
