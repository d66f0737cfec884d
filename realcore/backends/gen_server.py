"""The built-in generation engine behind an HTTP server that speaks SGLang's API (0.5.x).

Why SGLang's API: the same client (realcore.backends.gen_client) drives this server in CI and a
real SGLang server on GPUs (shared/notes/inference-engines.md lists the endpoints we mirror).

Threads: one engine thread owns the model. It takes commands (new requests, aborts, pauses,
weight updates) from a thread-safe queue between decode steps, so new requests join the running
batch (continuous batching) and weights change only at a token boundary. Results go back to the
asyncio side through `loop.call_soon_threadsafe`. With a `secret`, a ZeroMQ ROUTER thread receives
in-memory weight updates (realcore.system.wire: HMAC-checked, unauthenticated messages dropped
and counted) and queues them to the engine thread like a disk update.

Pause modes (SGLang's): `abort` returns every running request now (partial output, finish_reason
abort); `retract` holds them and drops their KV cache, so on continue they resume from
prompt + output so far with the weights current then; `in_place` stops decoding and keeps the KV
cache (a weight update is refused while it holds requests). Requests that arrive while paused
wait for continue. A weight update without a pause is applied between two decode steps; running
requests then continue on their old KV cache, and their reply carries the new version (as SGLang).

Dependency note: backends must not import realcore.system; the wire module is the one exception.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import ipaddress
import logging
import os
import queue
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import zmq
from aiohttp import web

from realcore.api.config import GenerationConfig
from realcore.api.engine import GenerationResult
from realcore.backends.generation import GenerationEngine, read_hf_weights
from realcore.backends.models import load_model, load_tokenizer
from realcore.system import wire

log = logging.getLogger(__name__)
PAUSE_MODES = ("abort", "retract", "in_place")
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
SGLANG_SAMPLING_EPS = 1e-6  # SGLang treats a temperature below this as greedy
# Sampling params that only shape SGLang's text output (we return token ids) are accepted and ignored.
_TEXT_ONLY_PARAMS = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
CONTROL_TIMEOUT_S = 60.0  # a control command waits for at most one decode step; this is generous
_IDLE_POLL_S = 0.05


# --- commands to the engine thread (each carries `done`, called once with a result or an exception) ---


@dataclass
class _Generate:
    rid: str
    input_ids: list[int]
    gconfig: GenerationConfig
    return_logprob: bool
    done: Callable[[Any], None]


@dataclass
class _Abort:
    rid: str | None  # None = all
    done: Callable[[Any], None]


@dataclass
class _Pause:
    mode: str
    done: Callable[[Any], None]


@dataclass
class _Continue:
    done: Callable[[Any], None]


@dataclass
class _Weights:
    tensors: dict[str, torch.Tensor]
    version: str | None
    done: Callable[[Any], None]


# --- request parsing ------------------------------------------------------------------------------


def _one_line(e: Exception) -> str:
    errors = getattr(e, "errors", None)  # pydantic: one entry per field, joined on one line
    if callable(errors):
        return "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in errors())
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def parse_generate(
    body: Any, *, vocab_size: int, max_batch_size: int
) -> tuple[str | None, list[int], GenerationConfig, bool]:
    """SGLang's /generate body -> (rid, input_ids, GenerationConfig, return_logprob); ValueError if bad."""
    if not isinstance(body, dict):
        raise ValueError("generate: the body must be a JSON object")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
        raise ValueError(f"generate: input_ids must be a non-empty list of token ids in [0, {vocab_size})")
    rid, logprob, sp = body.get("rid"), body.get("return_logprob", False), body.get("sampling_params", {})
    if rid is not None and not isinstance(rid, str):
        raise ValueError("generate: rid must be a string")
    if not isinstance(logprob, bool) or not isinstance(sp, dict):
        raise ValueError("generate: return_logprob must be a bool and sampling_params an object")
    sp = {k: v for k, v in sp.items() if k not in _TEXT_ONLY_PARAMS and v is not None}
    if sp.pop("n", 1) != 1:
        raise ValueError("generate: sampling_params.n must be 1 (send one request per sample)")
    temperature = sp.pop("temperature", 1.0)
    if type(temperature) not in (int, float) or temperature < 0:
        raise ValueError(f"generate: sampling_params.temperature must be a number >= 0, got {temperature!r}")
    greedy = temperature < SGLANG_SAMPLING_EPS
    top_k = sp.pop("top_k", -1)
    fields = {
        "temperature": 1.0 if greedy else temperature,
        "greedy": greedy,
        "top_k": 0 if top_k in (-1, 0) else top_k,  # SGLang disables top-k with -1, realcore with 0
        "top_p": sp.pop("top_p", 1.0),
        "max_new_tokens": sp.pop("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS),
        "stop_token_ids": sp.pop("stop_token_ids", []),
        "ignore_eos": sp.pop("ignore_eos", False),
    }
    if sp:
        raise ValueError(f"generate: sampling_params {sorted(sp)} are not supported by the built-in server")
    try:
        gconfig = GenerationConfig(n_samples=1, max_batch_size=max_batch_size, **fields)
    except ValueError as e:
        raise ValueError(f"generate: bad sampling_params: {_one_line(e)}") from None
    return rid, ids, gconfig, logprob


def generate_reply(c: _Generate, res: GenerationResult, prompt_tokens: int, version: str, tokenizer) -> dict:
    """SGLang's /generate answer for one finished request."""
    reason: dict[str, Any] = {"type": res.finish_reason}
    if res.finish_reason == "stop":
        reason["matched"] = res.output_ids[-1]
    elif res.finish_reason == "length":
        reason["length"] = len(res.output_ids)
    meta: dict[str, Any] = {
        "id": c.rid,
        "finish_reason": reason,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(res.output_ids),
        "weight_version": version,
    }
    if c.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(res.output_logprobs, res.output_ids)]
    return {"text": tokenizer.decode(res.output_ids), "output_ids": res.output_ids, "meta_info": meta}


# --- the engine thread ----------------------------------------------------------------------------


class EngineLoop:
    """Owns the model and the GenerationEngine; runs commands and decode steps on one thread."""

    def __init__(self, model, tokenizer, *, seed: int, weight_version: str = "0"):
        self.model, self.tokenizer = model, tokenizer
        self.engine = GenerationEngine(model, tokenizer, seed=seed)
        self.inbox: queue.Queue = queue.Queue()
        self.weight_version = weight_version
        self.paused: str | None = None
        self.held: list[_Generate] = []  # arrived while paused: join on continue
        self.by_erid: dict[int, _Generate] = {}  # engine request id -> its command
        self.erid: dict[str, int] = {}  # client rid -> engine request id
        self.stats = {"max_running_requests": 0, "decode_steps": 0}
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self._handlers = {_Generate: self._generate, _Abort: self._abort, _Pause: self._pause,
                          _Continue: self._continue, _Weights: self._weights}  # fmt: skip

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                busy = self.paused is None and self.engine.has_unfinished()
                self._drain(block=not busy)
                if self.paused is None and self.engine.has_unfinished():
                    n = self.engine.n_running()
                    self.stats["max_running_requests"] = max(self.stats["max_running_requests"], n)
                    self.stats["decode_steps"] += 1
                    self._finish(self.engine.step())
        except BaseException as e:  # a bug: fail every waiter loudly rather than hang them
            log.exception("gen_server: the engine thread failed")
            self.error = e
        finally:
            self.stopping.set()
            self._fail_all(RuntimeError(f"gen_server: the engine stopped ({self._why()})"))

    def submit(self, command) -> None:
        if self.stopping.is_set():
            raise RuntimeError(f"gen_server: the engine stopped ({self._why()})")
        self.inbox.put(command)

    def _why(self) -> str:
        return "shutting down" if self.error is None else f"it failed: {self.error!r}"

    def _drain(self, *, block: bool) -> None:
        try:
            command = self.inbox.get(timeout=_IDLE_POLL_S) if block else self.inbox.get_nowait()
            while True:
                self._handlers[type(command)](command)
                command = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _fail_all(self, error: Exception) -> None:
        waiting = list(self.by_erid.values()) + self.held
        while True:
            try:
                waiting.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        for c in waiting:
            c.done(error)
        self.by_erid, self.erid, self.held = {}, {}, []

    def _finish(self, finished: list[tuple[int, GenerationResult]]) -> None:
        for erid, res in finished:
            c = self.by_erid.pop(erid)
            del self.erid[c.rid]
            c.done(generate_reply(c, res, len(c.input_ids), self.weight_version, self.tokenizer))

    def _add(self, c: _Generate) -> None:
        if c.rid in self.erid:
            c.done(ValueError(f"generate: request id {c.rid!r} is already running"))
            return
        try:
            erid = self.engine.add_request(c.input_ids, c.gconfig)
        except ValueError as e:
            c.done(e)
            return
        self.erid[c.rid], self.by_erid[erid] = erid, c

    def _generate(self, c: _Generate) -> None:
        if self.paused:
            self.held.append(c)
        else:
            self._add(c)

    def _abort(self, c: _Abort) -> None:
        if c.rid is None:
            self._finish(self.engine.abort())
        elif c.rid in self.erid:
            self._finish(self.engine.abort([self.erid[c.rid]]))
        for h in [h for h in self.held if c.rid is None or h.rid == c.rid]:
            self.held.remove(h)
            empty = GenerationResult([], [], "abort")
            h.done(generate_reply(h, empty, len(h.input_ids), self.weight_version, self.tokenizer))
        c.done({})

    def _pause(self, c: _Pause) -> None:
        self.paused = c.mode
        if c.mode == "abort":
            self._finish(self.engine.abort())
        elif c.mode == "retract":
            self.engine.retract()
        c.done({})

    def _continue(self, c: _Continue) -> None:
        self.paused = None
        held, self.held = self.held, []
        for h in held:
            self._add(h)
        c.done({})

    def _weights(self, c: _Weights) -> None:
        if self.paused == "in_place" and self.engine.has_unfinished():
            c.done(ValueError("weight update refused: an in_place pause holds requests (continue or abort them first)"))
            return
        try:
            self.engine.load_weights(c.tensors)
        except ValueError as e:
            c.done(e)
            return
        if c.version is not None:
            self.weight_version = str(c.version)
        c.done({})

    def info(self) -> dict:
        return {
            "weight_version": self.weight_version,
            "paused": self.paused,
            "num_running_reqs": self.engine.n_running(),
            "num_requests": len(self.by_erid) + len(self.held),  # running, queued or held
            **self.stats,
        }


# --- in-memory weight updates over ZeroMQ ---------------------------------------------------------


class WeightsReceiver:
    """A ROUTER socket on its own thread: authenticated {"version", "names"} + one tensor frame per
    name -> a weight update queued to the engine thread; replies {"ok": true} once applied."""

    def __init__(self, core: EngineLoop, host: str, secret: bytes):
        self.core, self.secret = core, secret
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://{host}:{self.sock.bind_to_random_port(f'tcp://{host}')}"
        self.dropped = 0  # unauthenticated or unparsable messages
        self.thread = threading.Thread(target=self._run, name="gen_server-weights", daemon=True)

    def _run(self) -> None:
        while not self.core.stopping.is_set():
            try:
                identity, header, tensors = wire.recv(self.sock, secret=self.secret, router=True, timeout_s=0.1)
            except TimeoutError:
                continue
            except wire.BadMessage as e:
                self.dropped += 1
                log.warning("gen_server: dropped a weights message (%s)", e.reason)
                continue
            wire.send(self.sock, self._apply(header, tensors), secret=self.secret, identity=identity)
        self.sock.close()

    def _apply(self, header: dict, tensors: list[torch.Tensor]) -> dict:
        names, version = header.get("names"), header.get("version")
        if not isinstance(names, list) or len(names) != len(tensors) or not isinstance(version, str):
            return {"ok": False, "error": "weights: header needs version (str) and one name per tensor frame"}
        result: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self.core.submit(_Weights(dict(zip(names, tensors)), version, result.set_result))
            outcome = result.result(timeout=CONTROL_TIMEOUT_S)
        except (RuntimeError, TimeoutError) as e:
            outcome = e
        if isinstance(outcome, BaseException):
            return {"ok": False, "error": _one_line(outcome)}
        return {"ok": True}


# --- HTTP -----------------------------------------------------------------------------------------


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Server:
    """The aiohttp handlers; each forwards one command to the engine thread and awaits its result."""

    def __init__(self, core: EngineLoop, *, model_path: str, token: str | None, max_batch_size: int):
        self.core, self.model_path, self.token, self.max_batch_size = core, model_path, token, max_batch_size
        self.receiver: WeightsReceiver | None = None
        self.app = web.Application(middlewares=[self._middleware], client_max_size=64 * 2**20)
        self.app.add_routes([
            web.post("/generate", self.generate),
            web.post("/update_weights_from_disk", self.update_weights_from_disk),
            web.post("/pause_generation", self.pause_generation),
            web.post("/continue_generation", self.continue_generation),
            web.post("/abort_request", self.abort_request),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/get_server_info", self.server_info),
        ])  # fmt: skip

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        public = request.method == "GET" and request.path == "/health"
        if self.token is not None and not public:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        try:
            return await handler(request)
        except ValueError as e:  # a user error: bad body, bad parameters, refused update
            return web.json_response({"error": _one_line(e)}, status=400)
        except RuntimeError as e:  # the engine thread stopped
            return web.json_response({"error": _one_line(e)}, status=503)

    async def _call(self, make: Callable[[Callable[[Any], None]], Any], timeout_s: float | None = CONTROL_TIMEOUT_S):
        """Queue `make(done)` to the engine thread and await what it passes to `done`."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(value) -> None:
            if fut.done():  # cancelled: the client went away
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
            raise RuntimeError(f"gen_server: the engine thread did not answer within {timeout_s:g} s") from None

    @staticmethod
    async def _body(request: web.Request) -> dict:
        try:
            body = await request.json() if request.can_read_body else {}
        except ValueError:
            raise ValueError(f"{request.path}: the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ValueError(f"{request.path}: the body must be a JSON object")
        return body

    async def generate(self, request: web.Request) -> web.Response:
        vocab = self.core.model.get_input_embeddings().num_embeddings
        body = await self._body(request)
        rid, ids, gconfig, logprob = parse_generate(body, vocab_size=vocab, max_batch_size=self.max_batch_size)
        rid = rid if rid is not None else os.urandom(8).hex()
        try:
            reply = await self._call(lambda done: _Generate(rid, ids, gconfig, logprob, done), timeout_s=None)
        except asyncio.CancelledError:  # the client went away: stop spending steps on it
            if not self.core.stopping.is_set():
                self.core.submit(_Abort(rid, lambda _: None))
            raise
        return web.json_response(reply)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        path, version = body.get("model_path"), body.get("weight_version")
        try:
            if not isinstance(path, str) or not (version is None or isinstance(version, (str, int))):
                raise ValueError("update_weights_from_disk: needs model_path (str) and optionally weight_version (str)")
            tensors = await asyncio.to_thread(read_hf_weights, path)  # off the engine thread: decoding goes on
            await self._call(lambda done: _Weights(tensors, None if version is None else str(version), done))
        except ValueError as e:
            return web.json_response({"success": False, "message": _one_line(e)}, status=400)
        self.model_path = path
        return web.json_response({"success": True, "message": f"loaded {path}"})

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await self._body(request)).get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_generation: mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        await self._call(lambda done: _Pause(mode, done))
        return web.json_response({"success": True})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._call(lambda done: _Continue(done))
        return web.json_response({"success": True})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        rid = body.get("rid")
        if body.get("abort_all") is True:
            rid = None
        elif not isinstance(rid, str):
            raise ValueError('abort_request: send {"rid": str} or {"abort_all": true}')
        await self._call(lambda done: _Abort(rid, done))
        return web.json_response({"success": True})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_path, "object": "model"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if not self.core.stopping.is_set() else 503)

    async def server_info(self, request: web.Request) -> web.Response:
        dropped = self.receiver.dropped if self.receiver is not None else 0
        info = {"model_path": self.model_path, "max_batch_size": self.max_batch_size, "dropped_weight_messages": dropped}
        return web.json_response({**info, **self.core.info()})


# --- entry point ----------------------------------------------------------------------------------


def run_server(
    model_path: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    seed: int = 0,
    max_batch_size: int = 64,
    token: str | None = None,
    secret: bytes | None = None,
    on_ready: Callable[[dict], None] | None = None,
    stop_on_sigterm: bool = True,
) -> None:
    """Serve `model_path` until SIGTERM (returns), SystemExit or KeyboardInterrupt (propagate).

    `on_ready({"http": "http://host:port", "weights": "tcp://host:port" or None})` is called once
    listening; "weights" is the in-memory update socket, present when `secret` is given."""
    if token is None and not _is_loopback(host):
        raise ValueError(f"gen_server: binding {host!r} (not loopback) needs a token (rollout.server_token)")
    if max_batch_size <= 0:
        raise ValueError(f"gen_server: max_batch_size must be > 0, got {max_batch_size}")
    core = EngineLoop(load_model(model_path), load_tokenizer(model_path), seed=seed)
    server = Server(core, model_path=model_path, token=token, max_batch_size=max_batch_size)
    engine_thread = threading.Thread(target=core.run, name="gen_server-engine", daemon=True)
    engine_thread.start()
    try:
        if secret is not None:
            server.receiver = WeightsReceiver(core, host, secret)
            server.receiver.thread.start()
        asyncio.run(_serve(server, host, port, on_ready, stop_on_sigterm))
    finally:
        core.stopping.set()
        engine_thread.join(timeout=30)
        if server.receiver is not None:
            server.receiver.thread.join(timeout=5)
    if core.error is not None:
        raise RuntimeError("gen_server: the engine thread failed (see the log above)") from core.error


async def _serve(server: Server, host: str, port: int, on_ready: Callable[[dict], None] | None,
                 stop_on_sigterm: bool = True) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if stop_on_sigterm and threading.current_thread() is threading.main_thread():
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    # handler_cancellation: a client that hangs up cancels its handler, which aborts its request (as SGLang).
    runner = web.AppRunner(server.app, access_log=None, handler_cancellation=True, shutdown_timeout=5)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = runner.addresses[0][1]
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
        await runner.cleanup()
