"""The built-in generation server's HTTP side: SGLang's API (0.5.x) and OpenAI's, over aiohttp, each
handler forwarding one command to the engine thread (realcore.backends.genserver.engine_loop) and
awaiting its result; `run_server` starts the engine thread, the weight receiver and the listener.

Why SGLang's API: the same client (realcore.backends.clients.sglang_api) drives this server in CI and a
real SGLang server on GPUs (docs/engines.md lists the endpoints we mirror). `python -m
realcore.serve` runs it stand-alone, with SGLang's flag names.

Devices (`run_server(device=, dtype=)`, GenerationConfig.device/dtype): the engine runs on the
process's GPU when it sees one (cuda:0 of the CUDA_VISIBLE_DEVICES its launcher gave it), in bf16
by default there, else on the CPU in float32; the log says which once, and `/get_server_info`
reports `device` and `dtype`.

Hardening (docs/security.md): every endpoint, /health included, answers 401 without the bearer
token; a connection whose headers are not complete within `header_timeout_s` is closed
(realcore.backends.http_deadlines), a body not complete within `body_timeout_s` answers 408; bodies
are bounded (`max_body_bytes`, 413) and validated by realcore.backends.http_schemas before the
engine sees them (400, one line); weight files' headers are checked before their tensors are read
(realcore.backends.safetensors_header, through realcore.backends.genserver.weight_intake); a
command or decode step that raises inside the engine thread fails the request(s) at fault (500).

OpenAI's API (docs/openai.md): /v1/chat/completions and /v1/completions run each choice as one
/generate request (so pause, abort and weight updates act on them alike) and answer in OpenAI's
JSON with the token ids and weight version as extra fields (realcore.backends.openai_api).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import torch
from aiohttp import web

from realcore.api.config import GenerationConfig, SystemConfig
from realcore.backends import http_deadlines, http_schemas, lora, openai_api, weight_group
from realcore.backends.device import select_device
from realcore.backends.genserver.commands import (
    CONTROL_TIMEOUT_S, RequestFailed, Unavailable, _Abort, _Adapter, _Continue, _Generate, _Pause, _Version,
    _Weights)
from realcore.backends.genserver.engine_loop import EngineLoop
from realcore.backends.genserver.weight_intake import (
    LoraServing, WeightGroup, WeightsReceiver, check_bucket, join_group, load_initial_adapter, read_disk_update,
    receive_bucket, receive_device)
from realcore.backends.http_schemas import one_line
from realcore.backends.models import load_model, load_tokenizer
from realcore.backends.precision import compute_dtype, resolve_dtype_name
from realcore.transport import wire

log = logging.getLogger(__name__)
DEFAULT_MAX_BODY_BYTES = SystemConfig.model_fields["max_http_body_bytes"].default
DEFAULT_HEADER_TIMEOUT_S = SystemConfig.model_fields["http_header_timeout_s"].default
DEFAULT_BODY_TIMEOUT_S = SystemConfig.model_fields["http_body_timeout_s"].default
DEFAULT_CONNECT_TIMEOUT_S = SystemConfig.model_fields["weight_group_connect_timeout_s"].default
NO_CONTEXT_LIMIT = 1 << 20  # tokens, for a model that declares no max_position_embeddings



def _error(status: int, message: str, path: str = "") -> web.Response:
    if path in openai_api.ROUTES:  # OpenAI's shape, which the openai package reads into its exceptions
        kind = "invalid_request_error" if status < 500 else "server_error"
        return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": None}},
                                 status=status)
    return web.json_response({"error": message}, status=status)


class Server:
    """The aiohttp handlers; each forwards one command to the engine thread and awaits its result."""

    def __init__(self, core: EngineLoop, *, model_path: str, token: str | None, max_batch_size: int,
                 max_body_bytes: int, lora_serving: LoraServing | None = None,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S):
        self.core, self.model_path, self.max_batch_size = core, model_path, max_batch_size
        self.lora_serving = lora_serving or LoraServing()
        self.max_body_bytes, self.body_timeout_s, self.connect_timeout_s = max_body_bytes, body_timeout_s, connect_timeout_s
        self._authorization = f"Bearer {token}".encode() if token else None  # None: run_server checked loopback
        context = getattr(core.model.config, "max_position_embeddings", None) or NO_CONTEXT_LIMIT
        self.limits = http_schemas.Limits(vocab_size=core.model.get_input_embeddings().num_embeddings,
                                          max_context=context, max_batch_size=max_batch_size)
        self.receiver: WeightsReceiver | None = None
        self.host = "127.0.0.1"  # the address run_server serves on: gloo's socket for weight-update groups
        self.groups: dict[str, WeightGroup] = {}  # weight-update groups joined, by name
        self.update_session = False  # SGLang's weight-update session: buckets are received only inside one
        self.shapes = {n: tuple(t.shape) for n, t in core.model.state_dict().items()}  # what a bucket may hold
        self.params = {n for n, _ in core.model.named_parameters()}  # what an update from disk must hold
        self.app = web.Application(middlewares=[http_deadlines.middleware, self._middleware],
                                   client_max_size=max_body_bytes)
        self.app.add_routes([
            web.post("/generate", self.generate),
            web.post("/update_weights_from_disk", self.update_weights_from_disk),
            web.post("/load_lora_adapter", self.load_lora_adapter),
            web.post("/unload_lora_adapter", self.unload_lora_adapter),
            web.post("/update_weight_version", self.update_weight_version),
            web.post("/pause_generation", self.pause_generation),
            web.post("/continue_generation", self.continue_generation),
            web.post("/abort_request", self.abort_request),
            web.post("/init_weights_update_group", self.init_weights_update_group),
            web.post("/update_weights_from_distributed", self.update_weights_from_distributed),
            web.post("/destroy_weights_update_group", self.destroy_weights_update_group),
            web.post("/begin_weight_update", self.begin_weight_update),
            web.post("/end_weight_update", self.end_weight_update),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/completions", self.completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/get_server_info", self.server_info),
            web.get("/model_info", self.model_info),
            web.get("/get_model_info", self.model_info),
        ])  # fmt: skip

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        # Every endpoint, /health included: any local user can reach a loopback port.
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        # Refused requests are counted like refused wire messages (socket "http"): they reach the
        # master's metrics through the manager, which reads /get_server_info.
        if self._authorization is not None and not hmac.compare_digest(given, self._authorization):
            wire.count_dropped("http", "auth", f"{request.method} {request.path}")
            return _error(401, "missing or wrong bearer token (Authorization: Bearer <the run's server token>)",
                          request.path)
        try:
            return await handler(request)
        except web.HTTPException as e:  # aiohttp's own answers: 404, 405, 413 (the body is over the limit); 408
            if e.status < 400:
                raise
            if e.status == 408:  # the body did not arrive in time: the connection is not worth keeping
                wire.count_dropped("http", "slow", request.path)
                slow = _error(408, f"{request.path}: the body was not complete within http_body_timeout_s "
                                   f"({self.body_timeout_s:g} s)", request.path)
                slow.force_close()
                return slow
            if e.status == 413:
                wire.count_dropped("http", "size", request.path)
                too_big = f"{request.path}: the body is larger than max_http_body_bytes ({self.max_body_bytes})"
                return _error(413, too_big, request.path)
            wire.count_dropped("http", "route", f"{request.method} {request.path}")
            return _error(e.status, f"{request.method} {request.path}: {e.reason}", request.path)
        except ValueError as e:  # a bad body, bad parameters, a refused command
            wire.count_dropped("http", "body", f"{request.path}: {one_line(e)[:200]}")
            return _error(400, one_line(e), request.path)
        except Unavailable as e:  # the engine thread stopped or does not answer
            return _error(503, one_line(e), request.path)
        except Exception as e:  # the engine failed this request (RequestFailed) or a bug here: this request only
            if not isinstance(e, RequestFailed):
                log.exception("gen_server: %s %s failed", request.method, request.path)
            return _error(500, one_line(e), request.path)

    async def _read(self, request: web.Request) -> bytes:
        """The body, refused (413) past max_body_bytes before it is read when its length is declared,
        and (408) when it is not complete within body_timeout_s."""
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=self.max_body_bytes, actual_size=request.content_length)
        try:  # aiohttp stops at client_max_size for a chunked body (413)
            return await asyncio.wait_for(request.read(), self.body_timeout_s)
        except asyncio.TimeoutError:
            raise web.HTTPRequestTimeout() from None

    async def _call(self, make: Callable[[Callable[[Any], None]], Any], timeout_s: float | None = CONTROL_TIMEOUT_S):
        """Queue `make(done)` to the engine thread and await what it passes to `done`."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(value) -> None:
            if fut.done():  # cancelled (the client went away), or settled already
                return
            if isinstance(value, BaseException):
                fut.set_exception(value)
            else:
                fut.set_result(value)

        def done(value) -> None:  # called on the engine thread
            try:
                loop.call_soon_threadsafe(settle, value)
            except RuntimeError:  # the loop is closed (shutdown): nobody waits any more
                pass

        self.core.submit(make(done))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise Unavailable(f"gen_server: the engine thread did not answer within {timeout_s:g} s") from None

    async def _generate_one(self, rid: str, ids: list[int], gconfig: GenerationConfig, logprob: bool,
                            adapters: frozenset[str] = frozenset()) -> dict:
        try:
            return await self._call(lambda done: _Generate(rid, ids, gconfig, logprob, done, adapters), timeout_s=None)
        except asyncio.CancelledError:  # the client went away: stop spending steps on it
            if not self.core.stopping.is_set():
                self.core.submit(_Abort(rid, lambda _: None))
            raise

    async def generate(self, request: web.Request) -> web.Response:
        req = http_schemas.parse_generate(await self._read(request), self.limits)
        batch = isinstance(req, http_schemas.BatchGenerateRequest)
        prompts = req.input_ids if batch else [req.input_ids]
        given = (req.rid or [None] * len(prompts)) if batch else [req.rid]
        rids = [rid if rid is not None else os.urandom(8).hex() for rid in given]
        names = req.lora_path if isinstance(req.lora_path, list) else [req.lora_path]
        adapters = frozenset(n for n in names if n is not None)  # None = the weights as they are
        gconfig = req.sampling_params.gconfig(self.limits)
        replies = await self._gather([self._generate_one(rid, ids, gconfig, req.return_logprob, adapters)
                                      for rid, ids in zip(rids, prompts)])
        return web.json_response(replies if batch else replies[0])

    async def _gather(self, requests: list) -> list[dict]:
        jobs = [asyncio.ensure_future(r) for r in requests]
        try:
            return await asyncio.gather(*jobs)
        except BaseException:  # one failed (or the client went away): the other requests stop too
            for job in jobs:
                job.cancel()
            raise

    async def chat_completions(self, request: web.Request) -> web.Response:
        body = http_schemas.parse(http_schemas.ChatCompletionRequest, await self._read(request), request.path,
                                  self.limits)
        tokenizer = self.core.tokenizer
        try:  # off the event loop: templating a long conversation takes a while
            prompt = await asyncio.to_thread(openai_api.chat_prompt, tokenizer, body.template_messages(),
                                             self.limits.vocab_size)
        except ValueError as e:
            raise ValueError(f"{request.path}: {e}") from None
        rid = f"chatcmpl-{os.urandom(12).hex()}"
        choices = await self._choices(rid, [prompt], body, request.path)
        reply = openai_api.chat_response(rid, self.model_path, prompt, choices, tokenizer, logprobs=body.logprobs)
        return web.json_response(reply)

    async def completions(self, request: web.Request) -> web.Response:
        body = http_schemas.parse_completion(await self._read(request), self.limits)
        tokenizer = self.core.tokenizer
        try:
            prompts = [p if isinstance(p, list) else
                       await asyncio.to_thread(openai_api.text_prompt, tokenizer, p, self.limits.vocab_size)
                       for p in body.prompts()]
        except ValueError as e:
            raise ValueError(f"{request.path}: {e}") from None
        rid = f"cmpl-{os.urandom(12).hex()}"
        choices = await self._choices(rid, prompts, body, request.path)
        reply = openai_api.completion_response(rid, self.model_path, prompts, choices, tokenizer,
                                               logprobs=body.logprobs is not None)
        return web.json_response(reply)

    async def _choices(self, rid: str, prompts: list[list[int]], body, path: str) -> list[openai_api.Choice]:
        """`body.n` choices per prompt, each one request on /generate's path (rid `<rid>-<index>`)."""
        try:
            gconfigs = [body.gconfig(len(p), self.limits) for p in prompts]
        except ValueError as e:  # past the model's context
            raise ValueError(f"{path}: {e}") from None
        runs = [(p, g) for p, g in zip(prompts, gconfigs) for _ in range(body.n)]
        replies = await self._gather([self._generate_one(f"{rid}-{i}", p, g, True) for i, (p, g) in enumerate(runs)])
        return [openai_api.choice(self.core.tokenizer, r, body.stops()) for r in replies]

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = http_schemas.parse(http_schemas.UpdateWeightsFromDiskRequest, await self._read(request),
                                      request.path)
            # Off the engine thread (decoding goes on); every file's header is checked before any tensor is read.
            tensors = await asyncio.to_thread(read_disk_update, body.model_path, self.shapes, self.params)
            await self._call(lambda done: _Weights(tensors, body.weight_version, done, abort_all=body.abort_all_requests,
                                                   abort_before=body.abort_started_before))
        except ValueError as e:  # SGLang's shape for a refused update
            wire.count_dropped("http", "body", f"{request.path}: {one_line(e)[:200]}")
            return web.json_response({"success": False, "message": one_line(e)}, status=400)
        self.model_path = body.model_path
        return web.json_response({"success": True, "message": f"loaded {body.model_path}"})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """SGLang's /load_lora_adapter. Unlike SGLang (many adapters, chosen per request by
        lora_path) the built-in server holds one adapter, merged into its weights: every request
        uses it, and loading another replaces it."""
        try:
            body = http_schemas.parse(http_schemas.LoadLoRAAdapterRequest, await self._read(request), request.path)
            # Off the engine thread; the tensors' header is checked against the model before they are read.
            config, tensors = await asyncio.to_thread(lora.read_adapter, body.lora_path, self.shapes,
                                                      self.lora_serving.check)
            await self._call(lambda done: _Adapter(body.lora_name, config, tensors, None, done))
        except ValueError as e:  # SGLang's shape for a refused update
            wire.count_dropped("http", "body", f"{request.path}: {one_line(e)[:200]}")
            return web.json_response({"success": False, "error_message": one_line(e)}, status=400)
        return web.json_response({"success": True, "loaded_adapters": {body.lora_name: body.lora_path}})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """SGLang's /update_weight_version (how a LoRA update, which carries no version, sets one)."""
        body = http_schemas.parse(http_schemas.UpdateWeightVersionRequest, await self._read(request), request.path)
        if body.abort_all_requests:
            await self._call(lambda done: _Abort(None, done))
        await self._call(lambda done: _Version(body.new_version, done, body.abort_started_before))
        return web.json_response({"success": True, "message": f"Weight version updated to {body.new_version}",
                                  "new_version": body.new_version})

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        try:
            body = http_schemas.parse(http_schemas.UnloadLoRAAdapterRequest, await self._read(request), request.path)
            await self._call(lambda done: _Adapter(body.lora_name, None, None, None, done))
        except ValueError as e:
            wire.count_dropped("http", "body", f"{request.path}: {one_line(e)[:200]}")
            return web.json_response({"success": False, "error_message": one_line(e)}, status=400)
        return web.json_response({"success": True, "loaded_adapters": {}})

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        """Join the trainer's weight-update group (realcore.backends.weight_group) as rank
        `rank_offset`; returns once every rank joined. A group of the same name is replaced."""
        body = http_schemas.parse(http_schemas.InitWeightsUpdateGroupRequest, await self._read(request), request.path)
        try:
            receive_device(body.backend, self.core.device)  # refuses nccl on a CPU server before any connect
            # TCPStore retries a refused connect until its timeout (the group's), in C++ that cannot be
            # abandoned: the address is tried first, under its own deadline.
            await weight_group.in_thread(weight_group.wait_listening, body.master_address, body.master_port,
                                         self.connect_timeout_s)
            group = await weight_group.in_thread(join_group, body, self.core.device, self.host, self.connect_timeout_s)
        except Exception as e:  # refused (nccl without CUDA), or the rendezvous failed or timed out
            wire.count_dropped("http", "body", f"{request.path}: {one_line(e)[:200]}")
            return web.json_response({"success": False, "message": one_line(e)}, status=400)
        old = self.groups.pop(body.group_name, None)
        if old is not None:
            old.close()
        self.groups[body.group_name] = group
        return web.json_response({"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset} "
                                                              f"of {body.world_size} ({body.backend})"})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """Receive one bucket broadcast by the trainer (rank 0) and apply it between decode steps,
        as a disk or in-memory update (the reply version changes only if `weight_version` is given:
        the trainer sends it with the last bucket). A failed broadcast leaves the group unusable:
        it is dropped (the trainer builds a new one)."""
        try:
            body = http_schemas.parse(http_schemas.UpdateWeightsFromDistributedRequest, await self._read(request),
                                      request.path)
            if not self.update_session:  # SGLang's rule and words
                raise ValueError("update_weights_from_distributed must run between begin_weight_update() and "
                                 "end_weight_update()")
            group = self.groups.get(body.group_name)
            if group is None:
                raise ValueError(f"no weight-update group {body.group_name!r} (call /init_weights_update_group first)")
            check_bucket(body, self.shapes)
            try:
                tensors = await weight_group.in_thread(receive_bucket, group, body)
            except Exception as e:
                if self.groups.get(body.group_name) is group:
                    self.groups.pop(body.group_name).close()
                raise ValueError(f"the broadcast failed ({one_line(e)}); group {body.group_name!r} dropped") from None
            named = dict(zip(body.names, tensors))
            await self._call(lambda done: _Weights(named, body.weight_version, done, partial=True,
                                                   abort_before=body.abort_started_before))
        except ValueError as e:  # SGLang's shape for a refused update
            wire.count_dropped("http", "body", f"{request.path}: {one_line(e)[:200]}")
            return web.json_response({"success": False, "message": one_line(e)}, status=400)
        return web.json_response({"success": True, "message": f"received {len(body.names)} tensors"})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        http_schemas.parse(http_schemas.BeginWeightUpdateRequest, await self._read(request), request.path)
        if self.update_session:
            return web.json_response({"success": False, "message": "a weight-update session is already open; call "
                                                                   "end_weight_update() first"}, status=400)
        self.update_session = True
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        http_schemas.parse(http_schemas.EndWeightUpdateRequest, await self._read(request), request.path)
        if not self.update_session:
            return web.json_response({"success": False, "message": "no weight-update session is open; call "
                                                                   "begin_weight_update() first"}, status=400)
        self.update_session = False
        return web.json_response({"success": True, "message": "Success"})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = http_schemas.parse(http_schemas.DestroyWeightsUpdateGroupRequest, await self._read(request), request.path)
        group = self.groups.pop(body.group_name, None)
        if group is not None:
            group.close()
        return web.json_response({"success": True, "message": "destroyed" if group else "no such group"})

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = http_schemas.parse(http_schemas.PauseGenerationRequest, await self._read(request), request.path)
        await self._call(lambda done: _Pause(body.mode, done))
        return web.json_response({"success": True})

    async def continue_generation(self, request: web.Request) -> web.Response:
        http_schemas.parse(http_schemas.ContinueGenerationRequest, await self._read(request), request.path)
        await self._call(lambda done: _Continue(done))
        return web.json_response({"success": True})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = http_schemas.parse(http_schemas.AbortRequest, await self._read(request), request.path)
        rid = None if body.abort_all else body.rid
        await self._call(lambda done: _Abort(rid, done))
        return web.json_response({"success": True})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_path, "object": "model"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if not self.core.stopping.is_set() else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        """SGLang's /model_info: where SGLang 0.5.2x reports the weight version."""
        return web.json_response({"model_path": self.model_path, "is_generation": True,
                                  "weight_version": self.core.info()["weight_version"]})

    async def server_info(self, request: web.Request) -> web.Response:
        dropped = self.receiver.dropped if self.receiver is not None else 0
        info = {"model_path": self.model_path, "max_batch_size": self.max_batch_size, "dropped_weight_messages": dropped,
                "max_context": self.limits.max_context, "vocab_size": self.limits.vocab_size,
                "max_http_body_bytes": self.max_body_bytes, "drops": wire.dropped(),
                "weight_update_groups": sorted(self.groups)}
        return web.json_response({**info, **self.core.info()})


# --- entry point ----------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or "localhost") is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: not known to be loopback
        return False


def run_server(
    model_path: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    seed: int = 0,
    max_batch_size: int = 64,
    token: str | None = None,
    secret: bytes | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    limits: wire.Limits | None = None,
    on_ready: Callable[[dict], None] | None = None,
    stop_on_sigterm: bool = True,
    no_token_on_loopback: bool = False,
    lora_serving: LoraServing | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> None:
    """Serve `model_path` until SIGTERM (returns), SystemExit or KeyboardInterrupt (propagate).

    `token` is required: every endpoint answers 401 without `Authorization: Bearer <token>`
    (realcore passes realcore.backends.server_launch.server_token). The one exception is the
    stand-alone server (`python -m realcore.serve`, as SGLang without --api-key): with
    `no_token_on_loopback`, a loopback `host` may serve without a token. Bodies over
    `max_body_bytes` answer 413, bodies not complete within `body_timeout_s` 408; a connection
    whose request headers are not complete within `header_timeout_s` is closed
    (realcore.backends.http_deadlines); `connect_timeout_s`: /init_weights_update_group's connect. `on_ready({"http": "http://host:port", "weights": "tcp://host:port"
    or None})` is called once listening; "weights" is the in-memory update socket, present when
    `secret` is given. `lora_serving`: SGLang's LoRA flags (an adapter loaded before serving).
    `device` (GenerationConfig.device): auto, cpu or cuda (the process's GPU, or a one-line
    ValueError without one). `dtype` (GenerationConfig.dtype): the engine's weights; auto: bfloat16
    on a GPU, float32 on a CPU."""
    if not token and not (no_token_on_loopback and is_loopback(host)):
        raise ValueError("gen_server: needs a token (every endpoint answers 401 without it; realcore derives one "
                         "from the run's secret, or takes rollout.server_token)")
    if max_batch_size <= 0:
        raise ValueError(f"gen_server: max_batch_size must be > 0, got {max_batch_size}")
    if max_body_bytes <= 0:
        raise ValueError(f"gen_server: max_body_bytes must be > 0, got {max_body_bytes}")
    for key, value in (("header_timeout_s", header_timeout_s), ("body_timeout_s", body_timeout_s),
                       ("connect_timeout_s", connect_timeout_s)):
        if not value > 0:
            raise ValueError(f"gen_server: {key} must be > 0, got {value}")
    on = select_device(device)  # before any CUDA tensor; ValueError: cuda asked of a process without a GPU
    dtype = resolve_dtype_name(dtype, on)
    # A GPU holds the whole model in `dtype` (loaded so: no float32 copy on the GPU); a CPU loads
    # float32 and the engine converts what its bf16 mode runs in bf16.
    weights = compute_dtype(dtype, on) if on.type != "cpu" else torch.float32
    log.info("gen_server: the engine runs on %s in %s%s", on, dtype,
             " (decoder linears; the rest float32)" if on.type == "cpu" and dtype == "bfloat16" else "")
    core = EngineLoop(load_model(model_path, device=on, dtype=weights), load_tokenizer(model_path), seed=seed,
                      dtype=dtype)
    if lora_serving is not None and lora_serving.initial is not None:
        load_initial_adapter(core, lora_serving)
    server = Server(core, model_path=model_path, token=token, max_batch_size=max_batch_size, max_body_bytes=max_body_bytes,
                    lora_serving=lora_serving, body_timeout_s=body_timeout_s, connect_timeout_s=connect_timeout_s)
    server.host = host
    engine_thread = threading.Thread(target=core.run, name="gen_server-engine", daemon=True)
    engine_thread.start()
    try:
        if secret is not None:
            server.receiver = WeightsReceiver(core, host, secret, limits)
            server.receiver.thread.start()
        asyncio.run(_serve(server, host, port, on_ready, stop_on_sigterm, header_timeout_s))
    finally:
        core.stopping.set()
        engine_thread.join(timeout=30)
        if server.receiver is not None:
            server.receiver.thread.join(timeout=5)
    if core.error is not None:
        raise RuntimeError("gen_server: the engine thread failed (see the log above)") from core.error


async def _serve(server: Server, host: str, port: int, on_ready: Callable[[dict], None] | None,
                 stop_on_sigterm: bool = True, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if stop_on_sigterm and threading.current_thread() is threading.main_thread():
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    # handler_cancellation: a client that hangs up cancels its handler, which aborts its request (as SGLang).
    # lingering_time: how long an answered request's unread body (a 401's) is discarded before the close.
    runner = web.AppRunner(server.app, access_log=None, handler_cancellation=True, shutdown_timeout=5,
                           lingering_time=min(10.0, server.body_timeout_s))
    await runner.setup()
    listener = None
    try:
        # Not aiohttp's TCPSite: each connection is wrapped in the header deadline's watchdog.
        listener = await http_deadlines.listen(runner.server, host, port, header_timeout_s)
        bound_port = listener.sockets[0].getsockname()[1]
        weights = server.receiver.address if server.receiver is not None else None
        log.info("gen_server: serving %s on http://%s:%d (weights: %s)", server.model_path, host, bound_port, weights)
        if on_ready is not None:
            on_ready({"http": f"http://{host}:{bound_port}", "weights": weights})
        while not stop.is_set() and not server.core.stopping.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.5)  # also watch the engine thread
            except asyncio.TimeoutError:
                pass
    finally:
        server.core.stopping.set()  # the engine thread fails pending requests, so their handlers answer 503 now
        if listener is not None:
            listener.close()  # no new connections; runner.cleanup shuts the open ones
        await runner.cleanup()