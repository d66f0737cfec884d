"""The engine thread of the built-in generation server: one thread owns the model and the
GenerationEngine and runs commands (realcore.backends.genserver.commands) and decode steps.

It takes commands (new requests, aborts, pauses, weight updates) from a thread-safe queue between
decode steps, so new requests join the running batch (continuous batching) and weights change only
at a token boundary. Results go back through each command's `done` (the HTTP side passes one that
hops to its asyncio loop). A command or decode step that raises fails the request(s) at fault
(500), never the thread, which goes on serving. The engine runs on the model's device (cuda or
cpu); updates land through `copy_`, which moves and casts them into the live parameters.

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
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import torch

from realcore.api.engine import GenerationResult
from realcore.backends import lora
from realcore.backends.generation import GenerationEngine
from realcore.backends.genserver.commands import (
    INCOMPLETE, RequestFailed, Unavailable, _Abort, _Adapter, _Continue, _Generate, _Pause, _Version, _Weights)
from realcore.backends.http_schemas import one_line

log = logging.getLogger(__name__)
_IDLE_POLL_S = 0.05


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