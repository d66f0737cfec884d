"""`GenClient`: an async client of SGLang's HTTP API, for the built-in server
(realcore.backends.genserver.server, engine `local`) and, as `SGLangClient`, a real SGLang server
(engine `sglang`); both register here with their capabilities. Plus `generate_resumable`,
which survives interruptions by weight updates, and `push_weights`, the in-memory weight update of
the built-in server. The weight-update group calls (`init_weights_update_group`,
`update_weights_from_distributed`) are SGLang's, served by the built-in server too (docs/weight-update.md).

Interruptible generation (as AReaL): a weight update pauses the servers with mode "abort", so
running requests come back early with finish_reason "abort" and their partial output.
`generate_resumable` then resubmits prompt + output so far (the server recomputes the prefix with
the new weights), stitching token ids, log-probs and per-token versions, until stop or length.

Every call has a deadline: generation and weight updates `timeout_s`, the other calls
`CONTROL_TIMEOUT_S`. Errors: TimeoutError for a missed deadline, RuntimeError for an HTTP error or
an answer that breaks the API, ValueError for bad arguments.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from realcore.api.generation import Capabilities
from realcore.api.registry import register_engine
from realcore.backends.lora import LORA_NAME, is_adapter_dir
from realcore.backends.server_launch import sglang_available, sglang_command, wait_http_ready
from realcore.transport import wire

if TYPE_CHECKING:  # the manager uses this module and never makes a tensor
    import aiohttp
    import torch

CONTROL_TIMEOUT_S = 30.0
FINISH_REASONS = ("stop", "length", "abort")
PAUSE_MODES = ("abort", "retract", "in_place", "hold")  # http_schemas' (which imports torch)


@dataclass
class GenReply:
    output_ids: list[int]
    output_logprobs: list[float]  # empty unless return_logprob
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str | None  # the server's weight version when the reply was made
    # (first token index, version) spans, when the server says which version sampled each token
    # (the built-in server's weight_version_spans: an in-flight update changed the weights under a
    # running request). None: every token is from weight_version (SGLang, vLLM).
    version_spans: list[tuple[int, str]] | None = None

    def token_versions(self) -> list[int]:
        """The version of each output token, as realcore's integer versions."""
        if self.version_spans is None:
            return [version_number(self.weight_version)] * len(self.output_ids)
        n, spans = len(self.output_ids), self.version_spans
        out: list[int] = []
        for k, (start, v) in enumerate(spans):
            end = spans[k + 1][0] if k + 1 < len(spans) else n
            out += [version_number(v)] * max(0, min(end, n) - start)
        return out


@dataclass
class Trajectory:
    """One continuation stitched across interruptions."""

    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]  # per token: the weight version that sampled it
    version_start: int  # version of the first token (of the last segment if none)
    version_end: int  # version of the last segment
    finish_reason: str  # "stop" | "length"
    n_segments: int


def parse_generate_reply(data: Any, *, return_logprob: bool) -> GenReply:
    """SGLang's /generate answer -> GenReply; RuntimeError if it does not have SGLang's shape."""
    try:
        meta = data["meta_info"]
        ids = [int(t) for t in data["output_ids"]]
        reason = meta["finish_reason"]["type"]
        logprobs = [float(x[0]) for x in meta["output_token_logprobs"]] if return_logprob else []
        version = meta.get("weight_version")
        spans = meta.get("weight_version_spans")
        spans = None if spans is None else [(int(i), str(v)) for i, v in spans]
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise RuntimeError(f"/generate: unexpected answer ({e!r}): {data!r:.300}") from None
    if reason not in FINISH_REASONS or (return_logprob and len(logprobs) != len(ids)):
        raise RuntimeError(f"/generate: finish_reason {reason!r}, {len(logprobs)} log-probs for {len(ids)} tokens")
    if spans is not None and (not spans or spans[0][0] != 0 or any(a[0] >= b[0] for a, b in zip(spans, spans[1:]))):
        raise RuntimeError(f"/generate: weight_version_spans {spans!r}: indices must start at 0 and increase")
    return GenReply(ids, logprobs, reason, None if version is None else str(version), spans)


def sampling_params(gconfig) -> dict:
    """GenerationConfig -> SGLang sampling_params (temperature 0 means greedy there)."""
    return {
        "temperature": 0.0 if gconfig.greedy else gconfig.temperature,
        "top_p": gconfig.top_p,
        "top_k": gconfig.top_k if gconfig.top_k > 0 else -1,
        "max_new_tokens": gconfig.max_new_tokens,
        "stop_token_ids": list(gconfig.stop_token_ids),
        "ignore_eos": gconfig.ignore_eos,
    }


@register_engine("local")
class GenClient:
    """One server speaking SGLang's API. Create and use it inside one event loop.

    `token`: the server's bearer token (a run's: realcore.backends.server_launch.server_token),
    sent on every call, health and readiness probes included (docs/security.md). `lora` (a LoRA
    run): the requests name adapter LORA_NAME where the engine's capabilities say so (SGLang);
    `lora_name` names one explicitly."""

    # The built-in server: realcore's own worker, every weight route, versions per token, drops.
    capabilities = Capabilities(weight_updates=frozenset({"disk", "memory", "nccl"}), lora=True,
                                inflight_weight_update=True, reports_drops=True, own_worker=True)

    def __init__(self, base_url: str, *, token: str | None = None, timeout_s: float = 600.0,
                 lora_name: str | None = None, lora: bool = False):
        self.base_url = base_url.rstrip("/")
        if lora_name is None and lora and self.capabilities.names_adapter:
            lora_name = LORA_NAME
        self.lora_name = lora_name  # LoRA runs: every /generate names the adapter (SGLang's lora_path)
        self.token = token
        self.timeout_s = float(timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def generate(
        self, input_ids: list[int], sampling_params: dict, *, rid: str, return_logprob: bool = True
    ) -> GenReply:
        body = {"input_ids": list(input_ids), "sampling_params": sampling_params, "return_logprob": return_logprob}
        body["rid"] = rid
        if self.lora_name is not None:
            body["lora_path"] = self.lora_name
        data = await self._request("POST", "/generate", body, self.timeout_s)
        return parse_generate_reply(data, return_logprob=return_logprob)

    async def update_weights_from_disk(self, path: str, version, *, abort_all_requests: bool = False,
                                       abort_started_before: int | None = None) -> None:
        """Load the HF weights in `path` (a directory the server can read); tag them `version`.
        A LoRA adapter folder (adapter_config.json) is loaded as adapter `lora_name` instead.
        `abort_all_requests` (SGLang's field): running requests end with their output so far as the
        weights change, without a pause (the built-in server reads the files while it decodes).
        `abort_started_before` (the built-in server's): only those whose first token came from a
        version below it end."""
        if is_adapter_dir(path):
            if abort_all_requests:
                raise ValueError(f"update_weights_from_disk({path!r}): abort_all_requests with a LoRA adapter; "
                                 "pause the server instead")
            await self.load_lora_adapter(self.lora_name or LORA_NAME, path, version, abort_started_before)
            return
        body = {"model_path": path, "weight_version": str(version)}
        if abort_all_requests:
            body["abort_all_requests"] = True
        if abort_started_before is not None:
            body["abort_started_before"] = int(abort_started_before)
        data = await self._request("POST", "/update_weights_from_disk", body, self.timeout_s)
        if not data.get("success"):
            raise RuntimeError(f"update_weights_from_disk({path!r}) failed: {data.get('message')}")

    async def load_lora_adapter(self, name: str, path: str, version=None,
                                abort_started_before: int | None = None) -> None:
        """SGLang's /load_lora_adapter, after /unload_lora_adapter of the same name (SGLang refuses
        to load a name twice; an unload of a name not loaded fails and is ignored); then, as a
        LoRA load carries no version, /update_weight_version to `version` (if given), with
        `abort_started_before` (the built-in server's, as in update_weights_from_disk)."""
        try:
            await self._request("POST", "/unload_lora_adapter", {"lora_name": name}, self.timeout_s)
        except RuntimeError:  # not loaded (the first update, or a restarted server)
            pass
        body = {"lora_name": name, "lora_path": path}
        await self._post_ok("/load_lora_adapter", body, f"load_lora_adapter({name!r}, {path!r})", "error_message")
        if version is not None:  # the manager paused the server already: nothing in flight to abort
            body = {"new_version": str(version), "abort_all_requests": False}
            if abort_started_before is not None:  # in flight: the held requests too stale to be trained end
                body["abort_started_before"] = int(abort_started_before)
            await self._post_ok("/update_weight_version", body, f"update_weight_version({version!r})")

    async def _post_ok(self, path: str, body: dict, what: str, message_key: str = "message") -> None:
        """POST `body`; RuntimeError naming `what` unless the server answers success (SGLang's reply form)."""
        data = await self._request("POST", path, body, self.timeout_s)
        if not data.get("success"):
            raise RuntimeError(f"{what} failed: {data.get(message_key)}")

    async def unload_lora_adapter(self, name: str) -> None:
        await self._post_ok("/unload_lora_adapter", {"lora_name": name}, f"unload_lora_adapter({name!r})",
                            "error_message")

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None:
        """Make the server join a trainer's weight-update group (realcore.backends.weight_group);
        returns when every rank joined, so call it concurrently with the trainer's own join."""
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}
        await self._post_ok("/init_weights_update_group", body, f"init_weights_update_group({group_name!r})")

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, version=None, flush_cache: bool = True,
                                              abort_started_before: int | None = None) -> None:
        """Receive one bucket that rank 0 of `group_name` broadcasts now, tensor by tensor in this
        order; `version` (send it with the last bucket) becomes the server's weight version, and
        `abort_started_before` (the built-in server's, with the last bucket too) ends the running
        requests whose first token came from an older version (as in update_weights_from_disk)."""
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name, "flush_cache": flush_cache}
        if version is not None:
            body["weight_version"] = str(version)
        if abort_started_before is not None:
            body["abort_started_before"] = int(abort_started_before)
        await self._post_ok("/update_weights_from_distributed", body, f"update_weights_from_distributed({group_name!r})")

    async def begin_weight_update(self) -> None:
        """SGLang's weight-update session (0.5.2x): buckets of update_weights_from_distributed are
        accepted only between begin_weight_update and end_weight_update."""
        await self._post_ok("/begin_weight_update", {}, "begin_weight_update")

    async def end_weight_update(self) -> None:
        await self._post_ok("/end_weight_update", {}, "end_weight_update")

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._request("POST", "/destroy_weights_update_group", {"group_name": group_name}, CONTROL_TIMEOUT_S)

    async def pause(self, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause: mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        await self._request("POST", "/pause_generation", {"mode": mode}, CONTROL_TIMEOUT_S)

    async def resume(self) -> None:
        await self._request("POST", "/continue_generation", {}, CONTROL_TIMEOUT_S)

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request (its generate returns the partial output, finish_reason abort), or all."""
        body = {"abort_all": True} if rid is None else {"rid": rid}
        await self._request("POST", "/abort_request", body, CONTROL_TIMEOUT_S)

    async def server_info(self) -> dict:
        return await self._request("GET", "/get_server_info", None, CONTROL_TIMEOUT_S)

    def assume_version(self, version: int) -> None:
        """Nothing to assume: every reply says its version (capabilities.reports_versions)."""

    async def weight_version(self):
        """The version the server holds, as it reports it: SGLang 0.5.2x in /model_info (its
        /get_server_info no longer has it)."""
        return (await self._request("GET", "/model_info", None, CONTROL_TIMEOUT_S)).get("weight_version")

    async def health(self, timeout_s: float = CONTROL_TIMEOUT_S) -> bool:
        import aiohttp  # why: here, not at the top: the manager registers engines at start and needs no HTTP until it talks to a server

        try:
            async with (await self._sess()).get(
                self.base_url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def wait_ready(self, timeout_s: float) -> None:
        """Poll /v1/models until it answers 200; TimeoutError naming the url after `timeout_s`."""
        await wait_http_ready(self.base_url, timeout_s=timeout_s, token=self.token)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _sess(self) -> aiohttp.ClientSession:
        import aiohttp  # why: here, not at the top: the manager registers engines at start and needs no HTTP until it talks to a server
        # Lazily: a session belongs to the loop it is made in. No connection limit, so control
        # calls (pause, abort) never queue behind long generations.
        if self._session is None:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            self._session = aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def _request(self, method: str, path: str, body: dict | None, timeout_s: float) -> Any:
        import aiohttp  # why: here, not at the top: the manager registers engines at start and needs no HTTP until it talks to a server
        url = self.base_url + path
        try:
            session = await self._sess()
            async with session.request(method, url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                text = await r.text()
        except asyncio.TimeoutError:
            raise TimeoutError(f"{url} did not answer within {timeout_s:g} s") from None
        except aiohttp.ClientError as e:
            raise RuntimeError(f"{url}: {type(e).__name__}: {e}") from None
        if r.status != 200:
            raise RuntimeError(f"{url} answered HTTP {r.status}: {text[:300]}")
        return json.loads(text) if text else {}


@register_engine("sglang", command=sglang_command, available=sglang_available)
class SGLangClient(GenClient):
    """A real SGLang server (started by `server_launch.sglang_command`)."""

    capabilities = Capabilities(weight_updates=frozenset({"disk", "nccl"}), lora=True, names_adapter=True)


def version_number(weight_version) -> int:
    """A reply's weight version as an int; SGLang's initial "default" (and None) is version 0."""
    if weight_version in (None, "default"):
        return 0
    try:
        return int(weight_version)
    except ValueError:
        raise ValueError(f"weight_version {weight_version!r} is not an integer (realcore versions count steps)") from None


async def generate_resumable(
    client, prompt_ids: list[int], sampling_params: dict, *, rid: str, max_segments: int = 100
) -> Trajectory:
    """Generate until stop or length, resubmitting prompt + output so far whenever a segment is
    aborted (a weight update interrupted it). Segment k > 0 runs as request `{rid}.{k}` with
    max_new_tokens reduced by what is already generated."""
    budget = int(sampling_params.get("max_new_tokens", 128))
    ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    first = None
    for k in range(max_segments):
        params = {**sampling_params, "max_new_tokens": budget - len(ids)}
        seg_rid = rid if k == 0 else f"{rid}.{k}"
        reply = await client.generate(prompt_ids + ids, params, rid=seg_rid, return_logprob=True)
        version = version_number(reply.weight_version)
        seg_versions = reply.token_versions()
        if first is None and seg_versions:  # an empty segment (queued through an update) generated nothing
            first = seg_versions[0]
        ids += reply.output_ids
        logprobs += reply.output_logprobs
        versions += seg_versions
        reason = reply.finish_reason
        if reason == "abort" and len(ids) >= budget:
            reason = "length"  # interrupted exactly at the end
        if reason != "abort":
            return Trajectory(ids, logprobs, versions, version if first is None else first, version, reason, k + 1)
    raise RuntimeError(f"generate_resumable: request {rid!r} was aborted {max_segments} times; giving up")


def push_weights(
    address: str, secret: bytes, version: str, state_dict: dict[str, torch.Tensor], timeout_s: float,
    connect_timeout_s: float = CONTROL_TIMEOUT_S, limits: wire.Limits | None = None, lora: dict | None = None,
    abort_all_requests: bool = False, abort_started_before: int | None = None,
) -> None:
    """Send weights to a built-in server's in-memory update socket (`on_ready(...)["weights"]`)
    and wait until they are applied. The tensors must stay unchanged until this returns (zero-copy).
    Tensors on a GPU are copied to the host here: a caller pushing one state to several servers
    copies it to the host once beforehand (model_worker.publish_weights); host tensors are not copied.
    `lora` ({"name", "config": adapter_config.json's fields}): the tensors are a LoRA adapter (PEFT's
    names), which the server loads as /load_lora_adapter would. `abort_all_requests`: the server's
    running requests end (output so far, old version) as the weights change, so it decodes while
    the tensors travel instead of waiting paused. `abort_started_before`: only the requests whose
    first token came from a version below it end (an in-flight update's too-stale rollouts).

    A server that is gone fails fast instead of at `timeout_s`: ConnectionError when nothing
    listens at `address` (refused: it died, or restarted on another port), when no connection is
    made within `connect_timeout_s`, or when the connection drops before the reply (a socket
    monitor sees the disconnect)."""
    names = list(state_dict)
    tensors = [state_dict[n].detach().cpu() for n in names]
    endpoint = wire.Endpoint(secret, "push_weights", socket="weights_reply", limits=limits)  # the reply is addressed to it
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    wire.set_max_size(sock, endpoint.limits.max_control_message_bytes)
    wire.secure(sock, secret, server=False, limits=endpoint.limits)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only on a live connection: POLLOUT means one is up
    sock.setsockopt(zmq.SNDTIMEO, int(connect_timeout_s * 1000))  # should it drop before the send
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | _HANDSHAKE_FAILED)
    try:
        sock.connect(address)
        _wait_connected(sock, monitor, address, connect_timeout_s)
        header = {"version": str(version), "names": names, **({"lora": lora} if lora is not None else {}),
                  **({"abort_all_requests": True} if abort_all_requests else {}),
                  **({"abort_started_before": int(abort_started_before)} if abort_started_before is not None else {})}
        try:
            wire.send(sock, header, tensors, endpoint=endpoint, to=address, zero_copy=True)
        except zmq.Again:
            raise ConnectionError(f"push_weights: no connection to {address} within {connect_timeout_s:g} s") from None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        if not (ready := dict(poller.poll(int(timeout_s * 1000)))):
            raise TimeoutError(f"wire.recv: no message on the weights reply from {address} within {timeout_s:g} s")
        if sock not in ready:
            recv_monitor_message(monitor)
            raise ConnectionError(f"push_weights: {address} closed the connection before it answered")
        _, header, _ = wire.recv(sock, endpoint=endpoint)
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close()
    if not header.get("ok"):
        raise RuntimeError(f"push_weights to {address} failed: {header.get('error')}")


_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def _wait_connected(sock: zmq.Socket, monitor: zmq.Socket, address: str, timeout_s: float) -> None:
    """Until `sock` (IMMEDIATE) has a live connection. Why not just wait: the address comes from a
    server that was ready, so a refused connection means it is gone, and waiting out `timeout_s`
    stalled the trainer's step that long (30 s) whenever a server died; its restart is caught up
    separately."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLOUT)
    poller.register(monitor, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        ready = dict(poller.poll(int(left * 1000) + 1))
        if sock in ready:
            return
        event = recv_monitor_message(monitor)["event"] if monitor in ready else None
        if event is not None and event & _HANDSHAKE_FAILED:  # before the retry it causes
            raise ConnectionError(f"push_weights: {address} refused the CURVE handshake (another run's server, "
                                  "or one whose system.wire_curve differs)")
        if event == zmq.EVENT_CONNECT_RETRIED:
            raise ConnectionError(f"push_weights: {address} refused the connection (nothing listens there)")
    raise ConnectionError(f"push_weights: no connection to {address} within {timeout_s:g} s")
