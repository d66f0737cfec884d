"""The request bodies of the built-in generation server (realcore.backends.genserver.http): one pydantic
model per endpoint, in SGLang 0.5's names, validated before anything reaches the engine thread.

The same rules hold for every endpoint:
- The body is JSON, parsed by pydantic's own parser (pydantic_core.from_json): nesting past its
  depth limit (200), numbers it cannot represent, NaN/Infinity, invalid UTF-8 and non-JSON are a
  400; nothing recurses in Python. An empty body means `{}`.
- Types are strict: 5 is an int; "5", 5.0 and true are not. Floats are finite.
- Every number and list is bounded: token ids within the model's vocabulary, a prompt plus
  max_new_tokens within the model's context, at most `max_batch_size` prompts per request, rids of
  at most 256 characters, at most 256 stop token ids. The body size is bounded before parsing
  (`system.max_http_body_bytes`, 413).
- An unknown field is a 400 that names it. SGLang ignores some unknown top-level fields; we refuse
  them, because a misspelt field (say `max_tokens`) would otherwise run with defaults unnoticed.
  The exceptions are SGLang's text-only sampling params (`skip_special_tokens`,
  `spaces_between_special_tokens`, `no_stop_trim`): we return token ids, so they are accepted and
  ignored. A field sent as null takes its default, as in SGLang.
Errors are ValueError with one line naming the endpoint, the field and the rule.

The OpenAI-compatible bodies (/v1/chat/completions, /v1/completions; docs/openai.md) follow the
same rules in OpenAI's field names. What the engine cannot do is refused, not ignored: `stream`,
`echo`, alternatives (`top_logprobs` / `logprobs` above 0), unknown fields such as `tools`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

from realcore.api.config import GenerationConfig
from realcore.backends.weight_group import DTYPES

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
SGLANG_SAMPLING_EPS = 1e-6  # SGLang treats a temperature below this as greedy
TOP_K_ALL = 1 << 30  # SGLang's "no top-k"; -1 (SGLang) and 0 (realcore) mean the same
MAX_TEMPERATURE = 100.0  # SGLang has no upper bound; far above any use, and finite
MAX_RID_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
PAUSE_MODES = ("abort", "retract", "in_place", "hold")  # hold: realcore's (gen_server's docstring)
MAX_CHOICES = 16  # OpenAI's `n`
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
_MAX_ERRORS_SHOWN = 3

TokenId = Annotated[int, Field(ge=0, lt=2**31)]  # the vocabulary bound is checked with the model's (Limits)
Rid = Annotated[str, Field(min_length=1, max_length=MAX_RID_CHARS)]
Prompt = Annotated[list[TokenId], Field(min_length=1)]


@dataclass(frozen=True)
class Limits:
    """What bounds a request on this server (the validation context of the models below)."""

    vocab_size: int  # token ids must be below it
    max_context: int  # prompt + max_new_tokens must fit (the model's max_position_embeddings)
    max_batch_size: int  # prompts per /generate request (and the engine's batch)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class SamplingParams(_Body):
    temperature: float = Field(1.0, ge=0, le=MAX_TEMPERATURE, description="below 1e-6: greedy (as SGLang)")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=TOP_K_ALL, description="-1 or 0: off")
    max_new_tokens: int = Field(SGLANG_DEFAULT_MAX_NEW_TOKENS, ge=1, description="prompt + this <= the model's context")
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    n: Literal[1] = Field(1, description="one sample per request: send n requests for n samples")
    skip_special_tokens: bool = True  # text-only: accepted, ignored
    spaces_between_special_tokens: bool = True  # text-only: accepted, ignored
    no_stop_trim: bool = False  # text-only: accepted, ignored

    def gconfig(self, limits: Limits) -> GenerationConfig:
        greedy = self.temperature < SGLANG_SAMPLING_EPS
        return GenerationConfig(
            n_samples=1,
            max_batch_size=limits.max_batch_size,
            temperature=1.0 if greedy else self.temperature,
            greedy=greedy,
            top_k=0 if self.top_k in (-1, 0) or self.top_k >= limits.vocab_size else self.top_k,
            top_p=self.top_p,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
        )


def _check_fits(prompts: list[list[int]], params: SamplingParams, limits: Limits | None) -> None:
    if limits is None:
        return
    if len(prompts) > limits.max_batch_size:
        raise ValueError(f"a batch of {len(prompts)} prompts exceeds this server's max_batch_size ({limits.max_batch_size})")
    for name, ids in [*(("input_ids", p) for p in prompts), ("sampling_params.stop_token_ids", params.stop_token_ids)]:
        if ids and max(ids) >= limits.vocab_size:
            raise ValueError(f"{name}: token id {max(ids)} is outside the vocabulary [0, {limits.vocab_size})")
    longest = max(len(p) for p in prompts)
    if longest + params.max_new_tokens > limits.max_context:
        raise ValueError(f"a prompt of {longest} tokens + max_new_tokens={params.max_new_tokens} exceeds the "
                         f"model's context of {limits.max_context} tokens")


LoraName = Annotated[str, Field(min_length=1, max_length=256)]


class GenerateRequest(_Body):
    """POST /generate with one prompt: answered with one result object."""

    input_ids: Prompt
    sampling_params: SamplingParams = SamplingParams()
    return_logprob: bool = False
    rid: Rid | None = None
    lora_path: LoraName | None = None  # SGLang's adapter name for this request (the loaded one, if any)

    @model_validator(mode="after")
    def _fits(self, info: ValidationInfo) -> GenerateRequest:
        _check_fits([self.input_ids], self.sampling_params, info.context)
        return self


class BatchGenerateRequest(_Body):
    """POST /generate with a list of prompts (SGLang's batch form): answered with a list of result
    objects, in order. `sampling_params` and `return_logprob` apply to every prompt."""

    input_ids: list[Prompt] = Field(min_length=1)
    sampling_params: SamplingParams = SamplingParams()
    return_logprob: bool = False
    rid: list[Rid] | None = None
    lora_path: LoraName | list[LoraName | None] | None = None  # one name for all, or one per prompt

    @model_validator(mode="after")
    def _fits(self, info: ValidationInfo) -> BatchGenerateRequest:
        if self.rid is not None and (len(self.rid) != len(self.input_ids) or len(set(self.rid)) != len(self.rid)):
            raise ValueError(f"rid: a batch needs one distinct rid per prompt ({len(self.input_ids)})")
        _check_fits(self.input_ids, self.sampling_params, info.context)
        return self


class UpdateWeightsFromDiskRequest(_Body):
    model_path: str = Field(min_length=1, max_length=4096, description="an HF directory of *.safetensors")
    weight_version: str | None = Field(None, min_length=1, max_length=MAX_RID_CHARS, description="the version the reply carries")
    abort_all_requests: bool = Field(False, description="end every request (partial output) as the weights change")
    abort_started_before: int | None = Field(
        None, ge=0, description="realcore's: end (partial output) the running requests whose first token came from "
        "a version below this, as the weights change (in-flight updates: rollouts too stale to be trained)")


class LoadLoRAAdapterRequest(_Body):
    """SGLang's /load_lora_adapter: a PEFT LoRA folder (adapter_config.json +
    adapter_model.safetensors). `pinned`: SGLang's (keep it in GPU memory); accepted and ignored.
    Like SGLang's, it carries no version: /update_weight_version sets that."""

    lora_name: LoraName
    lora_path: str = Field(min_length=1, max_length=4096)
    pinned: bool = False


class UpdateWeightVersionRequest(_Body):
    """SGLang's /update_weight_version: the version replies carry from now on."""

    new_version: str = Field(min_length=1, max_length=MAX_RID_CHARS)
    abort_all_requests: bool = True  # SGLang's default
    abort_started_before: int | None = Field(
        None, ge=0, description="realcore's, as in /update_weights_from_disk (an in-flight LoRA update)")


class UnloadLoRAAdapterRequest(_Body):
    """SGLang's /unload_lora_adapter."""

    lora_name: LoraName


GroupName = Annotated[str, Field(min_length=1, max_length=MAX_RID_CHARS)]
MAX_WEIGHT_TENSORS = 1 << 16  # per request (a bucket); a model has a few thousand at most
MAX_GROUP_WORLD = 1 << 16


class InitWeightsUpdateGroupRequest(_Body):
    """SGLang's /init_weights_update_group: join the trainer's weight-update group as rank `rank_offset`."""

    master_address: str = Field(min_length=1, max_length=255, description="the trainer's TCPStore host")
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, lt=MAX_GROUP_WORLD, description="this server's first rank (the trainer is rank 0)")
    world_size: int = Field(ge=2, le=MAX_GROUP_WORLD)
    group_name: GroupName = "weight_update_group"
    backend: Literal["nccl", "gloo"] = "nccl"

    @model_validator(mode="after")
    def _rank_in_world(self) -> InitWeightsUpdateGroupRequest:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} is outside world_size {self.world_size}")
        return self


class UpdateWeightsFromDistributedRequest(_Body):
    """SGLang's /update_weights_from_distributed: receive one bucket, broadcast by rank 0 tensor by
    tensor in this order. `flush_cache`, `abort_all_requests`, `torch_empty_cache`: SGLang's; the
    built-in engine has no prefix cache to flush and aborts through /pause_generation, so they are
    accepted and ignored. `load_format` only None (SGLang's default)."""

    names: list[Annotated[str, Field(min_length=1, max_length=4096)]] = Field(min_length=1, max_length=MAX_WEIGHT_TENSORS)
    dtypes: list[str] = Field(min_length=1, max_length=MAX_WEIGHT_TENSORS)
    shapes: list[list[Annotated[int, Field(ge=0, lt=2**31)]]] = Field(min_length=1, max_length=MAX_WEIGHT_TENSORS)
    group_name: GroupName = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    torch_empty_cache: bool = False
    weight_version: str | None = Field(None, min_length=1, max_length=MAX_RID_CHARS, description="the version replies carry from now on")
    abort_started_before: int | None = Field(
        None, ge=0, description="realcore's, as in /update_weights_from_disk (send it with the last bucket)")
    load_format: None = None

    @model_validator(mode="after")
    def _aligned(self) -> UpdateWeightsFromDistributedRequest:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(f"names, dtypes and shapes differ in length ({len(self.names)}, {len(self.dtypes)}, "
                             f"{len(self.shapes)})")
        unknown = sorted({d for d in self.dtypes if d not in DTYPES})
        if unknown:
            raise ValueError(f"dtypes: unknown {unknown[:3]} (one of {sorted(DTYPES)})")
        return self


class DestroyWeightsUpdateGroupRequest(_Body):
    group_name: GroupName = "weight_update_group"


class BeginWeightUpdateRequest(_Body):
    """SGLang's /begin_weight_update: open the session that /update_weights_from_distributed needs."""

    selector: Literal["target", "draft", "all"] = "all"


class EndWeightUpdateRequest(_Body):
    """SGLang's /end_weight_update: close the session."""


class PauseGenerationRequest(_Body):
    mode: Literal["abort", "retract", "in_place", "hold"] = "abort"  # hold: realcore's, built-in server only


class ContinueGenerationRequest(_Body):
    pass


class AbortRequest(_Body):
    rid: Rid | None = None
    abort_all: bool = False

    @model_validator(mode="after")
    def _one_or_all(self) -> AbortRequest:
        if self.rid is None and not self.abort_all:
            raise ValueError('send {"rid": str} or {"abort_all": true}')
        return self


# --- OpenAI-compatible bodies (docs/openai.md) -----------------------------------------------------

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class _OpenAIRequest(_Body):
    """The sampling fields /v1/chat/completions and /v1/completions share."""

    model: str = Field(min_length=1, max_length=4096, description="not checked: a server serves one model (as SGLang)")
    max_tokens: int | None = Field(None, ge=1, description="default: the rest of the model's context")
    temperature: float = Field(1.0, ge=0, le=MAX_TEMPERATURE, description="below 1e-6: greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices per prompt")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] = Field(default_factory=list)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64, description="accepted, ignored (the server's --random-seed)")
    user: str | None = Field(None, max_length=MAX_RID_CHARS, description="accepted, ignored")
    stream: bool = False

    @model_validator(mode="after")
    def _no_stream(self) -> _OpenAIRequest:
        if self.stream:
            raise ValueError("stream: streaming is not supported (send stream=false)")
        return self

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def new_tokens(self) -> int | None:
        return self.max_tokens

    def gconfig(self, prompt_tokens: int, limits: Limits) -> GenerationConfig:
        """The engine's config for one prompt of `prompt_tokens`; ValueError if it cannot fit the context."""
        room = limits.max_context - prompt_tokens
        wanted = self.new_tokens()
        if wanted is not None and wanted > room:
            raise ValueError(f"a prompt of {prompt_tokens} tokens + max_tokens={wanted} exceeds the model's context "
                             f"of {limits.max_context} tokens")
        if room < 1:
            raise ValueError(f"a prompt of {prompt_tokens} tokens leaves no room for output in the model's context "
                             f"of {limits.max_context} tokens")
        params = SamplingParams(temperature=self.temperature, top_p=self.top_p, max_new_tokens=wanted or room)
        return params.gconfig(limits)


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    name: str | None = Field(None, min_length=1, max_length=MAX_RID_CHARS, description="passed to the template")
    tool_call_id: str | None = Field(None, min_length=1, max_length=MAX_RID_CHARS, description="passed to the template")


class ChatCompletionRequest(_OpenAIRequest):
    """POST /v1/chat/completions: the messages go through the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name of max_tokens")
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20, description="only 0: the engine returns no alternatives")

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.top_logprobs > 0:
            raise ValueError("top_logprobs: only 0 is supported (the engine returns the sampled token's log-prob, "
                             "no alternatives)")
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise ValueError(f"max_tokens={self.max_tokens} and max_completion_tokens={self.max_completion_tokens} "
                             "disagree: send one")
        return self

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


class CompletionRequest(_OpenAIRequest):
    """POST /v1/completions: a prompt as text or token ids, or a list of prompts of one kind."""

    prompt: str | Prompt | list[str] | list[Prompt]
    logprobs: int | None = Field(None, ge=0, le=5, description="only 0: the sampled tokens' log-probs")
    echo: bool = False

    @model_validator(mode="after")
    def _supported(self, info: ValidationInfo) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo: returning the prompt is not supported (send echo=false)")
        if self.logprobs:
            raise ValueError("logprobs: only 0 is supported (the engine returns the sampled token's log-prob, "
                             "no alternatives)")
        prompts = self.prompts()
        if not prompts:
            raise ValueError("prompt: an empty list")
        limits: Limits | None = info.context
        if limits is not None:
            if len(prompts) > limits.max_batch_size:
                raise ValueError(f"prompt: {len(prompts)} prompts exceed this server's max_batch_size "
                                 f"({limits.max_batch_size})")
            top = max((max(p) for p in prompts if isinstance(p, list)), default=-1)
            if top >= limits.vocab_size:
                raise ValueError(f"prompt: token id {top} is outside the vocabulary [0, {limits.vocab_size})")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: its text or its token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


B = TypeVar("B", bound=_Body)


def one_line(e: BaseException) -> str:
    """An error on one line; for pydantic, the first few failing fields (`loc: message`)."""
    if isinstance(e, ValidationError):
        errors = e.errors(include_url=False, include_input=False)
        shown = []
        for x in errors[:_MAX_ERRORS_SHOWN]:
            msg = x["msg"].removeprefix("Value error, ")
            shown.append(f"{'.'.join(map(str, x['loc']))}: {msg}" if x["loc"] else msg)
        more = f" (and {len(errors) - _MAX_ERRORS_SHOWN} more errors)" if len(errors) > _MAX_ERRORS_SHOWN else ""
        return "; ".join(shown) + more
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text[:500]


def parse_json(raw: bytes, endpoint: str) -> Any:
    """The JSON value of a body; ValueError (one line) if it is not JSON."""
    try:
        return pydantic_core.from_json(raw, allow_inf_nan=False) if raw.strip() else {}
    except ValueError as e:
        raise ValueError(f"{endpoint}: the body is not valid JSON ({one_line(e)})") from None


def validate(model: type[B], data: Any, endpoint: str, limits: Limits | None = None) -> B:
    """`data` (parsed JSON) as `model`; ValueError naming the endpoint and the fields if it breaks a rule."""
    if not isinstance(data, dict):
        raise ValueError(f"{endpoint}: the body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data, context=limits)
    except ValidationError as e:
        raise ValueError(f"{endpoint}: {one_line(e)}") from None


def parse(model: type[B], raw: bytes, endpoint: str, limits: Limits | None = None) -> B:
    return validate(model, parse_json(raw, endpoint), endpoint, limits)


def _refuse_too_many_values(raw: bytes, limits: Limits, endpoint: str) -> None:
    # Parsed JSON takes ~8-30x the bytes of a list of small ints: refuse, before parsing, a body
    # with more values than the largest request this server takes (a few values beside the ids).
    most = limits.max_batch_size * (limits.max_context + MAX_RID_CHARS) + MAX_STOP_TOKEN_IDS + 64  # rids may hold commas
    if raw.count(b",") > most:
        raise ValueError(f"{endpoint}: more values than {limits.max_batch_size} prompts of at most "
                         f"{limits.max_context} tokens can hold")


def parse_generate(raw: bytes, limits: Limits) -> GenerateRequest | BatchGenerateRequest:
    """A /generate body: one prompt (a list of ids) or a batch (a list of lists of ids)."""
    _refuse_too_many_values(raw, limits, "/generate")
    data = parse_json(raw, "/generate")
    ids = data.get("input_ids") if isinstance(data, dict) else None
    batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    return validate(BatchGenerateRequest if batch else GenerateRequest, data, "/generate", limits)


def parse_completion(raw: bytes, limits: Limits) -> CompletionRequest:
    """A /v1/completions body, whose prompts may be token ids (bounded before parsing as /generate's)."""
    _refuse_too_many_values(raw, limits, "/v1/completions")
    return parse(CompletionRequest, raw, "/v1/completions", limits)
