"""The built-in generation engine behind an HTTP server that speaks SGLang's API (0.5.x).

Why SGLang's API: the same client (realcore.backends.clients.sglang_api) drives this server in CI and a
real SGLang server on GPUs (docs/engines.md lists the endpoints we mirror). `python -m
realcore.serve` runs it stand-alone, with SGLang's flag names.

Threads: one engine thread owns the model. It takes commands (new requests, aborts, pauses,
weight updates) from a thread-safe queue between decode steps, so new requests join the running
batch (continuous batching) and weights change only at a token boundary. Results go back to the
asyncio side through `loop.call_soon_threadsafe`. With a `secret`, a ZeroMQ ROUTER thread receives
in-memory weight updates (realcore.transport.wire: MAC-checked, unauthenticated messages dropped
and counted) and queues them to the engine thread like a disk update. SGLang's
/init_weights_update_group and /update_weights_from_distributed join a trainer's weight-update
group (gloo on CPU, NCCL on GPUs: realcore.backends.weight_group) and receive bucketed broadcasts
on a worker thread, each bucket queued to the engine thread the same way.

Devices (`run_server(device=, dtype=)`, GenerationConfig.device/dtype): the engine runs on the
process's GPU when it sees one (cuda:0 of the CUDA_VISIBLE_DEVICES its launcher gave it), in bf16
by default there, else on the CPU in float32; the log says which once, and `/get_server_info`
reports `device` and `dtype`. Updates arrive on the host (disk, memory, gloo) or on the model's GPU
(nccl, refused in one line for a model on the CPU) and land through `copy_`, which moves and casts
them into the live parameters.

Hardening (docs/security.md): every endpoint, /health included, answers 401 without the bearer
token; a connection whose headers are not complete within `header_timeout_s` is closed
(realcore.backends.http_deadlines), a body not complete within `body_timeout_s` answers 408; bodies
are bounded (`max_body_bytes`, 413) and validated by realcore.backends.http_schemas before the
engine sees them (400, one line); weight files' headers are checked before their tensors are read
(realcore.backends.safetensors_header); a command or decode step that raises inside the engine
thread fails the request(s) at fault (500), never the thread, which goes on serving.

Pause modes (SGLang's): `abort` returns every running request now (partial output, finish_reason
abort); `retract` holds them and drops their KV cache, so on continue they resume from
prompt + output so far with the weights current then; `in_place` stops decoding and keeps the KV
cache (a weight update is refused while it holds requests). `hold` (realcore's, not SGLang's) is
`in_place` that takes weight updates: an in-flight update that comes in several calls (the
buckets of a broadcast, a LoRA adapter's unload + load), where no decode step may run between
two of them (rollout.inflight_weight_update). Requests that arrive while paused wait for continue.
A broadcast that stops between its buckets (the trainer gave up on this server) leaves part of a
version in the model: until a complete update lands the server decodes nothing, ends the requests
it held or ran (old version, partial output: rollout workers take them elsewhere) and answers new
ones 503; `/get_server_info` says `weights_incomplete`.
A weight update without a pause is applied between two decode steps; running requests then
continue on their old KV cache, and their reply carries the new version (as SGLang) and, per
token, the version that sampled it (`weight_version_spans`, realcore's field).
With `abort_all_requests` (SGLang's field of /update_weights_from_disk) the server reads the files
while it decodes, then, in one engine step, ends every request (partial output, old version) and
swaps the weights: the interruption of a pause -> load -> continue without the idle load.

OpenAI's API (docs/openai.md): /v1/chat/completions and /v1/completions run each choice as one
/generate request (so pause, abort and weight updates act on them alike) and answer in OpenAI's
JSON with the token ids and weight version as extra fields (realcore.backends.openai_api).

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
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import zmq
from aiohttp import web
from safetensors import SafetensorError

from realcore.api.config import GenerationConfig, SystemConfig
from realcore.api.engine import GenerationResult
from realcore.backends import http_deadlines, http_schemas, lora, openai_api, safetensors_header, weight_group
from realcore.backends.device import select_device
from realcore.backends.generation import GenerationEngine, read_hf_weights
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
CONTROL_TIMEOUT_S = 60.0  # a control command waits for at most one decode step; this is generous
WEIGHT_GROUP_TIMEOUT_S = 600.0  # joining the trainer's weight-update group, and each bucket's broadcast
_IDLE_POLL_S = 0.05


# --- commands to the engine thread (each carries `done`, called once with a result or an exception) ---


class Unavailable(RuntimeError):
    """The engine thread stopped or did not answer in time (HTTP 503)."""


class RequestFailed(RuntimeError):
    """The engine thread raised while running this one request or command (HTTP 500)."""


INCOMPLETE = "the weights are incomplete (a broadcast stopped between its buckets): waiting for a complete update"


@dataclass
class _Generate:
    rid: str
    input_ids: list[int]
    gconfig: GenerationConfig
    return_logprob: bool
    done: Callable[[Any], None]
    adapters: frozenset[str] = frozenset()  # lora_path names asked for: checked on admission, after any pause
    restarted: bool = False  # it was in a failed decode step once and started again
    # (first output token index, version) from admission on: which version sampled which tokens when
    # an update lands without aborting the request (it goes on with its KV cache: in-flight update).
    spans: list[tuple[int, str]] = field(default_factory=list)


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
    partial: bool = False  # one bucket of a broadcast update: not every parameter
    abort_all: bool = False  # SGLang's abort_all_requests: every request ends (partial output) just before
    abort_before: int | None = None  # then, requests whose first token's version is below this end (partial output)


@dataclass
class _Adapter:
    """Load (tensors given) or unload (tensors None) the LoRA adapter `name`."""

    name: str
    config: dict | None
    tensors: dict[str, torch.Tensor] | None
    version: str | None
    done: Callable[[Any], None]
    abort_all: bool = False
    abort_before: int | None = None  # as _Weights'


@dataclass
class _Version:
    """SGLang's /update_weight_version: replies carry `version` from now on (weights unchanged)."""

    version: str
    done: Callable[[Any], None]
    abort_before: int | None = None  # as _Weights'


@dataclass
class LoraServing:
    """SGLang's LoRA launch flags (--enable-lora, --max-lora-rank, --lora-target-modules,
    --lora-paths): the bounds an adapter loaded later must keep (None: any), and the adapter loaded
    at start (name, path), if any."""

    max_rank: int | None = None
    target_modules: list[str] | None = None
    initial: tuple[str, str] | None = None

    def check(self, config: dict) -> None:
        if self.max_rank is not None and int(config["r"]) > self.max_rank:
            raise ValueError(f"lora: the adapter's rank {config['r']} is above --max-lora-rank {self.max_rank}")
        targets = config.get("target_modules") or []
        targets = [targets] if isinstance(targets, str) else targets
        if self.target_modules is not None and not set(targets) <= set(self.target_modules):
            raise ValueError(f"lora: the adapter targets {sorted(targets)}, outside --lora-target-modules "
                             f"{sorted(self.target_modules)}")


# --- replies ------------------------------------------------------------------------------------


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
    # realcore's extension: the version that sampled each token, as spans [first token index,
    # version] (several only when an update landed while the request ran; SGLang has no such field)
    meta["weight_version_spans"] = [[i, v] for i, v in c.spans if i < len(res.output_ids)] or [[0, version]]
    if c.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(res.output_logprobs, res.output_ids)]
    return {"text": tokenizer.decode(res.output_ids), "output_ids": res.output_ids, "meta_info": meta}


# --- the engine thread ----------------------------------------------------------------------------


class EngineLoop:
    """Owns the model and the GenerationEngine; runs commands and decode steps on one thread."""

    def __init__(self, model, tokenizer, *, seed: int, weight_version: str = "0", dtype: str = "float32"):
        self.engine = GenerationEngine(model, tokenizer, seed=seed, dtype=dtype)  # converts model to `dtype`
        self.dtype = dtype
        self.device = next(model.parameters()).device  # the model's: where the engine runs and nccl receives
        self.model, self.tokenizer = model, tokenizer
        self.inbox: queue.Queue = queue.Queue()
        self.weight_version = weight_version
        # LoRA (SGLang's /load_lora_adapter): one adapter at a time, merged into the weights, so it
        # applies to every request. lora_base keeps the unmerged weights it changed (for unload/replace).
        self.adapter: str | None = None
        self.lora_base: dict[str, torch.Tensor] = {}
        self.paused: str | None = None
        self.held: list[_Generate] = []  # arrived while paused: join on continue
        # A broadcast that stopped between its buckets leaves part of a version in the model: no
        # request decodes on it (they end; new ones get 503) until a complete update lands.
        self.incomplete = False
        self.by_erid: dict[int, _Generate] = {}  # engine request id -> its command
        self.erid: dict[str, int] = {}  # client rid -> engine request id
        self.stats = {"max_running_requests": 0, "decode_steps": 0}
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self._handlers = {_Generate: self._generate, _Abort: self._abort, _Pause: self._pause,
                          _Continue: self._continue, _Weights: self._weights, _Adapter: self._adapter,
                          _Version: self._version}  # fmt: skip

    def run(self) -> None:
        try:
            if self.device.type == "cuda":  # the current device is per thread
                torch.cuda.set_device(self.device)
            while not self.stopping.is_set():
                busy = self.paused is None and self.engine.has_unfinished()
                self._drain(block=not busy)
                if self.paused is None and self.engine.has_unfinished():
                    n = self.engine.n_running()
                    self.stats["max_running_requests"] = max(self.stats["max_running_requests"], n)
                    self.stats["decode_steps"] += 1
                    self._step()
        except BaseException as e:  # a bug of this loop itself: fail every waiter loudly rather than hang them
            log.exception("gen_server: the engine thread failed")
            self.error = e
        finally:
            self.stopping.set()
            self._fail_all(Unavailable(f"gen_server: the engine stopped ({self._why()})"))

    def submit(self, command) -> None:
        if self.stopping.is_set():
            raise Unavailable(f"gen_server: the engine stopped ({self._why()})")
        self.inbox.put(command)

    def _why(self) -> str:
        return "shutting down" if self.error is None else f"it failed: {self.error!r}"

    def _drain(self, *, block: bool) -> None:
        try:
            command = self.inbox.get(timeout=_IDLE_POLL_S) if block else self.inbox.get_nowait()
            while True:
                self._run(command)
                command = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _run(self, command) -> None:
        try:
            self._handlers[type(command)](command)
        except Exception as e:  # one command fails, alone; the engine goes on (a second `done` is ignored)
            what = type(command).__name__.lstrip("_").lower()
            log.exception("gen_server: a %s command failed in the engine thread", what)
            command.done(RequestFailed(f"gen_server: {what} failed in the engine: {one_line(e)}"))

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception as e:
            self._isolate(e)
            return
        self._finish(finished)

    def _isolate(self, error: Exception) -> None:
        """A decode step raised: find the request(s) at fault and fail only those.

        The batch's KV cache may be half-updated, so it is dropped. Each request of the step then
        runs alone for one token on a scratch engine: one that raises there fails (500); the others
        start again from their prompts (they were not answered yet). A request in a second failed
        step fails without a probe, so a fault that shows only in a batch cannot loop forever."""
        log.error("gen_server: a decode step failed (%s); isolating the request(s) at fault", one_line(error),
                  exc_info=error)
        involved = list(self.by_erid.values())
        self.engine.retract()  # running -> waiting, cache dropped
        self.engine.abort()  # and every waiting request ends: the engine is empty
        self.by_erid, self.erid = {}, {}
        for c in involved:
            why = "it was in two failed decode steps" if c.restarted else self._probe(c)
            if why is not None:
                c.done(RequestFailed(f"generate: request {c.rid!r} failed in the engine: {why}"))
            else:
                c.restarted = True
                self._add(c)

    def _probe(self, c: _Generate) -> str | None:
        """Run `c` alone for one token on a scratch engine: why it fails, or None."""
        try:
            scratch = GenerationEngine(self.model, self.tokenizer, seed=0)
            scratch.generate([c.input_ids], c.gconfig.model_copy(update={"max_new_tokens": 1}))
        except Exception as e:
            return one_line(e)
        return None

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
            try:
                reply = generate_reply(c, res, len(c.input_ids), self.weight_version, self.tokenizer)
            except Exception as e:
                log.exception("gen_server: the reply to request %r failed", c.rid)
                reply = RequestFailed(f"generate: the reply to request {c.rid!r} failed: {one_line(e)}")
            c.done(reply)

    def _add(self, c: _Generate) -> None:
        wrong = sorted(n for n in c.adapters if n != self.adapter)
        if wrong:  # SGLang's lora_path names a loaded adapter. Checked here, not on arrival: a request
            # that came during an adapter swap (unload, then load, while paused) waits for the new one
            c.done(ValueError(f"generate: lora_path {wrong} is not the loaded adapter ({self.adapter})"))
            return
        if c.rid in self.erid:
            c.done(ValueError(f"generate: request id {c.rid!r} is already running"))
            return
        try:
            erid = self.engine.add_request(c.input_ids, c.gconfig)
        except ValueError as e:  # e.g. longer than the model's context
            c.done(e)
            return
        c.spans = [(0, self.weight_version)]
        self.erid[c.rid], self.by_erid[erid] = erid, c

    def _generate(self, c: _Generate) -> None:
        if self.paused:
            self.held.append(c)
        elif self.incomplete:
            c.done(Unavailable(INCOMPLETE))
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

    def _abort_for_update(self, c: _Weights | _Adapter) -> None:
        """abort_all_requests: every request ends now with its output so far, tagged with the old
        version, in the same engine-thread step as the update, so no token of the new weights
        joins an old KV cache and a request sent after the abort runs on the new weights."""
        if c.abort_all:
            self._abort_all()

    def _abort_all(self) -> None:
        """Every running and held request ends now (output so far, the current version)."""
        self._abort(_Abort(None, lambda _: None))

    def _pause(self, c: _Pause) -> None:
        self.paused = c.mode
        if c.mode == "abort":
            self._finish(self.engine.abort())
        elif c.mode == "retract":
            self.engine.retract()
        c.done({})

    def _continue(self, c: _Continue) -> None:
        if self.incomplete:  # the held and running requests end (old version): none goes on over part of a new one
            log.warning("gen_server: %s; %d request(s) end", INCOMPLETE, len(self.by_erid) + len(self.held))
            self._abort_all()
        self.paused = None
        held, self.held = self.held, []
        for h in held:
            self._add(h)
        c.done({})

    def _weights(self, c: _Weights) -> None:
        t0 = time.perf_counter()
        self._abort_for_update(c)
        if self.paused == "in_place" and self.engine.has_unfinished():
            c.done(ValueError("weight update refused: an in_place pause holds requests (continue or abort them first)"))
            return
        try:
            self.engine.load_weights(c.tensors, partial=c.partial)
        except ValueError as e:
            c.done(e)
            return
        # What an update costs the engine thread (no decoding meanwhile): the abort and the swap.
        self.stats["last_weight_update_s"] = time.perf_counter() - t0
        # A bucket without the version is part of one; the last bucket, or any whole update, completes it.
        self.incomplete = c.partial and c.version is None
        if self.incomplete and self.paused is None and self.engine.has_unfinished():
            self._abort_all()  # a broadcast without a pause: no step on part of it
        self.adapter, self.lora_base = None, {}  # new weights are the new base (an adapter merged in stays)
        self._land(c.version, c.abort_before)
        c.done({})

    def _land(self, version, abort_before: int | None) -> None:
        """The end of an update: replies carry `version` from now on (if given), and the running
        requests whose first token came from a version below `abort_before` end (if given)."""
        if version is not None:
            self._set_version(str(version))
        if abort_before is not None:
            self._abort_started_before(abort_before)

    def _abort_started_before(self, version: int) -> None:
        """End the running requests whose first token came from a version below `version` (an
        in-flight update made them too stale to be trained; the rollout worker sees the abort and
        stops). Requests without a token yet, or with versions that are not numbers, go on."""
        done = self.engine.output_lengths()
        old = [erid for erid, c in self.by_erid.items()
               if done.get(erid, 0) > 0 and c.spans[0][1].isdigit() and int(c.spans[0][1]) < version]
        if old:
            self._finish(self.engine.abort(old))

    def _set_version(self, version: str) -> None:
        if version != self.weight_version:
            going_on = f" ({len(self.by_erid)} running requests go on under it)" if self.by_erid else ""
            log.info("gen_server: now at weight version %s%s", version, going_on)
            if self.by_erid:  # requests that go on: their next tokens come from `version`
                done = self.engine.output_lengths()
                for erid, c in self.by_erid.items():
                    n = done.get(erid, 0)
                    c.spans[-1:] = [c.spans[-1], (n, version)] if c.spans[-1][0] < n else [(n, version)]
        self.weight_version = version

    def _version(self, c: _Version) -> None:
        self._land(c.version, c.abort_before)
        c.done({})

    def _adapter(self, c: _Adapter) -> None:
        """Merge adapter `c` into the weights (W = base + scale * B @ A, realcore.backends.lora),
        first restoring any weight a previous adapter changed; or (unload) restore them all."""
        self._abort_for_update(c)
        if self.paused == "in_place" and self.engine.has_unfinished():
            c.done(ValueError("adapter update refused: an in_place pause holds requests (continue or abort them first)"))
            return
        if c.tensors is None:
            if self.adapter != c.name:
                c.done(ValueError(f"unload_lora_adapter: {c.name!r} is not loaded (loaded: {self.adapter})"))
                return
            self.engine.load_weights(self.lora_base, partial=True)
            self.adapter, self.lora_base = None, {}
            c.done({})
            return
        state = self.model.state_dict()
        try:
            merged = lora.merge_adapter({**state, **self.lora_base}, c.config, c.tensors)
        except ValueError as e:
            c.done(e)
            return
        base = {n: self.lora_base[n] if n in self.lora_base else state[n].detach().clone() for n in merged}
        restore = {n: t for n, t in self.lora_base.items() if n not in merged}
        self.engine.load_weights({**restore, **merged}, partial=True)
        self.adapter, self.lora_base = c.name, base
        self._land(c.version, c.abort_before)
        log.info("gen_server: LoRA adapter %r merged into %d weights (version %s)", c.name, len(merged), self.weight_version)
        c.done({})

    def info(self) -> dict:
        return {
            "weight_version": self.weight_version,
            "dtype": self.dtype,  # the engine's weights: bfloat16 or float32 (a trainer casts a broadcast to it)
            "device": self.device.type,  # cuda or cpu, as SGLang's server info names its --device
            "lora_adapter": self.adapter,
            "paused": self.paused,
            "weights_incomplete": self.incomplete,  # a broadcast stopped between its buckets (realcore's field)
            "num_running_reqs": self.engine.n_running(),
            "num_requests": len(self.by_erid) + len(self.held),  # running, queued or held
            **self.stats,
        }


# --- in-memory weight updates over ZeroMQ ---------------------------------------------------------


class WeightsReceiver:
    """A ROUTER socket on its own thread: authenticated {"version", "names"} + one tensor frame per
    name -> a weight update queued to the engine thread; replies {"ok": true} once applied. With
    "abort_all_requests": true the running requests end just before the update (as SGLang's field
    of that name on /update_weights_from_disk), so the server decodes until the tensors are here."""

    def __init__(self, core: EngineLoop, host: str, secret: bytes, limits: wire.Limits | None = None):
        self.core, self.secret = core, secret
        limits = limits or wire.Limits.of()
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        wire.set_max_size(self.sock, limits.max_message_bytes)  # one frame = one weight tensor
        wire.secure(self.sock, secret, server=True, limits=limits, socket="weights")
        self.address = f"tcp://{host}:{self.sock.bind_to_random_port(f'tcp://{host}')}"
        self.endpoint = wire.Endpoint(secret, "gen_server", socket="weights", address=self.address, limits=limits)
        self.dropped = 0  # unauthenticated, unparsable or replayed messages (counted by wire too)
        self.thread = threading.Thread(target=self._run, name="gen_server-weights", daemon=True)

    def _run(self) -> None:
        while not self.core.stopping.is_set():
            try:
                peer, header, tensors = wire.recv(self.sock, endpoint=self.endpoint, router=True, timeout_s=0.1)
            except TimeoutError:
                continue
            except wire.BadMessage:
                self.dropped += 1  # counted and logged (rate-limited) by the endpoint
                continue
            wire.send(self.sock, self._apply(header, tensors), endpoint=self.endpoint, to=peer)
        self.sock.close()

    def _apply(self, header: dict, tensors: list[torch.Tensor]) -> dict:
        names, version = header.get("names"), header.get("version")
        if (not isinstance(names, list) or len(names) != len(tensors) or not all(isinstance(n, str) for n in names)
                or not isinstance(version, str)):
            return {"ok": False, "error": "weights: header needs version (str) and one name (str) per tensor frame"}
        result: concurrent.futures.Future = concurrent.futures.Future()

        def done(value) -> None:  # once: the engine thread may report a failed command a second time
            if not result.done():
                result.set_result(value)

        adapter, abort_all = header.get("lora"), header.get("abort_all_requests", False)
        abort_before = header.get("abort_started_before")
        if not isinstance(abort_all, bool):
            return {"ok": False, "error": "weights: abort_all_requests must be a bool"}
        if abort_before is not None and (type(abort_before) is not int or abort_before < 0):
            return {"ok": False, "error": "weights: abort_started_before must be an int >= 0"}
        try:
            if adapter is not None:  # a LoRA adapter's tensors, loaded as /load_lora_adapter would
                if not isinstance(adapter, dict) or not isinstance(adapter.get("name"), str):
                    return {"ok": False, "error": "weights: lora needs a name (str) and a config"}
                config = lora.check_config(adapter.get("config"))
                self.core.submit(_Adapter(adapter["name"], config, dict(zip(names, tensors)), version, done, abort_all,
                                          abort_before))
            else:
                self.core.submit(_Weights(dict(zip(names, tensors)), version, done, abort_all=abort_all,
                                          abort_before=abort_before))
            outcome = result.result(timeout=CONTROL_TIMEOUT_S)
        except (RuntimeError, TimeoutError, ValueError) as e:
            outcome = e
        if isinstance(outcome, BaseException):
            return {"ok": False, "error": one_line(outcome)}
        return {"ok": True}


# --- weight-update groups (SGLang's update_weights_from_distributed) -------------------------------


def receive_device(backend: str, model_device: torch.device) -> torch.device:
    """Where a bucket of `backend` is received: nccl on the model's GPU (refused, in one line, for a
    model on the CPU), gloo on the CPU. Either way the engine's copy_ moves and casts it into the model."""
    if backend == "nccl":
        if model_device.type != "cuda":
            raise ValueError("backend nccl: this server's model is not on a GPU (use gloo)")
        return model_device
    return torch.device("cpu")


@dataclass
class WeightGroup:
    pg: Any  # ProcessGroupGloo / ProcessGroupNCCL
    store: Any  # the TCPStore client it was built on (kept alive with it)
    device: torch.device
    # One bucket at a time (a cancelled handler's thread runs on); per group, so a receive left
    # waiting in a group the trainer gave up on does not hold up the next group.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        weight_group.close_group(self.pg)


# --- HTTP -----------------------------------------------------------------------------------------


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
            await asyncio.to_thread(safetensors_header.check_dir, body.model_path, self.shapes, self.params)
            try:
                tensors = await asyncio.to_thread(read_hf_weights, body.model_path)
            except (OSError, SafetensorError) as e:  # changed or unreadable since its header was checked
                raise ValueError(f"weights: {body.model_path}: {one_line(e)}") from None
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
            group = await weight_group.in_thread(self._join, body)
        except Exception as e:  # refused (nccl without CUDA), or the rendezvous failed or timed out
            wire.count_dropped("http", "body", f"{request.path}: {one_line(e)[:200]}")
            return web.json_response({"success": False, "message": one_line(e)}, status=400)
        old = self.groups.pop(body.group_name, None)
        if old is not None:
            old.close()
        self.groups[body.group_name] = group
        return web.json_response({"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset} "
                                                              f"of {body.world_size} ({body.backend})"})

    def _join(self, body: http_schemas.InitWeightsUpdateGroupRequest) -> WeightGroup:
        device = receive_device(body.backend, self.core.device)
        if device.type == "cuda":  # this handler's own thread: NCCL binds the group to the current device
            torch.cuda.set_device(device)
        timeout = timedelta(seconds=WEIGHT_GROUP_TIMEOUT_S)
        # It answered wait_listening: connecting takes the connect deadline, the rendezvous the group's.
        store = dist.TCPStore(body.master_address, body.master_port, body.world_size, False,
                              timedelta(seconds=self.connect_timeout_s))
        store.set_timeout(timeout)
        pg = weight_group.new_group(body.backend, store, body.rank_offset, body.world_size, body.group_name,
                                    host=self.host, timeout=timeout)
        return WeightGroup(pg, store, device)

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
            # Checked before receiving (the trainer stops at the first refusal): this also bounds what
            # the receive allocates to the model's own sizes.
            wrong = [n for n, shape in zip(body.names, body.shapes) if self.shapes.get(n) != tuple(shape)]
            if wrong:
                raise ValueError(f"weights: {len(wrong)} unknown or wrongly shaped parameter(s), e.g. {wrong[:3]}")
            try:
                tensors = await weight_group.in_thread(self._receive, group, body)
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

    def _receive(self, group: WeightGroup, body: http_schemas.UpdateWeightsFromDistributedRequest) -> list[torch.Tensor]:
        if group.device.type == "cuda":
            torch.cuda.set_device(group.device)
        with group.lock:
            return weight_group.receive(group.pg, body.dtypes, body.shapes, group.device,
                                        timedelta(seconds=WEIGHT_GROUP_TIMEOUT_S))

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
        name, path = lora_serving.initial
        config, tensors = lora.read_adapter(path)
        lora_serving.check(config)
        failed: list = []
        core._adapter(_Adapter(name, config, tensors, None, lambda r: failed.append(r) if isinstance(r, Exception) else None))
        if failed:
            raise failed[0]
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
