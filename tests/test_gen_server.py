"""The built-in generation server (SGLang's API) and its client, against a real server process.

One server subprocess serves model A (with a bearer token, an in-memory weights socket and a 1 MiB
body limit) for the whole file; tests that change its weights restore A (version "0") before they
end. The engine thread's fault isolation is tested in-thread (a request that bypasses the HTTP
validation).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import aiohttp
import pytest
import torch

from realcore.api.config import GenerationConfig, ModelConfig
from realcore.backends.clients.sglang_api import GenClient, generate_resumable, push_weights
from realcore.backends.genserver.http import run_server
from realcore.backends.generation import GenerationEngine, read_hf_weights
from realcore.backends.models import load_model, load_tokenizer, prepare_model

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)
TOKEN = "test-token"
SECRET = b"k" * 32
MAX_BODY = 2**20
PROMPT = [5, 17, 42, 9, 100]
GREEDY = {"temperature": 0.0, "ignore_eos": True}
SERVER = """
import json, os, sys
from realcore.backends.genserver.http import run_server
run_server(sys.argv[1], seed=3, max_batch_size=8, token=sys.argv[2], secret=bytes.fromhex(os.environ["SECRET_HEX"]),
           max_body_bytes=int(sys.argv[3]), on_ready=lambda a: print(json.dumps(a), flush=True), device="cpu")
"""


def _make_model(cache_dir, out_dir, seed: int) -> str:
    """A tiny model whose weights are re-drawn at a larger scale: at HF's init scale greedy output
    repeats one token, which would make the comparisons here vacuous."""
    path = prepare_model(ModelConfig(name="tiny", cache_dir=str(cache_dir)), seed=seed)
    model, tok = load_model(path), load_tokenizer(path)
    gen = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15, generator=gen)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return str(out_dir)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen_server")
    return {name: _make_model(root / "cache", root / name, seed) for name, seed in (("A", 0), ("B", 1))}


@pytest.fixture(scope="module")
def forward(models):
    """name -> full-forward log-probs of `output` after `prompt` (temperature 1)."""
    loaded = {name: load_model(path) for name, path in models.items()}

    def logprobs(name: str, prompt: list[int], output: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = loaded[name](torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]  # (n_out, V)
        return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(output)[:, None]).squeeze(1)

    return logprobs


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w+")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SECRET_HEX": SECRET.hex()}
    argv = [sys.executable, "-c", SERVER, models["A"], TOKEN, str(MAX_BODY)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
    line = proc.stdout.readline()  # on_ready's JSON, or "" if the server died
    if not line:
        log.seek(0)
        pytest.fail(f"server did not start:\n{log.read()[-3000:]}")
    yield json.loads(line)
    proc.terminate()  # SIGTERM: run_server returns, the process exits 0
    assert proc.wait(timeout=30) == 0


def drive(server, fn):
    """Run `fn(client)` in a fresh event loop with a client of the shared server."""

    async def main():
        client = GenClient(server["http"], token=TOKEN, timeout_s=30)
        try:
            await client.wait_ready(10)
            return await fn(client)
        finally:
            await client.close()

    return asyncio.run(main())


async def wait_until(client, pred, timeout_s: float = 10.0) -> dict:
    """Poll get_server_info until `pred(info)` holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = await client.server_info()
        if pred(info):
            return info
        await asyncio.sleep(0.005)
    raise TimeoutError(f"server never reached the expected state; last info {info}")


async def started(client, prompt, params: dict, rid: str, steps: int = 10) -> asyncio.Future:
    """A /generate request running in the background, once the server has decoded `steps` more steps."""
    before = await client.server_info()
    job = asyncio.ensure_future(client.generate(prompt, params, rid=rid))
    await wait_until(client, lambda i: i["decode_steps"] >= before["decode_steps"] + steps)
    return job


async def post(url: str, body, *, token: str | None = TOKEN, raw=None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession(headers=headers) as s:
        async with s.post(url, json=None if raw is not None else body, data=raw) as r:
            return r.status, await r.json(content_type=None)


async def request(method: str, url: str, headers: dict, body=None) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url, headers=headers, json=body) as r:
            return r.status, await r.text()


async def restore_a(client, models) -> None:
    await client.update_weights_from_disk(models["A"], "0")


def split_point(forward, prompt, reply_ids, reply_logprobs) -> int:
    """The s such that log-probs [:s] are model A's and [s:] model B's (full forward), asserted."""
    a, b = forward("A", prompt, reply_ids), forward("B", prompt, reply_ids)
    got = torch.tensor(reply_logprobs)
    s = 0
    while s < len(got) and abs(float(got[s] - a[s])) < 1e-4:
        s += 1
    torch.testing.assert_close(got[s:], b[s:], atol=1e-4, rtol=0)
    return s


# --- tests ------------------------------------------------------------------------------------------


def test_continuous_batching_shares_a_batch_and_matches_alone(server):
    prompts = [PROMPT, [7, 3, 250, 11]]

    async def fn(client):
        params = {**GREEDY, "max_new_tokens": 150}
        alone = [await client.generate(p, params, rid=f"alone-{i}") for i, p in enumerate(prompts)]
        before = await client.server_info()
        first = asyncio.ensure_future(client.generate(prompts[0], params, rid="cb-0"))
        await wait_until(client, lambda i: i["decode_steps"] >= before["decode_steps"] + 20)
        both = await asyncio.gather(first, client.generate(prompts[1], params, rid="cb-1"))
        return alone, both, before, await client.server_info()

    alone, both, before, after = drive(server, fn)
    for a, b in zip(alone, both):
        assert a.output_ids == b.output_ids and len(set(a.output_ids)) > 5  # non-trivial greedy output
        torch.testing.assert_close(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-4, rtol=0)
    assert after["max_running_requests"] >= 2
    assert after["decode_steps"] - before["decode_steps"] < 2 * 150 - 40  # they overlapped by 20+ steps


def test_api_shapes_and_bad_bodies(server, models):
    url = server["http"]

    async def fn(client):
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as s:
            async with s.get(url + "/v1/models") as r:
                assert r.status == 200
                assert await r.json() == {"object": "list", "data": [{"id": models["A"], "object": "model"}]}
        assert await client.health()
        info = await client.server_info()
        assert {"weight_version", "num_running_reqs", "max_running_requests", "paused"} <= set(info)
        # device cpu (exact comparisons with a float32 forward, on a GPU machine too), dtype auto: float32 there
        assert (info["device"], info["dtype"]) == ("cpu", "float32")
        params = {**GREEDY, "max_new_tokens": 6, "top_k": -1}
        status, out = await post(url + "/generate", {"input_ids": PROMPT, "rid": "shape", "return_logprob": True, "sampling_params": params})
        meta = out["meta_info"]
        assert status == 200 and len(out["output_ids"]) == 6 and meta["id"] == "shape" and meta["weight_version"] == "0"
        assert meta["finish_reason"] == {"type": "length", "length": 6}
        assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 6
        triples = meta["output_token_logprobs"]  # [logprob, token id, null] per output token
        assert [t for _, t, _ in triples] == out["output_ids"] and all(lp <= 0 and x is None for lp, _, x in triples)
        stop = out["output_ids"][2]
        status, out = await post(url + "/generate", {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "stop_token_ids": [stop]}})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert "output_token_logprobs" not in out["meta_info"]  # return_logprob defaults to false
        for path, body in [
            ("/generate", {"input_ids": []}),
            ("/generate", {"input_ids": [10**6]}),
            ("/generate", {"input_ids": PROMPT, "sampling_params": {"min_p": 0.1}}),
            ("/generate", {"input_ids": PROMPT, "sampling_params": {"temperature": -1}}),
            ("/generate", [1, 2]),
            ("/pause_generation", {"mode": "later"}),
            ("/abort_request", {}),
        ]:
            status, out = await post(url + path, body)
            assert status == 400 and "\n" not in out["error"], (path, body, out)
        status, out = await post(url + "/generate", None, raw=b"{not json")
        assert status == 400 and "JSON" in out["error"]
        status, out = await post(url + "/update_weights_from_disk", {"model_path": "/nonexistent"})
        assert status == 400 and out["success"] is False and "safetensors" in out["message"]

    drive(server, fn)


def test_abort_one_and_all(server):
    async def fn(client):
        long = {**GREEDY, "max_new_tokens": 1500}
        x = asyncio.ensure_future(client.generate(PROMPT, long, rid="x"))
        y = asyncio.ensure_future(client.generate(PROMPT, {**GREEDY, "max_new_tokens": 200}, rid="y"))
        await wait_until(client, lambda i: i["num_running_reqs"] == 2)
        await client.abort("x")
        x, y = await x, await y
        assert x.finish_reason == "abort" and 0 < len(x.output_ids) < 1500
        assert len(x.output_logprobs) == len(x.output_ids)
        assert y.finish_reason == "length" and len(y.output_ids) == 200
        jobs = [asyncio.ensure_future(client.generate(PROMPT, long, rid=f"all-{i}")) for i in range(2)]
        await wait_until(client, lambda i: i["num_running_reqs"] == 2)
        await client.abort()
        assert all(r.finish_reason == "abort" and len(r.output_ids) < 1500 for r in await asyncio.gather(*jobs))

    drive(server, fn)


def test_pause_abort_and_requests_wait_while_paused(server):
    async def fn(client):
        long = {**GREEDY, "max_new_tokens": 1500}
        job = asyncio.ensure_future(client.generate(PROMPT, long, rid="pa"))
        await wait_until(client, lambda i: i["num_running_reqs"] == 1)
        await client.pause("abort")
        reply = await job
        assert reply.finish_reason == "abort" and len(reply.output_ids) < 1500
        late = asyncio.ensure_future(client.generate(PROMPT, {**GREEDY, "max_new_tokens": 5}, rid="late"))
        await asyncio.sleep(0.3)
        assert not late.done()  # held, not rejected
        await client.resume()
        assert (await late).finish_reason == "length"

    drive(server, fn)


def test_pause_in_place_refuses_update_and_keeps_kv(server, models):
    async def fn(client):
        params = {**GREEDY, "max_new_tokens": 400}
        ref = await client.generate(PROMPT, params, rid="ref")
        job = asyncio.ensure_future(client.generate(PROMPT, params, rid="ip"))
        await wait_until(client, lambda i: i["num_running_reqs"] == 1)
        await client.pause("in_place")
        steps = (await client.server_info())["decode_steps"]
        late = asyncio.ensure_future(client.generate(PROMPT, {**GREEDY, "max_new_tokens": 5}, rid="ip-late"))
        with pytest.raises(RuntimeError, match="in_place"):
            await client.update_weights_from_disk(models["B"], "1")
        await asyncio.sleep(0.2)
        info = await client.server_info()
        assert info["decode_steps"] == steps and info["weight_version"] == "0" and not job.done() and not late.done()
        await client.resume()
        held = await job
        assert held.output_ids == ref.output_ids and (await late).finish_reason == "length"

    drive(server, fn)


def test_retract_update_continue_resumes_under_new_weights(server, models, forward):
    async def fn(client):
        job = asyncio.ensure_future(client.generate(PROMPT, {**GREEDY, "max_new_tokens": 300}, rid="rt"))
        await wait_until(client, lambda i: i["num_running_reqs"] == 1)
        await client.pause("retract")
        await client.update_weights_from_disk(models["B"], "1")
        await asyncio.sleep(0.1)
        assert not job.done()
        await client.resume()
        reply = await job
        await restore_a(client, models)
        return reply

    reply = drive(server, fn)
    assert reply.finish_reason == "length" and len(reply.output_ids) == 300 and reply.weight_version == "1"
    s = split_point(forward, PROMPT, reply.output_ids, reply.output_logprobs)
    assert 0 < s < 300  # tokens before the retraction from A, after it from B (KV recomputed)


def test_interrupted_generation_logprobs_match_each_segments_weights(server, models, forward):
    """The acceptance test of async RL: pause(abort) -> update -> continue, stitched by the client."""
    params = {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": 800}

    async def fn(client):
        before = await client.server_info()
        job = asyncio.ensure_future(generate_resumable(client, PROMPT, params, rid="key"))
        await wait_until(client, lambda i: i["decode_steps"] >= before["decode_steps"] + 50)
        await client.pause("abort")
        await client.update_weights_from_disk(models["B"], "1")
        await client.resume()
        traj = await job
        await restore_a(client, models)
        return traj

    traj = drive(server, fn)
    assert traj.n_segments >= 2 and traj.finish_reason == "length" and len(traj.output_ids) == 800
    assert (traj.version_start, traj.version_end) == (0, 1) and traj.output_versions == sorted(traj.output_versions)
    s = traj.output_versions.index(1)
    assert 50 <= s < 800
    got = torch.tensor(traj.output_logprobs)
    torch.testing.assert_close(got[:s], forward("A", PROMPT, traj.output_ids)[:s], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[s:], forward("B", PROMPT, traj.output_ids)[s:], atol=1e-4, rtol=0)


def test_updates_with_abort_all_requests_interrupt_without_a_pause(server, models, forward):
    """abort_all_requests (disk and memory): no pause; the running request ends at the update with
    A's tokens, and its resubmission runs on B with B's KV cache, so each segment's log-probs are
    exactly one model's (a token of the new weights on the old KV cache would match neither)."""
    params = {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": 400}
    state_a = read_hf_weights(models["A"])

    async def interrupted(client, update):
        before = await client.server_info()
        job = asyncio.ensure_future(generate_resumable(client, PROMPT, params, rid=f"abort-all-{before['decode_steps']}"))
        await wait_until(client, lambda i: i["decode_steps"] >= before["decode_steps"] + 30)
        await update()
        return await job

    async def fn(client):
        disk = await interrupted(client, lambda: client.update_weights_from_disk(models["B"], "1", abort_all_requests=True))
        info = await client.server_info()
        memory = await interrupted(client, lambda: asyncio.to_thread(
            push_weights, server["weights"], SECRET, "2", state_a, 10, abort_all_requests=True))
        await restore_a(client, models)
        return disk, memory, info

    disk, memory, info = drive(server, fn)
    assert info["paused"] is None
    for traj, (old, new), (v0, v1) in ((disk, "AB", (0, 1)), (memory, "BA", (1, 2))):
        assert traj.n_segments == 2 and len(traj.output_ids) == 400 and (traj.version_start, traj.version_end) == (v0, v1)
        s = traj.output_versions.index(v1)
        assert 30 <= s < 400
        got = torch.tensor(traj.output_logprobs)
        torch.testing.assert_close(got[:s], forward(old, PROMPT, traj.output_ids)[:s], atol=1e-4, rtol=0)
        torch.testing.assert_close(got[s:], forward(new, PROMPT, traj.output_ids)[s:], atol=1e-4, rtol=0)


def test_in_flight_updates_tag_each_token_with_the_version_that_sampled_it(server, models, forward):
    """Without abort_all_requests (disk, then memory) a running request is not interrupted: it goes
    on with its KV cache, and the reply names the version of each token (weight_version_spans).
    Tokens up to the first update are exactly model A's; the first one tagged 1 is not (B's
    weights sampled it), so the tags mark where the weights changed."""
    params = {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": 600}
    state_a = read_hf_weights(models["A"])

    async def fn(client):
        before = await client.server_info()
        job = asyncio.ensure_future(generate_resumable(client, PROMPT, params, rid="in-flight"))
        await wait_until(client, lambda i: i["decode_steps"] >= before["decode_steps"] + 30)
        await client.update_weights_from_disk(models["B"], "1")
        mid = await client.server_info()
        await wait_until(client, lambda i: i["decode_steps"] >= mid["decode_steps"] + 30)
        await asyncio.to_thread(push_weights, server["weights"], SECRET, "2", state_a, 10)
        traj = await job
        await restore_a(client, models)
        return traj

    traj = drive(server, fn)
    assert traj.n_segments == 1 and len(traj.output_ids) == 600 and traj.finish_reason == "length"
    assert (traj.version_start, traj.version_end) == (0, 2)
    v = traj.output_versions
    assert v == sorted(v) and set(v) == {0, 1, 2}
    s1, s2 = v.index(1), v.index(2)
    assert 30 <= s1 and s1 + 30 <= s2 < 600
    got, a = torch.tensor(traj.output_logprobs), forward("A", PROMPT, traj.output_ids)
    torch.testing.assert_close(got[:s1], a[:s1], atol=1e-4, rtol=0)
    assert abs(float(got[s1] - a[s1])) > 1e-3


def test_a_version_update_ends_only_the_requests_started_before_a_version(server, models):
    """abort_started_before on /update_weight_version (how an in-flight LoRA update from disk sets
    its version, after the adapter's load): as on a weight update, only older requests end."""
    params = {**GREEDY, "max_new_tokens": 400}

    async def fn(client):
        url = server["http"] + "/update_weight_version"
        old = await started(client, PROMPT, params, "old")  # first token from version 0
        assert (await post(url, {"new_version": "1", "abort_all_requests": False}))[0] == 200
        new = await started(client, PROMPT, params, "new")  # from version 1
        assert (await post(url, {"new_version": "2", "abort_all_requests": False, "abort_started_before": 1}))[0] == 200
        first, second = await old, await new
        await restore_a(client, models)
        return first, second

    old, new = drive(server, fn)
    assert old.finish_reason == "abort" and set(old.token_versions()) == {0, 1} and len(old.output_ids) < 400
    assert new.finish_reason == "length" and len(new.output_ids) == 400 and set(new.token_versions()) == {1, 2}


def test_an_in_flight_update_ends_only_the_requests_started_before_a_version(server, models):
    """abort_started_before (disk and memory): the requests whose first token came from an older
    version end (partial output); newer ones go on."""
    params = {**GREEDY, "max_new_tokens": 400}
    state_a = read_hf_weights(models["A"])

    async def fn(client):
        old = await started(client, PROMPT, params, "old")  # first token from version 0
        await client.update_weights_from_disk(models["B"], "1")
        new = await started(client, PROMPT, params, "new")  # from version 1
        await client.update_weights_from_disk(models["A"], "2", abort_started_before=1)
        first = await old
        newer = await started(client, PROMPT, params, "newer")  # from version 2
        await asyncio.to_thread(push_weights, server["weights"], SECRET, "3", state_a, 10, abort_started_before=2)
        second = await new
        third = await newer
        await restore_a(client, models)
        return first, second, third

    old, new, newer = drive(server, fn)
    assert old.finish_reason == "abort" and 10 <= len(old.output_ids) < 400 and old.token_versions()[0] == 0
    assert new.finish_reason == "abort" and 10 <= len(new.output_ids) < 400 and set(new.token_versions()) == {1, 2}
    assert newer.finish_reason == "length" and len(newer.output_ids) == 400 and set(newer.token_versions()) == {2, 3}


@pytest.mark.parametrize("eta,drop_stale", [(0, True), (1, True), (0, False)])
def test_rollout_worker_stops_a_rollout_the_update_makes_too_stale(server, models, eta, drop_stale):
    """The rollout worker's client against a real server: a request aborted by the update to
    version 1 started at version 0, so with eta 0 it can no longer be trained and is not
    resubmitted (StaleRollout); with eta 1 it resumes and finishes, and so it does with eta 0 when
    nothing is dropped (rollout.drop_stale=false)."""
    from types import SimpleNamespace

    from realcore.rollout.rollout_worker import RoutedClient, StaleRollout

    params = {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": 300}

    async def fn(client):
        async def watched(_server, call):
            return await call

        stub = SimpleNamespace(cfg=SimpleNamespace(rollout=SimpleNamespace(
            request_retries=0, max_head_offpolicyness=eta, drop_stale=drop_stale)),
                               engine="local", client=lambda _server: client, watched=watched)
        routed = RoutedClient(stub, 0, server["http"])
        before = await client.server_info()
        job = asyncio.ensure_future(generate_resumable(routed, PROMPT, params, rid=f"doomed-{eta}-{drop_stale}"))
        await wait_until(client, lambda i: i["decode_steps"] >= before["decode_steps"] + 30)
        await client.update_weights_from_disk(models["B"], "1", abort_all_requests=True)
        try:
            return await job, routed.stale
        except StaleRollout as e:
            return e, routed.stale
        finally:
            await restore_a(client, models)

    got, stale = drive(server, fn)
    if eta == 0 and drop_stale:
        assert isinstance(got, Exception) and stale, got
    else:
        assert not stale and got.n_segments == 2 and len(got.output_ids) == 300 and (got.version_start, got.version_end) == (0, 1)


def test_rollout_worker_counts_staleness_from_the_first_token(server, models):
    """A request still queued (the batch full) when an update aborts everything comes back with no
    tokens, tagged with the old version 0. It generated nothing with it: its rollout's staleness
    starts at version 1, where its first token comes from, so with eta 1 it survives the next
    update (to version 2) and finishes. Counted from the empty reply it was doomed there (2 - 0 > 1)
    and cancelled, though the stream would have trained it."""
    from types import SimpleNamespace

    from realcore.rollout.rollout_worker import RoutedClient

    long = {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": 300}
    replies = []

    async def fn(client):
        async def watched(_server, call):
            reply = await call
            replies.append((reply.finish_reason, len(reply.output_ids), reply.weight_version))
            return reply

        stub = SimpleNamespace(cfg=SimpleNamespace(rollout=SimpleNamespace(request_retries=0, max_head_offpolicyness=1, drop_stale=True)),
                               engine="local", client=lambda _server: client, watched=watched)
        routed = RoutedClient(stub, 0, server["http"])
        fill = [asyncio.ensure_future(client.generate(PROMPT, long, rid=f"fill-{i}")) for i in range(8)]  # max batch 8
        await wait_until(client, lambda i: i["num_running_reqs"] == 8)
        job = asyncio.ensure_future(generate_resumable(routed, PROMPT, long, rid="queued"))
        await wait_until(client, lambda i: i["num_requests"] == 9)  # it waits for a slot
        await client.update_weights_from_disk(models["B"], "1", abort_all_requests=True)
        await asyncio.gather(*fill)  # aborted, not resubmitted: the queued request gets a slot
        before = await client.server_info()
        await wait_until(client, lambda i: i["decode_steps"] >= before["decode_steps"] + 30)
        await client.update_weights_from_disk(models["A"], "2", abort_all_requests=True)
        try:
            return await job, routed.stale
        finally:
            await restore_a(client, models)

    traj, stale = drive(server, fn)
    assert replies[0] == ("abort", 0, "0")  # queued through the first update: no tokens
    assert not stale and len(traj.output_ids) == 300 and (traj.version_start, traj.version_end) == (1, 2), replies


def test_a_retried_episode_counts_staleness_from_its_own_tokens(server, models):
    """RolloutWorker.episode with the real server: attempt 0 generates at version 0 and raises;
    the server moves to version 2; attempt 1 generates everything again and is interrupted by
    the update to version 3. With eta 1 its rollout is trainable (3 - 2): attempt 0's tokens,
    thrown away with it, must not make it doomed (3 - 0), which cancelled it as stale."""
    from types import SimpleNamespace

    from realcore.api.workflow import TrajectoryBuilder
    from realcore.rollout.rollout_worker import RolloutWorker

    long = {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": 300}

    async def fn(client):
        attempts = []

        async def workflow(engine, data):
            attempts.append(len(attempts))
            if len(attempts) == 1:
                await engine.agenerate(PROMPT, max_new_tokens=5)  # version 0
                for v in ("1", "2"):
                    await client.update_weights_from_disk(models["B" if v == "1" else "A"], v)
                raise RuntimeError("attempt 0 fails after generating")
            before = await client.server_info()

            async def interrupt():
                await wait_until(client, lambda i: i["decode_steps"] >= before["decode_steps"] + 30)
                await client.update_weights_from_disk(models["B"], "3", abort_all_requests=True)

            update = asyncio.ensure_future(interrupt())
            c = await engine.agenerate(PROMPT, max_new_tokens=long["max_new_tokens"], temperature=1.0)
            await update
            traj = TrajectoryBuilder(PROMPT)
            traj.add_completion(c)
            return traj.to_tensors(1.0)

        async def watched(_server, call):
            return await call

        cfg = SimpleNamespace(rollout=SimpleNamespace(request_retries=0, max_head_offpolicyness=1, drop_stale=True, episode_retries=1),
                              generation=GenerationConfig(n_samples=1, max_new_tokens=300, ignore_eos=True))
        worker = SimpleNamespace(index=0, cfg=cfg, engine="local", client=lambda _server: client, watched=watched,
                                 samples=[{"prompt_ids": [torch.tensor(PROMPT)]}], order=SimpleNamespace(index=lambda seq: 0),
                                 tokenizer=load_tokenizer(models["A"]), workflow=workflow, rewards=None,
                                 keys=("input_ids", "loss_mask", "behav_logprobs", "rewards", "version_start", "version_end"))
        try:
            group, _ = await RolloutWorker.episode(worker, 0, server["http"], {})
        finally:
            await restore_a(client, models)
        return group, attempts

    group, attempts = drive(server, fn)
    assert attempts == [0, 1]
    assert isinstance(group, dict), group  # "stale" before: attempt 0's version 0 made it doomed
    assert (int(group["version_start"][0]), int(group["version_end"][0])) == (2, 3)


def test_weight_updates_from_disk_and_memory(server, models):
    params = {**GREEDY, "max_new_tokens": 40}
    state_b = read_hf_weights(models["B"])

    async def gen(client, rid):
        return await client.generate(PROMPT, params, rid=rid)

    async def fn(client):
        a = await gen(client, "w-a")
        await client.update_weights_from_disk(models["B"], "1")
        b = await gen(client, "w-b")
        await client.update_weights_from_disk(models["A"], "2")
        a2 = await gen(client, "w-a2")
        await asyncio.to_thread(push_weights, server["weights"], SECRET, "3", state_b, 10)
        b2 = await gen(client, "w-b2")
        with pytest.raises(ConnectionError, match="CURVE handshake"):  # another secret: it cannot even connect
            await asyncio.to_thread(push_weights, server["weights"], b"x" * 32, "4", state_b, 0.5)
        with pytest.raises(RuntimeError, match="missing"):  # authenticated but incomplete: refused, nothing changed
            partial = {"lm_head.weight": state_b["model.embed_tokens.weight"]}
            await asyncio.to_thread(push_weights, server["weights"], SECRET, "5", partial, 10)
        b3 = await gen(client, "w-b3")
        info = await client.server_info()
        await restore_a(client, models)
        return a, b, a2, b2, b3, info

    a, b, a2, b2, b3, info = drive(server, fn)
    assert b.output_ids != a.output_ids and b.weight_version == "1"
    assert a2.output_ids == a.output_ids and a2.weight_version == "2"
    assert b2.output_ids == b.output_ids and b2.weight_version == "3"
    assert b3.output_ids == b.output_ids and b3.weight_version == "3" and info["drops"].get("weights/handshake", 0) >= 1



@pytest.mark.gpu(1)
def test_on_a_gpu_the_server_serves_bf16_and_updates_land_there(models, forward, tmp_path):
    """device and dtype auto on a GPU: the server reports cuda and bfloat16; a disk update and an
    in-memory one (tensors arrive on the host, float32) land in the GPU's bf16 weights: B's tokens
    after either, and log-probs near B's float32 forward."""
    log = open(tmp_path / "server.log", "w+")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SECRET_HEX": SECRET.hex()}
    script = SERVER.replace(', device="cpu")', ")")  # the defaults: auto, auto
    proc = subprocess.Popen([sys.executable, "-c", script, models["A"], TOKEN, str(MAX_BODY)], stdout=subprocess.PIPE,
                            stderr=log, env=env, text=True)
    try:
        line = proc.stdout.readline()
        if not line:
            log.seek(0)
            pytest.fail(f"server did not start:\n{log.read()[-3000:]}")
        gpu = json.loads(line)
        params = {**GREEDY, "max_new_tokens": 24}

        async def fn(client):
            info = await client.server_info()
            a = await client.generate(PROMPT, params, rid="g-a")
            await client.update_weights_from_disk(models["B"], "1")
            b = await client.generate(PROMPT, params, rid="g-b")
            await client.update_weights_from_disk(models["A"], "2")
            await asyncio.to_thread(push_weights, gpu["weights"], SECRET, "3", read_hf_weights(models["B"]), 30)
            b2 = await client.generate(PROMPT, params, rid="g-b2")
            return info, a, b, b2

        info, a, b, b2 = drive(gpu, fn)
        assert (info["device"], info["dtype"]) == ("cuda", "bfloat16")
        assert b.output_ids != a.output_ids and b2.output_ids == b.output_ids and b2.weight_version == "3"
        errors = (torch.tensor(b2.output_logprobs) - forward("B", PROMPT, b2.output_ids)).abs()
        assert errors.median() < 0.1, errors
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0

def test_every_endpoint_needs_the_token(server, models):
    url = server["http"]
    endpoints = [  # in an order that leaves the server as it was
        ("POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}),
        ("POST", "/update_weights_from_disk", {"model_path": models["A"], "weight_version": "0"}),
        ("POST", "/pause_generation", {"mode": "abort"}),
        ("POST", "/continue_generation", {}),
        ("POST", "/abort_request", {"abort_all": True}),
        ("GET", "/v1/models", None),
        ("GET", "/health", None),
        ("GET", "/get_server_info", None),
        ("POST", "/destroy_weights_update_group", {"group_name": "none"}),
    ]
    wrong = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"Authorization": f"bearer {TOKEN}"},
             {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": "Bearer \u00e9"}]

    async def main():
        for method, path, body in endpoints + [("GET", "/no/such/endpoint", None)]:
            for headers in wrong:
                status, text = await request(method, url + path, headers, body)
                assert status == 401 and "token" in json.loads(text)["error"], (method, path, headers, status, text)
        status, _ = await post(url + "/generate", None, token=None, raw=b"x" * (2 * MAX_BODY))
        assert status == 401  # refused before its body is read
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for method, path, body in endpoints:
            status, text = await request(method, url + path, auth, body)
            assert status == 200, (method, path, status, text)
        status, text = await request("GET", url + "/no/such/endpoint", auth)
        assert status == 404 and "\n" not in json.loads(text)["error"]

    asyncio.run(main())
    with pytest.raises(ValueError, match="needs a token"):
        run_server("/nonexistent")  # on loopback too


def _bad_bodies() -> list[tuple[str, bytes]]:
    """(endpoint, raw body) pairs that must each answer 400; every field of every endpoint is hit."""
    g, w = "/generate", "/update_weights_from_distributed"

    def gen(sp=None, **body):
        return g, json.dumps({"input_ids": PROMPT, **body, **({"sampling_params": sp} if sp is not None else {})}).encode()

    nested = b"[" * 100000 + b"]" * 100000
    return [
        # numbers that overflowed the engine thread, or are not finite, or are out of range
        gen({"top_k": 2**63}), gen({"top_k": "9" * 400}), gen({"top_k": 2**31}), gen({"top_k": -2}),
        (g, b'{"input_ids": [5, 17], "sampling_params": {"temperature": Infinity}}'),
        (g, b'{"input_ids": [5, 17], "sampling_params": {"temperature": NaN}}'),
        (g, b'{"input_ids": [5, 17], "sampling_params": {"temperature": 1e999}}'),
        gen({"temperature": -1}), gen({"temperature": 1e6}), gen({"top_p": 0}), gen({"top_p": 1.5}),
        gen({"max_new_tokens": 10**12}), gen({"max_new_tokens": 2**70}), gen({"max_new_tokens": 0}),
        gen({"max_new_tokens": 4000}),  # prompt + max_new_tokens over the tiny model's context
        # token ids outside the vocabulary, negative, huge
        (g, b'{"input_ids": [1000000]}'), (g, b'{"input_ids": [[1, 2, 1000000000]]}'), (g, b'{"input_ids": [-5]}'),
        (g, b'{"input_ids": [9223372036854775808]}'), gen({"stop_token_ids": [512]}), gen({"stop_token_ids": [-1]}),
        gen({"stop_token_ids": list(range(300))}),
        # not JSON, or JSON nested past the parser's depth limit
        (g, nested), (g, b'{"input_ids": ' + nested + b"}"), (g, b"{not json"), (g, b"\x00\xff" * 100),
        (g, b"1" * 5000), (g, b"[1, 2]"), (g, b'"just a string"'), (g, b"null"),
        # wrong types, field by field
        (g, b'{"input_ids": "abc"}'), (g, b'{"input_ids": [1.5]}'), (g, b'{"input_ids": [true]}'),
        (g, b'{"input_ids": [[1, "a"]]}'), (g, b'{"input_ids": []}'), (g, b'{"input_ids": [[]]}'), (g, b"{}"),
        gen("greedy"), gen({"temperature": "1.0"}), gen({"top_p": "1"}), gen({"top_k": 1.5}), gen({"top_k": True}),
        gen({"max_new_tokens": "8"}), gen({"stop_token_ids": 5}), gen({"ignore_eos": "yes"}), gen({"n": 2}),
        gen({"skip_special_tokens": 1}), gen({"min_p": 0.1}), gen(return_logprob=1), gen(rid=5), gen(rid={"a": 1}),
        gen(rid=""), gen(rid="x" * 1000), gen(stream=True),
        (g, json.dumps({"input_ids": [PROMPT, PROMPT], "rid": ["one"]}).encode()),
        (g, json.dumps({"input_ids": [PROMPT, PROMPT], "rid": ["same", "same"]}).encode()),
        (g, json.dumps({"input_ids": [PROMPT] * 9}).encode()),  # over max_batch_size (8)
        (g, json.dumps({"input_ids": [[1] * 10] * 10000}).encode()),
        # the control endpoints
        ("/update_weights_from_disk", b'{"model_path": 5}'), ("/update_weights_from_disk", b'{"weight_version": "1"}'),
        ("/update_weights_from_disk", b'{"model_path": "/x", "weight_version": 3}'),
        ("/update_weights_from_disk", b'{"model_path": "/x", "load_format": "auto"}'),
        ("/pause_generation", b'{"mode": 5}'), ("/pause_generation", b'{"mode": "later"}'),
        ("/pause_generation", b'{"mode": "abort", "x": 1}'), ("/pause_generation", b"[" * 5000),
        ("/continue_generation", b'{"x": 1}'), ("/continue_generation", b"[1]"),
        ("/abort_request", b"{}"), ("/abort_request", b'{"rid": 5}'), ("/abort_request", b'{"abort_all": "yes"}'),
        # the weight-update group (rollout.weight_update=nccl): refused before any rendezvous or broadcast
        *(("/init_weights_update_group", json.dumps({**init, **bad}).encode()) for init in [
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}] for bad in [
            {"master_port": 0}, {"master_port": 70000}, {"rank_offset": 0}, {"rank_offset": 2}, {"world_size": 1},
            {"backend": "mpi"}, {"group_name": ""}, {"master_address": ""}, {"x": 1}]),
        ("/init_weights_update_group", b"{}"),
        *((w, json.dumps({**upd, **bad}).encode()) for upd in [
            {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]]}] for bad in [
            {"names": []}, {"dtypes": ["float32", "float32"]}, {"shapes": [[-1]]}, {"dtypes": ["complex64"]},
            {"shapes": [[2**40]]}, {"load_format": "auto"}, {"weight_version": 1}, {"flush_cache": "no"}]),
        (w, b'{"names": ["a"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "none"}'),  # no such group
        ("/destroy_weights_update_group", b'{"group_name": 5}'),
    ]


def test_bad_bodies_are_400s_and_the_server_goes_on(server):
    url = server["http"]
    params = {**GREEDY, "max_new_tokens": 30}

    async def chunks():  # no Content-Length: the limit is found while reading
        for _ in range(4):
            yield b"1" * (MAX_BODY // 2)

    async def fn(client):
        before = await client.generate(PROMPT, params, rid="before")
        for path, raw in _bad_bodies():
            status, out = await post(url + path, None, raw=raw)
            message = out.get("error", out.get("message"))
            assert status == 400 and isinstance(message, str) and "\n" not in message and len(message) < 1000, (
                path, raw[:80], status, out)
        status, out = await post(url + "/generate", None, raw=b"[" + b"1," * MAX_BODY + b"1]")
        assert status == 413 and "max_http_body_bytes" in out["error"]
        status, out = await post(url + "/generate", None, raw=chunks())
        assert status == 413 and "max_http_body_bytes" in out["error"]
        info = await client.server_info()
        after = await client.generate(PROMPT, params, rid="after")
        return before, after, info

    before, after, info = drive(server, fn)
    assert after.output_ids == before.output_ids and after.finish_reason == "length"
    assert after.output_logprobs == pytest.approx(before.output_logprobs, abs=1e-5)
    assert info["paused"] is None and info["num_requests"] == 0 and info["weight_version"] == "0"
    assert (info["vocab_size"], info["max_http_body_bytes"]) == (512, MAX_BODY)


def test_batch_generate_matches_single_requests(server):
    url = server["http"]
    prompts = [PROMPT, [7, 3, 250, 11]]
    params = {**GREEDY, "max_new_tokens": 12}

    async def fn(client):
        single = [await client.generate(p, params, rid=f"single-{i}") for i, p in enumerate(prompts)]
        body = {"input_ids": prompts, "rid": ["b-0", "b-1"], "sampling_params": params, "return_logprob": True}
        status, out = await post(url + "/generate", body)
        return single, status, out

    single, status, out = drive(server, fn)
    assert status == 200 and isinstance(out, list) and [o["meta_info"]["id"] for o in out] == ["b-0", "b-1"]
    for one, o in zip(single, out):
        assert o["output_ids"] == one.output_ids
        assert [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] == pytest.approx(one.output_logprobs, abs=1e-4)


def test_engine_thread_fails_only_the_request_that_raises(models):
    """A request that gets past the HTTP validation and raises in the engine thread (top_k = 2**63
    overflowed there and exited the whole run) fails alone; the batch it joined finishes, exactly."""
    import concurrent.futures
    import threading

    from realcore.backends.genserver.commands import RequestFailed, _Generate, _Weights
    from realcore.backends.genserver.engine_loop import EngineLoop

    core = EngineLoop(load_model(models["A"]), load_tokenizer(models["A"]), seed=0)
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()

    def submit(make) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        core.submit(make(lambda v: fut.done() or fut.set_result(v)))
        return fut

    greedy = GenerationConfig(n_samples=1, greedy=True, ignore_eos=True, max_new_tokens=60, max_batch_size=8)
    overflow = greedy.model_copy(update={"greedy": False, "top_k": 2**63})  # as the engine got it before
    try:
        alone = submit(lambda done: _Generate("alone", PROMPT, greedy, True, done)).result(60)
        good = submit(lambda done: _Generate("good", PROMPT, greedy, True, done))
        deadline = time.monotonic() + 30
        while core.stats["decode_steps"] < 70 and time.monotonic() < deadline:  # "good" is decoding
            time.sleep(0.005)
        bad = submit(lambda done: _Generate("bad", [7, 3, 250], overflow, True, done)).result(60)
        assert isinstance(bad, RequestFailed) and "'bad'" in str(bad) and "Overflow" in str(bad), bad
        good = good.result(60)
        assert good["output_ids"] == alone["output_ids"] and good["meta_info"]["finish_reason"]["type"] == "length"
        # A command that raises inside the engine thread (here: weights it cannot copy) fails alone too.
        params = {n: torch.empty(p.shape, device="meta") for n, p in core.model.named_parameters()}
        failed = submit(lambda done: _Weights(params, "9", done)).result(30)
        assert isinstance(failed, RequestFailed) and "meta" in str(failed)
        after = submit(lambda done: _Generate("after", PROMPT, greedy, True, done)).result(60)
        assert after["output_ids"] == alone["output_ids"] and after["meta_info"]["weight_version"] == "0"
        assert thread.is_alive() and core.error is None
    finally:
        core.stopping.set()
        thread.join(30)


def test_engine_honours_ignore_eos(models):
    model, tok = load_model(models["A"]), load_tokenizer(models["A"])
    full = GenerationEngine(model, tok).generate([PROMPT], GenerationConfig(greedy=True, max_new_tokens=12))[0]
    engine = GenerationEngine(model, tok)
    engine.eos_token_id = full.output_ids[3]  # pretend a token of the output is EOS
    first = full.output_ids.index(engine.eos_token_id)
    stopped = engine.generate([PROMPT], GenerationConfig(greedy=True, max_new_tokens=12))[0]
    assert stopped.output_ids == full.output_ids[: first + 1] and stopped.finish_reason == "stop"
    kept = engine.generate([PROMPT], GenerationConfig(greedy=True, max_new_tokens=12, ignore_eos=True))[0]
    assert kept.output_ids == full.output_ids and kept.finish_reason == "length"


def test_client_deadlines_name_the_url():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"

    async def main():
        client = GenClient(url, timeout_s=1)
        try:
            assert not await client.health()
            with pytest.raises(TimeoutError, match=url):
                await client.wait_ready(0.3)
            with pytest.raises(RuntimeError, match=url):
                await client.generate(PROMPT, GREEDY, rid="nobody")
        finally:
            await client.close()

    asyncio.run(main())


def test_a_weight_push_to_a_server_that_is_gone_fails_at_once():
    """A refused connection (the server died, or restarted on another port) ends the push at once,
    not after its connect deadline (30 s by default: the trainer's step waited that long)."""
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"{address} refused the connection"):
        push_weights(address, SECRET, "2", {"w": torch.zeros(4)}, timeout_s=60)
    assert time.monotonic() - t0 < 5


def test_reply_spans_give_each_token_its_version():
    from realcore.backends.clients.sglang_api import parse_generate_reply

    def reply(spans, n=5):
        meta = {"finish_reason": {"type": "length"}, "weight_version": "2", "weight_version_spans": spans,
                "output_token_logprobs": [[-1.0, 7, None]] * n}
        return parse_generate_reply({"output_ids": [7] * n, "meta_info": meta}, return_logprob=True)

    assert reply([[0, "1"], [3, "2"]]).token_versions() == [1, 1, 1, 2, 2]
    assert reply([[0, "default"]]).token_versions() == [0] * 5
    for bad in ([], [[1, "1"]], [[0, "1"], [0, "2"]], [[0, "1"], "x"]):
        with pytest.raises(RuntimeError, match="/generate"):
            reply(bad)
